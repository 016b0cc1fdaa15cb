"""Stage `report`: data/report/index.html, the run's results for a person (rlhf/report.py draws it), and its
headline table printed. A DVC stage after evaluate, so `dvc exp run` redraws the page with the experiment's results,
and `dvc exp apply` / `dvc checkout` bring back the page that goes with the results in the workspace."""

from __future__ import annotations

from pathlib import Path

from rlhf.config import DEFAULT_PARAMS, Config


def run(cfg: Config, params: Path | str = DEFAULT_PARAMS) -> dict:
    """Print the headline table and write the page; `params`: the file whose profile the header's changed parameters
    are measured against."""
    from rlhf.report import print_report

    print_report(cfg, params)
    return {}
