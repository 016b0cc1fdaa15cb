"""bench/rm_size.py (the paper's Fig. 5, the reward-model half): its points and the two rules its verdicts are read
by, on numbers made up for the purpose."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import policy_size  # noqa: E402
import rm_size  # noqa: E402
import test_policy_size  # noqa: E402


def test_the_reward_model_sizes_differ_only_in_the_reward_model_and_reuse_the_policy_size_points():
    pts = rm_size.points(rm="/large/rm")
    assert len(pts) == 2 * 2 * 3
    small, large = set(pts["ps-small-n16-s4"]), set(pts["rs-large-n16-s4"])
    assert pts["ps-small-n16-s4"] == policy_size.points()["ps-small-n16-s4"]  # the very same experiment
    assert small - large == {f"reward.pretrained={policy_size.HELD / 'reward_model'}"}
    assert large - small == {"reward.pretrained=/large/rm"}
    # the large reward model: the large policy's width, up to the `reward` stage
    assert rm_size.build_settings() == policy_size.SIZES["large"]


def test_the_second_run_builds_its_own_large_reward_model_from_the_large_sft_at_its_learning_rate():
    (first, first_rm), (second, second_rm) = rm_size.build(), rm_size.build("0.001")
    assert first != second and first_rm != second_rm and second_rm.parent == first_rm.parent  # the first one kept
    assert set(rm_size.build_settings("0.001")) - set(rm_size.build_settings()) == {"sft.learning_rate=0.001"}
    pts = rm_size.points(sft_lr="0.001")
    assert pts["rs-large-lr0.001-n1-s5"][-1] == f"reward.pretrained={second_rm}"
    assert pts["ps-small-n1-s5"] == rm_size.points()["ps-small-n1-s5"]  # the small-RM points: the same experiments


def kept(wins: dict[tuple[str, int], list[float]], kl: dict[str, list[float]]) -> pd.DataFrame:
    """test_policy_size's rows at 25%, 50%, 75% and 100%, with KL per size and seed."""
    return test_policy_size.kept(wins, kl, fractions=(0.25, 0.5, 0.75, 1.0))


SMALL = {("small", 1): [0.70] * 3, ("small", 16): [0.60] * 3}  # retention 0.5 at every seed


@pytest.mark.parametrize(
    ("large_n16", "robust"),
    [
        ([0.60, 0.61, 0.64], "holds"),  # retention 0.5, 0.55, 0.7: +0.08 on average, the seeds' spread 0.1
        ([0.58, 0.60, 0.62], "holds"),  # 0.4, 0.5, 0.6: no more than the small one's
        ([0.68, 0.69, 0.70], "does not hold"),  # 0.9, 0.95, 1.0: tighter, by more than the spread (0.05)
    ],
)
def test_rule_1_a_larger_reward_model_must_not_retain_more_than_the_seeds_spread(large_n16, robust):
    frame = kept({**SMALL, ("large", 1): [0.70] * 3, ("large", 16): large_n16}, {"small": [4] * 3, "large": [4] * 3})
    lines = rm_size.verdict(frame)
    assert f"does not make the policy more robust off-policy {robust} here" in lines[-2]
    assert sum(line.startswith("| ") and "%" in line for line in lines) == 4  # a retention row per kept policy


@pytest.mark.parametrize(
    ("large_kl", "less_over"),
    [
        ([2.0, 2.2, 2.5], "holds"),  # 0.2 / KL: 0.100, 0.091, 0.080 against 0.050 (spread 0.010)
        ([3.5, 4.0, 4.5], "does not hold"),  # 0.057, 0.050, 0.044: within the spread
        ([8.0, 8.0, 8.0], "does not hold"),  # more KL for the same win-rate: more over-optimised
    ],
)
def test_rule_2_a_larger_reward_model_must_gain_more_gold_per_nat_of_kl_than_the_seeds_spread(large_kl, less_over):
    wins = {**SMALL, ("large", 1): [0.70] * 3, ("large", 16): [0.60] * 3}
    lines = rm_size.verdict(kept(wins, {"small": [4.0] * 3, "large": large_kl}))
    assert f"reaches its result at a smaller KL {less_over} here" in lines[-1]


def test_no_robustness_verdict_where_a_size_gained_nothing_on_policy():
    wins = {**SMALL, ("large", 1): [0.51] * 3, ("large", 16): [0.50] * 3}
    lines = rm_size.verdict(kept(wins, {"small": [4.0] * 3, "large": [4.0] * 3}))
    assert "has no verdict" in lines[-2]
