"""bench/pipeline_seeds.py: its seeds are valid `tiny` runs differing only in the top-level seed, and another box's
result is judged against the seeds' range as its docstring fixed before the seeds ran."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from conftest import PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import pipeline_seeds  # noqa: E402


def test_the_seeds_differ_only_in_the_top_level_seed_and_the_first_is_params_yamls():
    from rlhf.config import load_config

    configs = [load_config(PARAMS, "tiny", s) for s in pipeline_seeds.points().values()]
    assert configs[0] == load_config(PARAMS, "tiny", [])  # seed 1234: the committed run itself
    assert [c.seed for c in configs] == list(pipeline_seeds.SEEDS)
    assert all(c.model_copy(update={"seed": 1234}) == configs[0] for c in configs)


def test_another_box_is_within_the_seeds_range_or_not():
    values = {"gold win-rate vs SFT": np.array([0.74, 0.70, 0.80, 0.76, 0.72])}  # range 0.10
    stats, rows = pipeline_seeds.table(values)
    assert round(stats["gold win-rate vs SFT"]["max"] - stats["gold win-rate vs SFT"]["min"], 3) == 0.1
    assert rows[-1].startswith("| gold win-rate vs SFT | 0.744 | 0.038 | 0.700 | 0.800 |")
    near = pipeline_seeds.against_other(values, {"gold win-rate vs SFT": 0.83}, "abc")  # +0.09
    far = pipeline_seeds.against_other(values, {"gold win-rate vs SFT": 0.85}, "abc")  # +0.11
    assert near[-1].endswith("| +0.090 | 0.100 | yes |") and far[-1].endswith("| +0.110 | 0.100 | no |")


def test_an_other_rev_without_the_metrics_is_one_line_naming_it(monkeypatch, tmp_path):
    import json
    import subprocess

    import pytest

    def committed(rev: str, path: str) -> str:
        if rev == "nope":
            raise subprocess.CalledProcessError(128, ["git", "show"], stderr="fatal: invalid object name 'nope'.\n")
        return json.dumps({key: 0.5 for _, key in pipeline_seeds.METRICS.values()})

    monkeypatch.setattr(pipeline_seeds, "experiments", lambda: {n: "rev" for n in pipeline_seeds.points()})
    monkeypatch.setattr(pipeline_seeds, "committed", committed)
    monkeypatch.setattr(pipeline_seeds, "OUT", tmp_path)
    with pytest.raises(SystemExit) as stop:
        pipeline_seeds.report("nope")
    assert str(stop.value) == (
        "pipeline_seeds: --other-rev nope: no seed-1234 run's metrics there (fatal: invalid object name 'nope'.)"
    )
    assert not (tmp_path / "pipeline_seeds.md").exists()  # nothing half-written
    assert pipeline_seeds.report("rev") == 0 and "| yes |" in (tmp_path / "pipeline_seeds.md").read_text()
