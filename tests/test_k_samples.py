"""bench/k_samples.py (the paper's Fig. 8 on `tiny`): its points are valid runs that differ from the off-policy grid's
N = 1 point only in K, and its verdicts follow the rules its docstring fixed before the K = 4 points ran."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import k_samples  # noqa: E402
import offpolicy  # noqa: E402


def test_k4_points_differ_from_the_off_policy_grids_n1_point_only_in_k():
    from rlhf.config import load_config

    points = k_samples.points()
    for seed in k_samples.SEEDS:
        k2 = load_config(PARAMS, "tiny", points[k_samples.name(2, seed)])
        k4 = load_config(PARAMS, "tiny", points[k_samples.name(4, seed)])
        assert (k2.train.k, k4.train.k, k4.train.seed) == (2, 4, seed)
        assert k4.train.model_copy(update={"k": 2}) == k2.train  # nothing else differs
    assert offpolicy.points((3,))["op-online_dpo-n1-s3"] == points["op-online_dpo-n1-s3"]  # the grid's own point


def _kept(k4_at_quarter: float, k2_at_quarter: float, k4_kl: float) -> pd.DataFrame:
    """Two seeds; K = 2 rises 0.70 (25%) -> 0.80 (50%) or from k2_at_quarter, then flat; K = 4 given at 25%."""
    rows = []
    for seed in (3, 4):
        for f in (0.25, 0.5, 0.75, 1.0):
            k2 = k2_at_quarter if f == 0.25 else 0.8
            k4 = k4_at_quarter if f == 0.25 else 0.81
            rows += [dict(K=2, seed=seed, fraction=f, episode=int(1024 * f), win_rate_vs_sft=k2, kl=8.0)]
            rows += [dict(K=4, seed=seed, fraction=f, episode=int(1024 * f), win_rate_vs_sft=k4, kl=k4_kl + seed)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize(
    "k4_at_quarter, k2_at_quarter, expected",
    [(0.78, 0.7, "holds"), (0.76, 0.7, "does not hold"), (0.6, 0.78, "not testable")],
)
def test_half_the_steps_is_judged_only_where_k2_was_still_rising(k4_at_quarter, k2_at_quarter, expected):
    lines = k_samples.verdicts(_kept(k4_at_quarter, k2_at_quarter, k4_kl=6.0))
    quarter = next(line for line in lines if line.startswith("- K = 4 at 25%"))
    assert quarter.split(": ")[-1].startswith(expected), quarter
    assert "not testable" in next(line for line in lines if line.startswith("- K = 4 at 50%"))  # K = 2 flat 50->100%
    assert "more KL drift in every seed" in lines[-1]  # 9.0, 10.0 against 8.0


def test_more_kl_drift_must_hold_in_every_seed():
    assert "NOT in every seed" in k_samples.verdicts(_kept(0.78, 0.7, k4_kl=4.5))[-1]  # seed 3: 7.5 < 8.0


def test_the_time_rule_needs_k4_faster_to_its_quarter_than_k2_to_its_half_in_every_round():
    rows = [dict(round=r, K=2, **{"s_at_25%": 9.0, "s_at_50%": 12.5}) for r in (1, 2)]
    rows += [dict(round=1, K=4, **{"s_at_25%": 11.0, "s_at_50%": 17.0})]
    rows += [dict(round=2, K=4, **{"s_at_25%": 13.0, "s_at_50%": 19.0})]
    assert k_samples.time_verdict(pd.DataFrame(rows)) == "no (rounds 2 not)"
    rows[-1]["s_at_25%"] = 12.0
    assert k_samples.time_verdict(pd.DataFrame(rows)) == "yes, every round"
