"""Prefect tasks of the pipeline (one per dvc.yaml stage). Imports prefect: only flows/ use this package.

The `rlhf` package never imports this one, so `rlhf <stage>` and `dvc repro` need no Prefect server.
"""
