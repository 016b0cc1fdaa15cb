"""What the benchmarks share: a scratch data dir over the pipeline's outputs, and a timed `train` run's rows."""

from __future__ import annotations

import csv
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_INPUTS = ("prepared", "gold", "sft", "reward")


def scratch_data(dst: Path, inputs: tuple[str, ...] = PIPELINE_INPUTS) -> Path:
    """A data dir that shares the pipeline's `inputs` (symlinks) and gets its own train/ and metrics/."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for name in inputs:
        if not (ROOT / "data" / name).exists():
            raise SystemExit(f"{ROOT / 'data' / name} is missing: run `make run` (or `dvc repro reward`) first")
        (dst / name).symlink_to((ROOT / "data" / name).resolve())
    return dst


def timed_train(cfg) -> tuple[float, list[dict]]:
    """Run `train(cfg)`: its wall seconds (model loading and engine start-up included) and its train.csv rows."""
    from rlhf.trainers.loop import train

    start = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - start
    with open(cfg.path("plots", "train.csv")) as f:
        return wall, list(csv.DictReader(f))


def column_sum(rows: list[dict], key: str) -> float:
    """Sum of a train.csv column over the run (a row without it counts 0)."""
    return sum(float(r.get(key) or 0) for r in rows)
