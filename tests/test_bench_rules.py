"""The rules the benchmarks' verdicts are read from (bench/common.py, bench/async_vs_sync.py, bench/vs_trl.py): the
90% interval of a comparison, the paired reward difference and the time-to-quality level, on numbers worked by hand."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import async_vs_sync  # noqa: E402
import common  # noqa: E402
import vs_trl  # noqa: E402


def test_the_interval_is_the_wider_of_eval_noise_and_the_rounds_spread():
    # one round: the eval's own noise, normal: 1.645 * 0.03
    assert common.interval90([0.05], [0.03]) == pytest.approx((0.05 - 1.645 * 0.03, 0.05 + 1.645 * 0.03), abs=1e-3)
    # three rounds that disagree: Student t with 2 d.o.f. over their spread (sd 0.1), wider than the eval noise
    low, high = common.interval90([-0.1, 0.0, 0.1], [0.01, 0.01, 0.01])
    half = stats.t.ppf(0.95, 2) * 0.1 / math.sqrt(3)
    assert (low, high) == pytest.approx((-half, half))
    # three rounds that agree: the eval noise of their mean, sqrt(3 * 0.03^2) / 3
    low, high = common.interval90([0.02, 0.02, 0.02], [0.03, 0.03, 0.03])
    assert high - 0.02 == pytest.approx(1.645 * 0.03 / math.sqrt(3), abs=1e-3)


def test_the_reward_difference_is_paired_by_prompt():
    ours, theirs = [1.0, 2.0, 3.0, 4.0], [0.9, 2.1, 2.8, 4.2]  # differences 0.1, -0.1, 0.2, -0.2
    diff, se = vs_trl.paired(ours, theirs)
    assert diff == pytest.approx(0.0) and se == pytest.approx(math.sqrt((0.01 + 0.01 + 0.04 + 0.04) / 3 / 4))
    with pytest.raises(ValueError):
        vs_trl.paired([1.0], [1.0, 2.0])  # not the same prompts


def test_time_to_quality_reads_the_level_off_the_baselines_own_curve():
    rows = [{"objective/gold": g, "timing/elapsed": 10.0 + t} for t, g in enumerate([0.2, 0.2, 0.5, 0.5, 0.8, 0.8])]
    curve = async_vs_sync.gold_curve(rows)  # window 2: an eighth of 6 batches is less than 2
    assert curve == [(0.2, 11.0), (0.35, 12.0), (0.5, 13.0), (0.65, 14.0), (0.8, 15.0)]
    level = async_vs_sync.quality_level({"curve": curve})  # 0.2 + 2/3 * (0.8 - 0.2): the last quarter is one point
    assert level == pytest.approx(0.6)
    assert async_vs_sync.seconds_to(level, curve) == 14.0
    assert async_vs_sync.seconds_to(0.9, curve) == math.inf  # never reached


def test_a_seed_override_chooses_the_first_seed_and_is_not_passed_on():
    """Passed on after each run's own seed=, it made every seed the same run."""
    assert async_vs_sync.split_seed(["seed=1236", "train.total_episodes=256"]) == (1236, ["train.total_episodes=256"])
    assert async_vs_sync.split_seed(["train.total_episodes=256"]) == (None, ["train.total_episodes=256"])
    with pytest.raises(SystemExit, match="train.seed"):
        async_vs_sync.split_seed(["train.seed=3"])
