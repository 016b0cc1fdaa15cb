"""Prefect orchestration of the pipeline: the `rlhf` flow (rlhf_flow.py) and its deployments (deployments.py).

Nothing in the `rlhf` package imports this one: `dvc repro` and `rlhf <stage>` run without Prefect.
"""
