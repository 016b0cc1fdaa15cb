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
import smollm2_learns  # noqa: E402
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


def _run(side: str, rep: int, wall: float, rewards: list[float], kls: list[float]) -> dict:
    return dict(
        side=side, algo="online_dpo", rep=rep, wall_seconds=wall, loop_seconds=wall / 2, train_seconds=wall,
        peak_rss_bytes=1, final_proxy_reward=sum(rewards) / len(rewards), final_kl=sum(kls) / len(kls), threads=2,
        prompt_rewards=rewards, prompt_kls=kls, reward_check_max_abs_diff=0.0,
    )  # fmt: skip


def test_the_comparison_with_tempered_trl_pairs_against_that_side_and_judges_no_speed_target():
    runs = [
        _run("ours", 1, 10.0, [1.0, 1.2], [4.0, 6.0]),
        _run("trl", 1, 20.0, [1.3, 1.5], [8.0, 10.0]),
        _run("trl_tempered", 1, 30.0, [1.0, 1.2], [4.5, 6.5]),
    ]
    plain = vs_trl.compare("online_dpo", runs, "ours", 1)
    assert plain["online_dpo/reward_ours_minus_trl"] == pytest.approx(-0.3)
    assert plain["online_dpo/kl_ours_minus_trl"] == pytest.approx(-4.0)
    assert plain["online_dpo/speedup_wall"] == pytest.approx(2.0) and plain["online_dpo/target_met"] == 0
    tempered = vs_trl.compare("online_dpo", runs, "ours", 1, theirs="trl_tempered")
    assert tempered["online_dpo/vs_tempered_reward_ours_minus_trl"] == pytest.approx(0.0)
    assert tempered["online_dpo/vs_tempered_reward_equal"] == 1
    assert tempered["online_dpo/vs_tempered_kl_ours_minus_trl"] == pytest.approx(-0.5)
    assert tempered["online_dpo/vs_tempered_speedup_wall"] == pytest.approx(3.0)
    assert "online_dpo/vs_tempered_target_met" not in tempered


def test_tempered_trl_scores_and_samples_from_the_logits_over_t():
    """trl_side.temper_logits: every forward's logits / T, so TRL's log_softmax is of the tempered policy and its
    sampling at temperature 1 draws from softmax(logits / T), as ours."""
    import torch
    import trl_side

    from rlhf.config import ModelConfig
    from rlhf.models import tiny

    tok = tiny.train_word_tokenizer(["a b c d e f g h"] * 4, 64)
    model = tiny.build_tiny_model(ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32), tok, 0)
    ids = torch.tensor([[3, 4, 5, 6]])
    raw = model(input_ids=ids).logits
    trl_side.temper_logits(model, 0.7)
    assert torch.allclose(model(input_ids=ids).logits, raw / 0.7)


def test_a_partial_benchmark_run_replaces_its_own_entries_and_keeps_the_rest(tmp_path):
    path = tmp_path / "vs_trl.json"
    path.write_text('{"online_dpo/speedup_wall": 1.0, "online_dpo/old_key": 3, "rloo/speedup_wall": 1.4}')
    out = common.merged(path, {"online_dpo/speedup_wall": 1.2}, ["online_dpo"])
    assert out == {"online_dpo/speedup_wall": 1.2, "rloo/speedup_wall": 1.4}  # no stale online_dpo key survives
    assert common.merged(tmp_path / "missing.json", {"a/b": 1}, ["a"]) == {"a/b": 1}


def test_smollm2_learns_reads_finished_experiments_only():
    """A running experiment shows the workspace's metrics (those of the experiment before it): counting it gave the
    second seed the first seed's win-rate (seen on 2026-12-03, report run while seed 1235 trained)."""

    def exp(name, win, state=None):
        metrics = {"data/metrics/eval.json": {"data": {"gold/win_rate_vs_sft": win}}}
        executor = None if state is None else {"state": state, "name": "workspace"}
        return {
            "name": name,
            "executor": executor,
            "revs": [{"name": name, "rev": f"r{name[1:]}", "data": {"metrics": metrics}}],
        }

    shown = [{"rev": "workspace"}, {"rev": "abc", "experiments": [exp("s1235", 0.68, "running"), exp("s1234", 0.68)]}]
    assert smollm2_learns.finished(shown) == {"s1234": {"gold/win_rate_vs_sft": 0.68, "rev": "r1234"}}
    shown[1]["experiments"][0]["executor"] = {"state": "success"}  # ended: its own metrics now
    assert set(smollm2_learns.finished(shown)) == {"s1234", "s1235"}
