"""bench/ppo_epochs.py (the paper's Fig. 7 on `tiny`): its points are valid runs that differ from the off-policy
grid's N = 1 point only in E, and its verdicts follow the rules its docstring fixed before the E > 1 points ran."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import dvc_points  # noqa: E402
import offpolicy  # noqa: E402
import ppo_epochs  # noqa: E402


def test_more_epochs_differ_from_the_off_policy_grids_n1_point_only_in_e():
    from rlhf.config import load_config

    points = ppo_epochs.points()
    for seed in ppo_epochs.SEEDS:
        base = load_config(PARAMS, "tiny", points[ppo_epochs.name(1, seed)])
        for epochs in (2, 4):
            more = load_config(PARAMS, "tiny", points[ppo_epochs.name(epochs, seed)])
            assert (base.train.num_ppo_epochs, more.train.num_ppo_epochs, more.train.seed) == (1, epochs, seed)
            assert more.train.model_copy(update={"num_ppo_epochs": 1}) == base.train  # nothing else differs
    assert offpolicy.points((3,))["op-online_dpo-n1-s3"] == points["op-online_dpo-n1-s3"]  # the grid's own point


def _kept(wins: dict[int, list[float]], kls: dict[int, list[float]]) -> pd.DataFrame:
    """Two seeds alike; per E its win-rates and KLs at the kept policies 25, 50, 75 and 100%."""
    rows = [
        dict(E=e, seed=seed, fraction=f, episode=int(1024 * f), win_rate_vs_sft=w, kl=k)
        for e in wins
        for seed in (3, 4)
        for f, w, k in zip((0.25, 0.5, 0.75, 1.0), wins[e], kls[e])
    ]
    return pd.DataFrame(rows)


E1 = dict(win=[0.70, 0.76, 0.77, 0.78], kl=[4.0, 6.0, 8.0, 9.0])  # rising by 0.06 from 25% to 50%, then 0.02


@pytest.mark.parametrize(
    "e2_wins, expected",
    [([0.75, 0.78, 0.79, 0.80], "holds"), ([0.72, 0.78, 0.79, 0.80], "does not hold")],
)
def test_data_efficiency_is_judged_only_where_e1_was_still_rising(e2_wins, expected):
    kept = _kept({1: E1["win"], 2: e2_wins, 4: e2_wins}, {1: E1["kl"], 2: E1["kl"], 4: E1["kl"]})
    line = ppo_epochs.efficiency(kept.groupby(["E", "fraction"])["win_rate_vs_sft"].mean(), 2)
    assert line.splitlines()[0] == f"- E = 2, more data-efficient: {expected}"
    assert "at 50%" in line and "not testable (E = 1 gained +0.020" in line  # 0.76 -> 0.78: the judge is flat
    flat = _kept({1: [0.78, 0.79, 0.79, 0.79], 2: e2_wins}, {1: E1["kl"], 2: E1["kl"]})
    assert "data-efficient: not testable" in ppo_epochs.efficiency(
        flat.groupby(["E", "fraction"])["win_rate_vs_sft"].mean(), 2
    )


@pytest.mark.parametrize(
    "e2_kls, expected",
    [
        ([8.0, 12.0, 16.0, 18.0], "holds"),  # the same win-rates at twice the KL: at 4 nats E = 2 has 0.5 + 0.2 / 2
        ([4.0, 6.0, 8.0, 9.0], "does not hold"),  # the same frontier
        ([1.0, 2.0, 3.0, 4.5], "not testable"),  # one of E = 1's KLs (4.0) within E = 2's range
    ],
)
def test_the_frontier_is_compared_at_e1s_kl_within_es_range(e2_kls, expected):
    kept = _kept({1: E1["win"], 2: E1["win"]}, {1: E1["kl"], 2: e2_kls})
    line = ppo_epochs.frontier_shift(kept, 2)
    assert line.split("): ")[-1].startswith(expected), line


def test_the_report_writes_the_table_and_both_verdicts_per_e(monkeypatch, tmp_path):
    pts = ppo_epochs.points((3, 4))
    rows = []
    for name, settings in pts.items():
        epochs = int(dict(s.split("=", 1) for s in settings).get("train.num_ppo_epochs", 1))
        for f, w, k in zip((0.0, 0.25, 0.5, 0.75, 1.0), [0.5, *E1["win"]], [0.0, *E1["kl"]]):
            row = dict(point=name, seed=int(name[-1]), fraction=f, episode=int(1024 * f), win_rate_vs_sft=w)
            rows.append({**row, "kl": k * epochs})
    monkeypatch.setattr(dvc_points, "experiments", lambda: {n: "rev" for n in pts})
    monkeypatch.setattr(dvc_points, "frontier_rows", lambda exps, p: pd.DataFrame(rows))
    monkeypatch.setattr(offpolicy, "OUT", tmp_path)
    assert ppo_epochs.report(pts, early=False) == 0
    text = (tmp_path / "ppo_epochs.md").read_text()
    assert text.startswith("# Online DPO, E = 1, 2, 4 passes over each generated batch, `tiny` (seeds 3, 4)")
    assert re.search(r"\|\s+4 \|\s+0.25 \|\s+256 \|\s+0.700 \|\s+16.00 \|\s+0.000 \|", text)  # E, kept policy: means
    for e in (2, 4):  # the same win-rates at E times the KL: not more data-efficient, the frontier moved
        assert f"- E = {e}, more data-efficient: does not hold" in text
        assert f"- E = {e}, the frontier moved" in text and text.count("): holds (E = 1 ahead by") == 2
    assert len(pd.read_csv(tmp_path / "ppo_epochs.csv")) == 3 * 2 * 4  # E x seeds x kept policies


def test_the_early_points_differ_from_the_first_runs_only_in_the_kept_policies():
    from rlhf.config import load_config

    first, early = ppo_epochs.points(), ppo_epochs.points(early=True)
    for epochs in ppo_epochs.EPOCHS:
        for seed in ppo_epochs.SEEDS:
            a = load_config(PARAMS, "tiny", first[ppo_epochs.name(epochs, seed)])
            b = load_config(PARAMS, "tiny", early[f"pe-early-online_dpo-e{epochs}-s{seed}"])
            assert b.train.eval_checkpoints == list(ppo_epochs.EARLY)
            assert b.train.model_copy(update={"eval_checkpoints": a.train.eval_checkpoints}) == a.train


@pytest.mark.parametrize("kl_early, expected", [(9.43, "the same"), (9.44, "NOT the same")])
def test_the_early_run_checks_its_e1_final_policies_against_the_first_runs(monkeypatch, kl_early, expected):
    early = ppo_epochs.points((3,), early=True)
    names = ["op-online_dpo-n1-s3", "pe-early-online_dpo-e1-s3"]
    rows = [dict(point=n, seed=3, fraction=1.0, win_rate_vs_sft=0.76, kl=kl) for n, kl in zip(names, (9.43, kl_early))]
    monkeypatch.setattr(dvc_points, "experiments", lambda: {})
    monkeypatch.setattr(
        dvc_points, "frontier_rows", lambda exps, pts: pd.DataFrame(rows)[lambda f: f["point"].isin(pts)]
    )
    assert ppo_epochs.same_final_policies(early)[0].endswith(f"seed by seed: {expected}")
