"""bench/decoupled.py (AReaL's naive-vs-decoupled table on `tiny`): its points are valid runs whose variants differ
in their correction only, `list` runs nothing, and the verdicts follow the rule its docstring fixed before any point
ran."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import decoupled  # noqa: E402
import dvc_points  # noqa: E402
import offpolicy  # noqa: E402


def test_every_point_is_a_stale_run_and_a_seeds_variants_differ_in_their_correction_only():
    from rlhf.config import load_config

    points = decoupled.points()
    assert len(points) == 2 * 3 * 3  # RLOO and PPO x naive, tis, decoupled x 3 seeds
    for algorithm in decoupled.ALGORITHMS:
        for seed in decoupled.SEEDS:
            naive, tis, dec = (
                load_config(PARAMS, "tiny", points[f"dc-{algorithm}-{v}-s{seed}"]).train  # a refused point fails here
                for v in ("naive", "tis", "decoupled")
            )
            stale = (naive.trainer, naive.engine, naive.max_staleness, naive.num_mini_batches)
            assert stale == (algorithm, "vllm_async", 4, 4)
            assert naive.seed == seed and (naive.tis_cap, naive.decoupled_cap) == (None, None)
            assert (tis.tis_cap, dec.decoupled_cap) == (offpolicy.TIS_CAP, decoupled.DECOUPLED_CAP)
            assert tis.model_copy(update={"tis_cap": None}) == naive
            assert dec.model_copy(update={"decoupled_cap": None}) == naive
            assert naive.total_episodes // (naive.per_device_train_batch_size * 4) == 16  # generated batches


def test_list_prints_every_point_and_runs_nothing():
    proc = subprocess.run(
        [sys.executable, "bench/decoupled.py", "list"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 18 and lines[0].startswith("dc-rloo-naive-s1: train.trainer=rloo train.engine=vllm_async")
    assert "dc-ppo-decoupled-s3: " in proc.stdout and "train.decoupled_cap=5.0 train.seed=3" in lines[-1]


def _kept(wins: dict[str, dict[float, list[float]]], kls: dict[str, float] | None = None) -> pd.DataFrame:
    """RLOO's kept policies: per variant and kept fraction the win-rates of seeds 1, 2, 3; KL = 4 nats x fraction
    unless `kls` gives a variant's final KL (its half-way policy at half of it)."""
    rows = []
    for variant, by_fraction in wins.items():
        for f, per_seed in by_fraction.items():
            final_kl = (kls or {}).get(variant, 4.0)
            for seed, w in zip(decoupled.SEEDS, per_seed):
                rows.append(
                    dict(algorithm="rloo", variant=variant, seed=seed, fraction=f, episode=int(1024 * f),
                         win_rate_vs_sft=w, kl=final_kl * f)
                )  # fmt: skip
    return pd.DataFrame(rows)


NAIVE = {0.5: [0.60, 0.62, 0.64], 1.0: [0.65, 0.66, 0.67]}


@pytest.mark.parametrize(
    "dec, verdict",
    [
        # d_s = 0.05, 0.05, 0.05 at both: above MARGIN (0.03), no spread
        ({0.5: [0.65, 0.67, 0.69], 1.0: [0.70, 0.71, 0.72]}, "decoupled beats naive"),
        # at 50% d_s = 0.10, 0.00, 0.05: mean 0.05 but spread 0.05: not above the threshold
        ({0.5: [0.70, 0.62, 0.69], 1.0: [0.70, 0.71, 0.72]}, "no difference resolved"),
        # below by 0.05 at both
        ({0.5: [0.55, 0.57, 0.59], 1.0: [0.60, 0.61, 0.62]}, "naive beats decoupled"),
        # within the margin
        ({0.5: [0.62, 0.64, 0.66], 1.0: [0.67, 0.68, 0.69]}, "no difference resolved"),
    ],
)
def test_the_verdict_is_the_rule_fixed_in_advance(dec, verdict):
    kept = _kept({"naive": NAIVE, "tis": NAIVE, "decoupled": dec})
    lines = decoupled.rule(kept, "rloo", "decoupled", "naive")
    assert lines[0] == f"- rloo, decoupled vs naive at S = 4: {verdict}"
    assert lines[1].startswith("  - at 50%: d = ") and lines[2].startswith("  - at 100%: d = ")
    if verdict == "no difference resolved" and dec[0.5][1] == 0.62:
        assert "spread 0.050, threshold 0.050" in lines[1]
    missing = decoupled.rule(kept[kept["fraction"] == 1.0], "rloo", "decoupled", "naive")
    assert missing[0].endswith("not decided (a kept policy not run)")


