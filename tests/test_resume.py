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

import pytest
import torch
from conftest import COMMAND_TIMEOUT, ROOT, accelerate_launch, rlhf_command
from safetensors import safe_open

from rlhf.config import TrainConfig
from rlhf.tracking import is_wall_clock, logged_rows
from rlhf.trainers.frontier import frontier_batches

pytestmark = pytest.mark.slow

EPISODES = 32  # 4 generated batches of 8 prompts on `ci`


def run_stage(data_dir, trainer, crash=None, processes=1, extra=()):
    """`rlhf train` in a process of its own; with 2 processes under accelerate launch (DeepSpeed ZeRO-2)."""
    env = {k: v for k, v in os.environ.items() if k != "RLHF_CRASH_AT"}
    if crash:
        env["RLHF_CRASH_AT"] = crash
    settings = [f"data_dir={data_dir}", "tracking.wandb_mode=disabled", "train.save_every=1", *extra]
    settings.append(f"train.total_episodes={EPISODES * processes}")
    launcher = accelerate_launch("zero2", processes) if processes > 1 else ()
    cmd = rlhf_command("--profile", "ci", "train", "--trainer", trainer, *settings, launcher=launcher)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)


def killed(proc, processes: int) -> bool:
    """SIGKILLed: the process itself, or under accelerate launch a rank (the launcher then stops the others)."""
    if processes == 1:
        return proc.returncode == -signal.SIGKILL
    return proc.returncode != 0 and "Signal 9 (SIGKILL)" in proc.stderr


def results(data_dir):
    """Everything the run produced except wall-clock figures: metrics, per-batch rows, the policy's weights and
    those of the policies kept for the frontier (train.eval_checkpoints)."""
    with open(data_dir / "plots" / "train.csv") as f:  # the results; the wall-clock columns: timing/train.csv
        rows = list(csv.DictReader(f))
    assert not any(is_wall_clock(k) for k in rows[0])
    policies = [data_dir / "train" / "policy", *sorted((data_dir / "train" / "frontier").iterdir())]
    kept = frontier_batches(TrainConfig().eval_checkpoints, num_batches=len(rows))  # the ci profile's default
    assert len(policies) == 1 + len(kept), policies
    weights = {p.name: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in policies}
    return json.loads((data_dir / "metrics" / "train.json").read_text()), rows, weights


def rows(data_dir) -> list[dict]:
    """The run's rows as logged: plots/train.csv's results and timing/train.csv's wall-clock columns."""
    return logged_rows(data_dir)


