"""The fresh-process tier: runs a user makes, each process a fresh interpreter, as `make run` and `accelerate launch`
start them, not forked from the suite's warm server (tests/warm/). What only a fresh process shows: every rank and
engine process gets its own hash seed (Python's default: PYTHONHASHSEED unset), so a set iterated in a different
order per rank would hang a collective; imports no other stage preloaded; exit-time crashes the warm exit path skips.
The last test holds the warm harness itself to the same results as fresh interpreters."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import warm
from conftest import COMMAND_TIMEOUT, PARAMS, ROOT, accelerate_launch, folder_digest
from test_resume import results

pytestmark = pytest.mark.slow
COMMON = ["--profile", "ci"]


def fresh_env(tmp_path) -> dict:
    """The suite's environment without what would make the processes share a hash seed or start warm."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHASHSEED", "RLHF_WARM_PYTHON")}
    return {**env, "RLHF_STAGE_STATS": str(tmp_path / "stages.jsonl")}


def rlhf(*args, launcher=(), python=sys.executable, env=None, timeout=COMMAND_TIMEOUT):
    """`rlhf ARGS` with `python` (a fresh interpreter unless told otherwise), under `launcher` if given."""
    cmd = [python, "-m", "rlhf.runtime", *launcher, *(["-m"] if launcher else [python, "-m"]), "rlhf.cli"]
    cmd += ["--params", str(PARAMS), *COMMON, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_fresh_tier_runs_fresh_interpreters_with_their_own_hash_seeds(tmp_path):
    """The premise of this file: two fresh processes started as its tests start them hash strings differently."""
    code = "print(hash('rank'))"
    env = fresh_env(tmp_path)
    seeds = {subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout for _ in "ab"}
    assert len(seeds) == 2 and sys.executable != os.environ.get("RLHF_WARM_PYTHON")


def test_two_zero2_ranks_and_the_async_engine_in_fresh_processes(ci_data, tmp_path):
    settings = ["train", "--trainer", "online_dpo_vllm", f"data_dir={ci_data}", "tracking.wandb_mode=disabled"]
    out = rlhf(*settings, "train.total_episodes=32", launcher=accelerate_launch("zero2"), env=fresh_env(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    staleness = [json.loads(x) for x in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in staleness] == ["train", "train"]  # both ranks ran the stage to its end
    metrics, rows, _ = results(ci_data)
    assert metrics["optimizer_steps"] > 0 and max(float(r["async/staleness"]) for r in rows) == 1.0


def test_a_colocated_engine_and_evaluate_on_two_vllm_processes_in_fresh_interpreters(ci_data, tmp_path):
    env = fresh_env(tmp_path)
    common = [f"data_dir={ci_data}", "tracking.wandb_mode=disabled", "train.trainer=online_dpo_single_vllm"]
    common += ["train.total_episodes=16"]  # the later stages check that train/ was built with these settings
    out = rlhf("train", *common, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    for stage in ("generate", "evaluate"):
        out = rlhf(stage, *common, "eval.engine=vllm", "eval.processes=2", env=env)
        assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((ci_data / "metrics" / "eval.json").read_text())
    assert 0 <= metrics["gold/win_rate_vs_sft"] <= 1 and metrics["n_prompts"] > 0


def test_an_async_run_is_the_same_in_two_fresh_processes(ci_data, tmp_path):
    """Determinism across processes, not within one: each run its own interpreter, its own hash seed."""
    other = tmp_path / "other"
    shutil.copytree(ci_data, other)
    env = fresh_env(tmp_path)
    for data in (ci_data, other):
        out = rlhf("train", "--trainer", "online_dpo_vllm", f"data_dir={data}", "tracking.wandb_mode=disabled",
                   "train.total_episodes=24", env=env)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
    assert results(ci_data) == results(other)


@pytest.mark.parametrize(
    "args, crash",
    [
        (
            ["prepare", "data.n_sft=16", "data.n_reward_prompts=8", "data.n_rl_prompts=8", "data.n_eval_prompts=8"],
            False,
        ),
        (["train", "train.k=two"], False),  # a bad setting
        (["evaluate"], False),  # a missing input: nothing trained yet
        (["train", "--trainer", "online_dpo", "train.total_episodes=16"], True),  # SIGKILL after the first update
    ],
    ids=["a stage that runs", "a bad setting", "a missing input", "a SIGKILL mid-run"],
)
@pytest.mark.skipif(not warm.ON, reason="RLHF_WARM=0: no warm server to compare with")
def test_the_warm_harness_gives_what_a_fresh_interpreter_gives(ci_stages, tmp_path, args, crash):
    """The same command warm (forked from the server of tests/warm/) and fresh: the same exit code or signal, the same
    last line of stderr, the same files, and the same bytes in what the stage wrote."""
    outcomes = []
    for python in (str(warm.start()), sys.executable):
        data = tmp_path / ("fresh" if python == sys.executable else "warm") / "data"
        shutil.copytree(ci_stages, data)
        env = fresh_env(data.parent)
        if crash:
            env["RLHF_CRASH_AT"] = "after_update:0"
        out = rlhf(*args, f"data_dir={data}", "tracking.wandb_mode=disabled", python=python, env=env)
        last = (out.stderr.strip().splitlines() or [""])[-1].replace(str(data), "<data>")
        files = sorted(str(f.relative_to(data)) for f in data.rglob("*") if f.is_file())
        outcomes.append((out.returncode, last, files, folder_digest(data / "prepared")))
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0][0] == (-9 if crash else 0 if args[0] == "prepare" else 1)