@pytest.mark.parametrize(
    "dec_kl, expected",
    [
        # 0.05 more win-rate at twice the KL: decoupled's 50% policy sits at naive's final 4 nats with 0.670
        (8.0, "not ahead at equal KL (+0.010)"),
        (4.0, "ahead at equal KL (+0.050)"),  # the same KL
        (2.0, "not testable (decoupled's largest KL 2.00)"),  # naive's final KL beyond decoupled's
    ],
)
def test_the_kl_reading_places_naives_final_policy_on_decoupleds_frontier(dec_kl, expected):
    dec = {0.5: [0.65, 0.67, 0.69], 1.0: [0.70, 0.71, 0.72]}
    kept = _kept({"naive": NAIVE, "decoupled": dec}, {"decoupled": dec_kl})
    line = decoupled.at_equal_kl(kept, "rloo")
    assert line.startswith("- rloo, decoupled at naive's final KL (4.00 nats, naive 0.660): ") and line.endswith(
        expected
    ), line


def test_the_report_writes_the_table_the_verdicts_and_the_diagnostics(monkeypatch, tmp_path):
    pts = decoupled.points()
    wins = {"naive": NAIVE, "tis": NAIVE, "decoupled": {0.5: [0.65, 0.67, 0.69], 1.0: [0.70, 0.71, 0.72]}}
    rows = []
    for name in pts:
        _, algorithm, variant, seed = name.split("-")
        s = int(seed[1:])
        for f in (0.0, 0.25, 0.5, 0.75, 1.0):
            w = 0.5 if f == 0 else wins[variant].get(f, [0.6] * 3)[s - 1]
            rows.append(dict(point=name, algorithm=algorithm, seed=s, fraction=f, episode=int(1024 * f),
                             win_rate_vs_sft=w, kl=4.0 * f))  # fmt: skip
    train_csv = "async/staleness,policy/behav_masked,policy/behav_kl\n4,0.01,0.002\n3,0.03,0.004\n"  # two batches
    monkeypatch.setattr(dvc_points, "experiments", lambda: {n: "rev" for n in pts})
    monkeypatch.setattr(dvc_points, "frontier_rows", lambda exps, p: pd.DataFrame(rows))
    monkeypatch.setattr(dvc_points, "committed", lambda rev, path: train_csv)
    monkeypatch.setattr(offpolicy, "OUT", tmp_path)
    assert decoupled.report(pts) == 0
    text = (tmp_path / "decoupled.md").read_text()
    assert text.startswith("# Naive vs decoupled (AReaL) at S = 4, M = 4, `tiny` (seeds 1, 2, 3)")
    assert "| rloo | decoupled | 50% | 0.670 | 0.650, 0.670, 0.690 | 2.00 |" in text
    for algorithm in ("rloo", "ppo"):
        assert f"- {algorithm}, decoupled vs naive at S = 4: decoupled beats naive" in text
        assert f"- {algorithm}, decoupled vs tis at S = 4: decoupled beats tis" in text
    # the means over the batches; tis's is_weight not logged in this train.csv
    assert re.search(r"\| rloo +\| decoupled +\| +3.5000 \| +0.0200 \| +0.0030 \| +nan \|", text)
    assert len(pd.read_csv(tmp_path / "decoupled.csv")) == 18 * 4  # points x kept policies


def test_the_report_refuses_before_every_point_ran(monkeypatch):
    monkeypatch.setattr(dvc_points, "experiments", lambda: {"dc-rloo-naive-s1": "rev"})
    with pytest.raises(SystemExit, match=r"decoupled: not run yet: \['dc-rloo-naive-s2'"):
        decoupled.report(decoupled.points())
