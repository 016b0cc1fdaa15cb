"""Where metrics go: W&B (offline by default) and plain files that DVC reads as metrics and plots."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf.config import Config
from rlhf.io import write_json, write_text

if TYPE_CHECKING:
    import pandas as pd

STEP = "train/episode"
AXES = (STEP, "train/global_step")  # in both of a run's row files, so each reads on its own
COMPLETION_COLUMNS = ["prompt", "completion", "reward", "gold"]


def is_wall_clock(column: str) -> bool:
    """timing/* and eps: figures that differ between identical runs (and between boxes)."""
    return column.startswith("timing/") or column == "eps"


def row_files(data_dir: Path | str, stage: str = "train") -> tuple[Path, Path]:
    """Where a run's rows go: plots/<stage>.csv (the results, tracked in git) and timing/<stage>.csv (their
    wall-clock columns, an output of its own in dvc.yaml on which no stage depends: a rerun with the same results
    changes only its hash in dvc.lock, and nothing downstream reruns)."""
    return Path(data_dir) / "plots" / f"{stage}.csv", Path(data_dir) / "timing" / f"{stage}.csv"


def logged_rows(data_dir: Path | str, stage: str = "train") -> list[dict[str, str]]:
    """A run's rows as `Tracker.finish` wrote them, as strings: plots/<stage>.csv (the results, tracked in git)
    joined row by row with timing/<stage>.csv (the wall-clock columns, a DVC output)."""
    results, timing = row_files(data_dir, stage)
    with open(results) as f:
        rows = list(csv.DictReader(f))
    if not timing.exists():
        return rows
    with open(timing) as f:
        clock = list(csv.DictReader(f))
    same_run(timing, len(clock), results, len(rows))
    return [{**r, **t} for r, t in zip(rows, clock)]


def same_run(timing: Path, timing_rows: int, results: Path, result_rows: int) -> None:
    """A timing file with another row count than the results beside it is another run's: a ValueError naming it."""
    if timing_rows != result_rows:
        raise ValueError(
            f"{timing}: {timing_rows} rows for the {result_rows} of {results}: not written by the same run"
        )


WANDB_MODES = ("online", "offline", "disabled")


def wandb_mode(setting: str, env: Mapping[str, str]) -> str:
    """The W&B mode for `tracking.wandb_mode=setting`: offline by default, online once the user gives a key.

    "online"/"disabled" are taken as they are. For "offline" (the default) an explicit WANDB_MODE wins;
    otherwise a WANDB_API_KEY makes the run online. Offline runs land in $WANDB_DIR (.cache/wandb) and can be
    uploaded later with `wandb sync`.
    """
    if setting != "offline":
        return setting
    if env.get("WANDB_MODE"):
        if env["WANDB_MODE"] not in WANDB_MODES:
            raise ValueError(
                f"environment variable WANDB_MODE={env['WANDB_MODE']!r}: expected one of {', '.join(WANDB_MODES)}"
            )
        return env["WANDB_MODE"]
    return "online" if env.get("WANDB_API_KEY") else "offline"


def start_wandb(cfg: Config, stage: str, run_id: str | None = None):
    """A W&B run of job_type `stage` in the mode wandb_mode() picks; run_id continues a resumed run."""
    import wandb

    mode = wandb_mode(cfg.tracking.wandb_mode, os.environ)
    try:
        return wandb.init(
            project=cfg.tracking.wandb_project,
            job_type=stage,
            mode=mode,
            config=cfg.model_dump(mode="json"),
            dir=os.environ.get("WANDB_DIR"),
            id=run_id,
            resume="allow" if run_id else None,
        )
    except wandb.errors.UsageError as e:  # e.g. online without a key: one line, not W&B's traceback
        raise ValueError(
            f"tracking.wandb_mode={mode}: W&B refused to start ({str(e).splitlines()[0]}); set WANDB_API_KEY "
            "or use tracking.wandb_mode=offline (and `wandb sync` later)"
        ) from None


def log_results(
    cfg: Config,
    stage: str,
    summary: Mapping[str, float],
    tables: Mapping[str, pd.DataFrame] | None = None,
    images: Mapping[str, bytes] | None = None,
) -> None:
    """One W&B run of job_type `stage` holding results rather than curves: `summary`, each table as a W&B table
    and each PNG as an image (evaluate: the frontier; `rlhf report`: its charts). Nothing when W&B is disabled."""
    if cfg.tracking.wandb_mode == "disabled":
        return
    import wandb
    from PIL import Image

    run = start_wandb(cfg, stage)
    logged = {name: wandb.Table(dataframe=df) for name, df in (tables or {}).items()}
    logged |= {name: wandb.Image(Image.open(io.BytesIO(png))) for name, png in (images or {}).items()}
    run.log(logged)
    run.summary.update(dict(summary))
    run.finish()


class Tracker:
    """Log a row of scalars per step; `finish` writes the final metrics JSON. Main process only."""

    def __init__(
        self, cfg: Config, stage: str, enabled: bool = True, rows: list[dict] | None = None, run_id: str | None = None
    ):
        """rows/run_id: a resumed run's history from its checkpoint; W&B continues the same run."""
        self.enabled = enabled
        self.plot_path, self.timing_path = row_files(cfg.data_dir, stage)
        self.metrics_path = cfg.path("metrics", f"{stage}.json")
        self.rows: list[dict] = list(rows or [])
        self.run = None
        if not enabled:
            return
        if cfg.tracking.wandb_mode != "disabled":
            self.run = start_wandb(cfg, stage, run_id)
            self.run.define_metric(STEP)
            self.run.define_metric("*", step_metric=STEP)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    @property
    def logs_tables(self) -> bool:
        """Whether `completions` goes anywhere (W&B on, main process): callers skip decoding text for it if not."""
        return self.enabled and self.run is not None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        if self.run is not None:
            self.run.log(row)

    def completions(
        self,
        episode: int,
        prompts: Sequence[str],
        completions: Sequence[str],
        rewards: Sequence[float],
        gold: Sequence[float] | None = None,
        max_rows: int = 16,
    ) -> None:
        """Log a W&B table `completions` (prompt, completion, reward, gold) at `episode` on the RL axis.

        prompts: [N] (repeat each prompt for its k samples); completions/rewards/gold: [N] aligned with them.
        gold: the gold judge's score per completion (None when no judge: the column stays empty).
        Only the first `max_rows` rows go out: a sample to read, not a dataset.
        """
        if not self.logs_tables:
            return
        n = len(completions)
        if not (len(prompts) == n == len(rewards) and (gold is None or len(gold) == n)):
            raise ValueError(
                f"completions table: prompts ({len(prompts)}), completions ({n}), rewards ({len(rewards)}) and gold "
                f"({'-' if gold is None else len(gold)}) must have one entry per completion"
            )
        import wandb

        rows = [
            [prompts[i], completions[i], float(rewards[i]), None if gold is None else float(gold[i])]
            for i in range(min(n, max_rows))
        ]
        self.run.log({"completions": wandb.Table(columns=COMPLETION_COLUMNS, data=rows), STEP: episode})

    def finish(self, final: dict) -> None:
        if not self.enabled:
            return
        # The results and the wall-clock columns apart: a rerun of the same run on the same box leaves the tracked
        # plots file (and dvc.lock's hash of it) unchanged, and `git status` shows only what changed in results.
        results = [{k: v for k, v in r.items() if not is_wall_clock(k)} for r in self.rows]
        clock = [{k: v for k, v in r.items() if is_wall_clock(k) or k in AXES} for r in self.rows]
        write_text(self.plot_path, _csv_text(results))
        write_text(self.timing_path, _csv_text(clock))
        write_json(self.metrics_path, final)
        if self.run is not None:
            self.run.summary.update(final)
            self.run.finish()


def _csv_text(rows: list[dict]) -> str:
    table = io.StringIO()
    w = csv.DictWriter(table, fieldnames=sorted({k for r in rows for k in r}))
    w.writeheader()
    w.writerows(rows)
    return table.getvalue()
