"""bench/policy_size.py (the paper's Fig. 5, the policy half): its points and the rule its verdict is read by, on
numbers made up for the purpose."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import policy_size  # noqa: E402


def test_the_sizes_differ_only_in_the_models_width_and_share_the_held_reward_model():
    pts = policy_size.points(rm="/held/rm")
    assert len(pts) == 2 * 2 * 3 and next(iter(pts)).startswith("ps-large")  # queued first: the longest
    for size, n, seed in [("small", 1, 3), ("large", 16, 5)]:
        settings = set(pts[f"ps-{size}-n{n}-s{seed}"])
        assert {f"train.num_mini_batches={n}", f"train.seed={seed}", "reward.pretrained=/held/rm"} <= settings
    small, large = set(pts["ps-small-n1-s3"]), set(pts["ps-large-n1-s3"])
    assert large - small == {"model.hidden_size=256", "model.intermediate_size=768"} and small < large


def test_the_second_run_changes_the_large_sft_learning_rate_only_and_reuses_the_small_points():
    first, second = policy_size.points(rm="/held/rm"), policy_size.points(rm="/held/rm", sft_lr="0.001")
    assert {n: s for n, s in second.items() if n.startswith("ps-small-")} == {
        n: s for n, s in first.items() if n.startswith("ps-small-")
    }
    assert set(second["ps-large-lr0.001-n16-s4"]) - set(first["ps-large-n16-s4"]) == {"sft.learning_rate=0.001"}
    assert not set(first["ps-large-n16-s4"]) - set(second["ps-large-lr0.001-n16-s4"])
    assert len(second) == len(first) and not set(second) & {n for n in first if n.startswith("ps-large")}
    third = policy_size.points(rm="/held/rm", sft_lr="0.001", rl_lr="0.00015")  # and the large RL step halved
    assert set(third["ps-large-lr0.001-rl0.00015-n1-s3"]) - set(second["ps-large-lr0.001-n1-s3"]) == {
        "train.learning_rate=0.00015"
    }
    assert third["ps-small-n1-s3"] == first["ps-small-n1-s3"] and not set(third) & {n for n in second if "large" in n}


def kept(wins: dict[tuple[str, int], list[float]], kl=None, fractions=(0.25, 0.5, 1.0)) -> pd.DataFrame:
    """Kept-policy rows at `fractions`: (size, N) -> win-rate vs SFT per seed, the same at every fraction; `kl`:
    size -> KL per seed (default 1)."""
    rows = [
        {"algorithm": size, "N": n, "S": 0, "seed": seed, "fraction": f, "win_rate_vs_sft": w, "kl": k}
        for (size, n), per_seed in wins.items()
        for seed, w, k in zip(policy_size.SEEDS, per_seed, (kl or {}).get(size, [1.0] * len(per_seed)))
        for f in fractions
    ]
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    ("large_n16", "expected"),
    [
        ([0.68, 0.69, 0.70], "holds"),  # retention 0.9, 0.95, 1.0 against the small one's 0.5 (spread 0.05)
        ([0.60, 0.61, 0.64], "does not hold"),  # 0.5, 0.55, 0.7: +0.08 on average, the seeds' spread 0.1
        ([0.58, 0.60, 0.62], "does not hold"),  # 0.4, 0.5, 0.6: no more than the small one's
    ],
)
def test_the_larger_policy_must_retain_more_than_the_seeds_spread(large_n16, expected):
    frame = kept(
        {("small", 1): [0.70] * 3, ("small", 16): [0.60] * 3, ("large", 1): [0.70] * 3, ("large", 16): large_n16}
    )
    lines = policy_size.verdict(frame)
    assert f"is more robust off-policy {expected} here" in lines[-1]
    assert sum(line.startswith("| ") for line in lines) == 1 + 3  # the header and a row per kept policy


def test_no_verdict_where_a_size_gained_nothing_on_policy():
    frame = kept(
        {("small", 1): [0.51] * 3, ("small", 16): [0.50] * 3, ("large", 1): [0.70] * 3, ("large", 16): [0.7] * 3}
    )
    assert policy_size.verdict(frame)[-1].startswith("No verdict")
