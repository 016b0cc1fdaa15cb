"""Where metrics go: W&B (offline by default) and plain files that DVC reads as metrics and plots."""

from __future__ import annotations

import csv
import os
from pathlib import Path

from rlhf.config import Config, save_config
from rlhf.io import write_json

STEP = "train/episode"


class Tracker:
    """Log a row of scalars per step; `finish` writes the final metrics JSON. Main process only."""

    def __init__(self, cfg: Config, stage: str, enabled: bool = True):
        self.enabled = enabled
        self.plot_path = cfg.path("plots", f"{stage}.csv")
        self.metrics_path = cfg.path("metrics", f"{stage}.json")
        self.rows: list[dict] = []
        self.run = None
        if not enabled:
            return
        if cfg.tracking.wandb_mode != "disabled":
            import wandb

            mode = os.environ.get("WANDB_MODE", cfg.tracking.wandb_mode) if cfg.tracking.wandb_mode == "offline" else cfg.tracking.wandb_mode
            self.run = wandb.init(project=cfg.tracking.wandb_project, job_type=stage, mode=mode, config=cfg.model_dump(mode="json"), dir=os.environ.get("WANDB_DIR"))
            self.run.define_metric(STEP)
            self.run.define_metric("*", step_metric=STEP)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        if self.run is not None:
            self.run.log(row)

    def table(self, name: str, columns: list[str], data: list[list]) -> None:
        if self.enabled and self.run is not None:
            import wandb

            self.run.log({name: wandb.Table(columns=columns, data=data)})

    def finish(self, final: dict) -> None:
        if not self.enabled:
            return
        self.plot_path.parent.mkdir(parents=True, exist_ok=True)
        keys = sorted({k for r in self.rows for k in r})
        tmp = self.plot_path.with_suffix(".tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        tmp.replace(self.plot_path)
        write_json(self.metrics_path, final)
        if self.run is not None:
            self.run.summary.update(final)
            self.run.finish()


def save_run_config(cfg: Config, folder: Path) -> None:
    save_config(cfg, folder / "config.yaml")