# sync HF engine; async vLLM engine, N=1, as a Ray actor (the engine process: the two-rank test below; two Ray
# engines: tests/test_async_engines.py and test_async_training.py); the engine process with the learner sampling the
# first 2 of the 4 batches while the engine starts (train.learner_first_batches), the engine scoring its own batches;
# the engine process with in-flight weight updates (each batch takes the next version half-way through its tokens).
# Resumed runs equal to the uninterrupted one, each in a process of its own: also a determinism test of the engines.
@pytest.mark.parametrize(
    "trainer, extra, staleness",
    [
        ("online_dpo", (), [0, 0, 0, 0]),
        ("online_dpo_vllm", ("train.engine_backend=ray", "train.num_engines=1"), [0, 1, 1, 1]),
        ("online_dpo_vllm", ("train.learner_first_batches=2", "train.score_in_engine=always"), [0, 0, 1, 1]),
        ("online_dpo_vllm", ("train.weight_updates=in_flight",), [0, 1, 1, 1]),
    ],
    ids=["online_dpo", "online_dpo_vllm-ray1", "online_dpo_vllm-learner-first", "online_dpo_vllm-in-flight"],
)
def test_a_killed_run_resumes_to_exactly_the_uninterrupted_result(ci_data, tmp_path, trainer, extra, staleness):
    crashed = tmp_path / "crashed"
    shutil.copytree(ci_data, crashed)
    done = run_stage(ci_data, trainer, extra=extra)
    assert done.returncode == 0, done.stderr[-3000:]
    # an engine process's semaphore left behind was reported by multiprocessing's tracker at every async run's end,
    # and vLLM warned at every sync that the rotary embedding (no checkpoint weights) "failed to load"
    printed = done.stdout + done.stderr  # vLLM logs to stdout
    assert "leaked semaphore" not in printed and "Failed to load weights" not in printed, printed[-3000:]
    logged = rows(ci_data)  # N = 1: every batch within the bound; none stale that the learner sampled itself
    assert [float(r["async/staleness"]) for r in logged] == staleness
    # the Ray engine's start (~30 s) idled the learner: the run ends naming the setting that fills such a wait (the
    # engine process's few seconds may too, on a busy machine: not checked); none for a learner that sampled itself
    hint = "train.learner_first_batches=" in done.stdout
    if "train.engine_backend=ray" in extra or not extra or "train.learner_first_batches=2" in extra:
        assert hint == ("train.engine_backend=ray" in extra), done.stdout
    if "train.learner_first_batches=2" in extra:  # the engine's first weights: version 1, what batch 2 needs
        assert [float(r["async/weight_version"]) for r in logged] == [0, 1, 1, 2]
        assert [float(r["timing/wait"]) for r in logged[:2]] == [0, 0]  # the learner sampled: no wait
        assert [float(r["timing/scoring_engine"] or 0) > 0 for r in logged] == [False, False, True, True]
    if "train.weight_updates=in_flight" in extra:  # batches 1-3 take the next version half-way: fresher tokens
        assert all(0 < float(r["async/token_staleness_mean"]) < 1 for r in logged[1:]), logged
        assert [float(r["async/token_staleness_max"]) for r in logged] == staleness
    assert not any((ci_data / "checkpoints").iterdir())  # a finished run removes its resume points

    if not extra:  # batch 1 trained, only batch 0's checkpoint saved (the async runs skip this: ~30 s a start)
        first = run_stage(crashed, trainer, crash="after_update:1", extra=extra)
        assert killed(first, 1), first.stderr[-3000:]
        [ckpt_dir] = (crashed / "checkpoints").iterdir()
        assert sorted(p.name for p in ckpt_dir.iterdir()) == ["batch-000001", "frontier"]  # + the policy after batch 0
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
    # killed writing the checkpoint after 3 batches
    second = run_stage(crashed, trainer, crash="checkpoint_write:3", extra=extra)
    assert killed(second, 1), second.stderr[-3000:]
    assert ("resumed from" in second.stdout + second.stderr) == (not extra)
    [ckpt_dir] = (crashed / "checkpoints").iterdir()
    [torn] = ckpt_dir.glob(".tmp-batch-000003-*")  # named with the pid of the run writing it
    assert torn.is_dir() and not (torn / "trainer_state.json").exists()
    if trainer == "online_dpo_vllm":  # the weights of the batch the engine was sampling ahead are kept
        assert (ckpt_dir / "batch-000002" / "engine" / "v000001" / "model.safetensors").is_file()

    if not extra:  # batch 2's weights cut short after the save: its files.json says so, and batch 1 is intact
        weights = ckpt_dir / "batch-000002" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    last = run_stage(crashed, trainer, extra=extra)
    assert last.returncode == 0, last.stderr[-3000:]
    out = last.stdout + last.stderr
    if extra:
        assert "batch-000002 (batch 2)" in out  # the torn batch-3 checkpoint was never loaded
    else:  # the damaged checkpoint is named and passed over for the newest intact one, and the result is the same
        assert f"checkpoint batch-000002 is damaged ({weights} has " in out and "passed over" in out, out[-3000:]
        assert "batch-000001 (batch 1)" in out
    assert results(crashed) == results(ci_data)


