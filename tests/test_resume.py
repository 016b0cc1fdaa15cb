"""Exact resume: SIGKILL the `train` stage at chosen points, run it again, get the uninterrupted run's results.

Crash points (rlhf.runtime.crash_point, set through RLHF_CRASH_AT): after an optimizer step with nothing saved
yet, and in the middle of writing a checkpoint (a torn folder that must never be loaded). The async engine is
mid-batch at both: it samples batch t+1 while the learner trains batch t.
"""

import csv
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

EPISODES = 32  # 4 generated batches of 8 prompts on `ci`


def run_stage(data_dir, trainer, crash=None):
    env = {k: v for k, v in os.environ.items() if k != "RLHF_CRASH_AT"}
    if crash:
        env["RLHF_CRASH_AT"] = crash
    cmd = [
        sys.executable,
        "-m",
        "rlhf.cli",
        "--params",
        str(ROOT / "params.yaml"),
        "--profile",
        "ci",
        "train",
        "--trainer",
        trainer,
        f"data_dir={data_dir}",
        "tracking.wandb_mode=disabled",
        "train.save_every=1",
        f"train.total_episodes={EPISODES}",
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def results(data_dir):
    """Everything the run produced except wall-clock figures: metrics, per-batch rows, policy weights."""
    with open(data_dir / "plots" / "train.csv") as f:
        rows = [{k: v for k, v in r.items() if not k.startswith("timing/") and k != "eps"} for r in csv.DictReader(f)]
    weights = hashlib.sha256((data_dir / "train" / "policy" / "model.safetensors").read_bytes()).hexdigest()
    return json.loads((data_dir / "metrics" / "train.json").read_text()), rows, weights


@pytest.mark.parametrize("trainer", ["online_dpo", "online_dpo_vllm"])  # sync HF engine; async vLLM engine, N=1
def test_a_killed_run_resumes_to_exactly_the_uninterrupted_result(ci_data, tmp_path, trainer):
    crashed = tmp_path / "crashed"
    shutil.copytree(ci_data, crashed)
    done = run_stage(ci_data, trainer)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any((ci_data / "checkpoints").iterdir())  # a finished run removes its resume points

    first = run_stage(crashed, trainer, crash="after_update:1")  # batch 1 trained, only batch 0's checkpoint saved
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    [ckpt_dir] = (crashed / "checkpoints").iterdir()
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["batch-000001"]
    saved = {p.name for p in (ckpt_dir / "batch-000001").iterdir()}
    assert {
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "random_states_0.pkl",
        "rank_state_0.json",
        "metric_rows.json",
        "trainer_state.json",
    } <= saved
    second = run_stage(crashed, trainer, crash="checkpoint_write:3")  # killed writing the checkpoint after 3 batches
    assert second.returncode == -signal.SIGKILL, second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    torn = ckpt_dir / ".tmp-batch-000003"
    assert torn.is_dir() and not (torn / "trainer_state.json").exists()
    if trainer == "online_dpo_vllm":  # the weights of the batch the engine was sampling ahead are kept
        assert (ckpt_dir / "batch-000002" / "engine" / "v000001" / "model.safetensors").is_file()

    last = run_stage(crashed, trainer)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "batch-000002 (batch 2)" in last.stdout + last.stderr  # the torn batch-3 checkpoint was never loaded
    assert results(crashed) == results(ci_data)