def test_two_ranks_sharing_the_async_engine_resume_exactly(ci_data, tmp_path):
    """2 training processes (ZeRO-2) with LoRA, one vLLM engine on rank 0 sampling a batch ahead from the merged
    weights, taking each next version half-way through a batch (in-flight updates): SIGKILL both ranks after an
    update, resume from the newest checkpoint (the ranks' states, the adapters only, and the in-flight weights; older
    ones pruned to train.keep_checkpoints), get the uninterrupted result. The uninterrupted run scores and computes
    the reference in the engine (the SFT model), the other in the learner (the policy with its adapters off): per
    rank, the same floats (what score_in_engine: auto relies on)."""
    crashed = tmp_path / "crashed"
    shutil.copytree(ci_data, crashed)
    lora = ("train.lora.rank=4", "train.weight_updates=in_flight")
    done = run_stage(ci_data, "online_dpo_vllm", processes=2, extra=(*lora, "train.score_in_engine=always"))
    assert done.returncode == 0, done.stderr[-3000:]
    with open(ci_data / "plots" / "train.csv") as f:
        logged = list(csv.DictReader(f))
    assert [float(r["async/staleness"]) for r in logged] == [0.0, 1.0, 1.0, 1.0]
    # each rank's tokens keep their versions: the first half of batches 1-3 one update old, the rest current
    assert all(0 < float(r["async/token_staleness_mean"]) < 1 for r in logged[1:]), logged

    in_learner = (*lora, "train.score_in_engine=never")
    first = run_stage(crashed, "online_dpo_vllm", crash="after_update:3", processes=2, extra=in_learner)  # ckpts 1-3
    assert killed(first, 2), first.stderr[-3000:]
    [ckpt_dir] = (crashed / "checkpoints").iterdir()
    # keep: 2; engine/: the weights of batches in flight, which the checkpoints hold as hard links
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["batch-000002", "batch-000003", "engine", "frontier"]
    kept = sorted(p.name for p in (ckpt_dir / "frontier").iterdir())  # after batches 1-3: 16 episodes a batch
    assert kept == ["episode-0000016", "episode-0000032", "episode-0000048"]
    latest = ckpt_dir / "batch-000003"
    assert {"rank_state_0.json", "rank_state_1.json", "trainer_state.json"} <= {p.name for p in latest.iterdir()}
    assert (latest / "engine" / "v000002" / "model.safetensors").is_file()  # batch 3 is sampled with version 2
    names = saved_weight_names(latest)
    adapters = {n for n in names if ".lora_A." in n or ".lora_B." in n}
    # DeepSpeed leaves frozen weights out by parameter name, and a tied output head is the embedding's second name
    assert adapters and names - adapters == {"base_model.model.lm_head.weight"}, sorted(names - adapters)

    last = run_stage(crashed, "online_dpo_vllm", processes=2, extra=in_learner)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "resumed from" in last.stdout + last.stderr
    assert results(crashed) == results(ci_data)


def saved_weight_names(checkpoint) -> set[str]:
    """The model weights a checkpoint holds: accelerate's safetensors file, or DeepSpeed's module state."""
    if (checkpoint / "model.safetensors").is_file():
        with safe_open(checkpoint / "model.safetensors", "pt") as f:
            return set(f.keys())
    [states] = checkpoint.glob("pytorch_model/mp_rank_00_model_states.pt")
    return set(torch.load(states, map_location="cpu", weights_only=False)["module"])


def test_a_lora_run_keeps_only_adapters_in_checkpoints_and_resumes_exactly(ci_data, tmp_path):
    """train.lora without DeepSpeed (HF engine; 2 ranks under ZeRO-2 with the async engine: the test above).
    Checkpoints hold the adapters only; the resumed run matches the uninterrupted one."""
    lora = ("train.lora.rank=4",)
    crashed = tmp_path / "crashed"
    shutil.copytree(ci_data, crashed)
    done = run_stage(ci_data, "online_dpo", extra=lora)
    assert done.returncode == 0, done.stderr[-3000:]

    first = run_stage(crashed, "online_dpo", crash="after_update:2", extra=lora)
    assert killed(first, 1), first.stderr[-3000:]
    [ckpt_dir] = (crashed / "checkpoints").iterdir()
    names = saved_weight_names(ckpt_dir / "batch-000002")
    adapters = {n for n in names if ".lora_A." in n or ".lora_B." in n}
    assert adapters and names == adapters, sorted(names - adapters)
    last = run_stage(crashed, "online_dpo", extra=lora)
    assert last.returncode == 0, last.stderr[-3000:]
    assert "resumed from" in last.stdout + last.stderr
    assert results(crashed) == results(ci_data)
