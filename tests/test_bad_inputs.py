"""Bad inputs, and what the user sees for each: a message naming the cause, a non-zero exit, no half-written
output that looks valid, nothing saved before lost. Plus the security defaults.

docs/reliability.md lists every bad input tried with its test (these and older ones elsewhere in tests/);
the last test here checks that table against the tests, one to one. Everything is real (models, DVC, a
Prefect server, W&B offline) except a full disk, which is simulated and named so where it is.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
import wandb
from accelerate import Accelerator
from conftest import (
    COMMAND_TIMEOUT,
    PARAMS,
    ROOT,
    ci_config,
    folder_digest,
    free_port,
    isolated_env,
    make_dvc_repo,
    rlhf_command,
    run_cli,
    run_ok,
)

from rlhf.cli import lock_file
from rlhf.config import Config, TrackingConfig
from rlhf.models import loading
from rlhf.tracking import STEP, Tracker, wandb_mode
from rlhf.trainers.loop import train

DOC = ROOT / "docs" / "reliability.md"


def _child(proc: subprocess.Popen, matches, timeout: float) -> psutil.Process:
    """The first descendant of `proc` whose command line satisfies `matches` (waits for it to appear)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before the awaited child started"
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                if matches(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    pytest.fail(f"no matching child process within {timeout} s")


# --- the command line -----------------------------------------------------------------------------------


def test_malformed_params_yaml_fails_the_cli_naming_the_file(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("profile: ci\nprofiles: {ci: {train: [1, 2}\n")
    proc = run_cli("config", params=bad)
    assert proc.returncode == 1
    assert f"rlhf config: error: {bad}: malformed YAML" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_non_utf8_reviews_csv_fails_prepare_naming_the_file(tmp_path):
    latin = tmp_path / "reviews.csv"
    latin.write_bytes(
        b"text,label,source\n" + ("un film tr\xe8s r\xe9ussi et " * 8 + ",1,imdb\n").encode("latin-1") * 40
    )
    data = tmp_path / "data"
    proc = run_cli("--profile", "ci", "prepare", f"data_dir={data}", f"data.reviews_csv={latin}")
    assert proc.returncode == 1
    assert re.search(rf"{re.escape(str(latin))}: not UTF-8 text \(invalid continuation byte at byte \d+\)", proc.stderr)
    assert not data.exists()  # no prepared folder, no metrics file


def test_sigterm_stops_a_stage_like_ctrl_c(ci_data):
    settings = ["tracking.wandb_mode=disabled", "train.total_episodes=800", "train.save_every=1"]
    cmd = rlhf_command("--profile", "ci", "train", f"data_dir={ci_data}", *settings)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + COMMAND_TIMEOUT
    while not (ci_data / "checkpoints").exists() and time.time() < deadline:  # training is under way
        assert proc.poll() is None
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=COMMAND_TIMEOUT)
    assert proc.returncode == 130 and "interrupted" in err
    assert not (ci_data / "train" / "policy").exists() and not (ci_data / "metrics" / "train.json").exists()


# --- the training loop ----------------------------------------------------------------------------------


def test_prompts_longer_than_the_context_are_dropped_and_none_fitting_stops_the_run(ci_data):
    from rlhf.data.splits import load_split
    from rlhf.trainers.setup import load_rl_prompts

    cfg = ci_config(ci_data)
    tokenizer = loading.load_tokenizer(ci_data / "sft")
    lengths = sorted(
        len(ids) for ids in tokenizer(list(load_split(cfg.path("prepared"), "rl_prompts")["prompt"]))["input_ids"]
    )
    assert lengths[0] < lengths[-1]  # 8-word openings tokenise to different lengths
    context, room = cfg.model.max_position_embeddings, lengths[len(lengths) // 2]
    kept = load_rl_prompts(ci_config(ci_data, f"train.response_length={context - room}"), tokenizer)
    assert max(map(len, kept)) <= room
    assert len(kept) == sum(n <= room for n in lengths) < len(lengths)
    # no prompt leaves room for a response: the run stops before training anything
    too_long = ci_config(ci_data, f"train.response_length={context - lengths[0] + 1}")
    with pytest.raises(
        ValueError,
        match=rf"rl_prompts: no prompt fits the context \({lengths[0] - 1} tokens left after train.response_length\)",
    ):
        train(too_long)
    assert not (ci_data / "train").exists() and not (ci_data / "checkpoints").exists()


# A PPO run of 3 generated batches that checkpoints after every batch; the `stopped_run` copy of it was killed
# after training batch 1, so checkpoint batch-000001 is the last good state a resumed run starts from.
STOPPED = ("train.trainer=ppo", "train.save_every=1", "train.total_episodes=24")


@pytest.fixture(scope="module")
def stopped_run(ci_stages, tmp_path_factory):
    data = tmp_path_factory.mktemp("stopped") / "data"
    shutil.copytree(ci_stages, data)
    env = {**os.environ, "RLHF_CRASH_AT": "after_update:1"}  # SIGKILL, as an OOM kill would (rlhf.runtime)
    proc = run_cli("--profile", "ci", "train", f"data_dir={data}", "tracking.wandb_mode=disabled", *STOPPED, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    [ckpt_dir] = (data / "checkpoints").iterdir()
    # batch 0's checkpoint, and its policy kept for the frontier (train.eval_checkpoints: batches 1 and 2 of 3)
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["batch-000001", "frontier"]
    return data


@pytest.fixture
def stopped(stopped_run, tmp_path):
    """(data dir, its checkpoint batch-000001, that checkpoint's digest): a private copy per test."""
    data = tmp_path / "data"
    shutil.copytree(stopped_run, data)
    [ckpt] = (data / "checkpoints").glob("*/batch-000001")
    return data, ckpt, folder_digest(ckpt)


def _fill_nan(folder, load) -> None:
    """Rewrite the model in `folder` with every weight NaN (a real, loadable, broken model)."""
    model = load(folder)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    loading.save_pretrained(model, loading.load_tokenizer(folder), folder)


def _assert_only_the_good_checkpoint(data, ckpt, digest) -> None:
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["batch-000001", "frontier"]  # nothing partial beside
    assert folder_digest(ckpt) == digest
    assert not (data / "train" / "policy").exists() and not (data / "metrics" / "train.json").exists()


@pytest.mark.slow
def test_reward_returning_nan_stops_training_and_keeps_the_last_checkpoint(stopped):
    data, ckpt, digest = stopped
    _fill_nan(data / "reward" / "model", loading.load_reward_model)
    with pytest.raises(
        RuntimeError,
        match=rf"the reward \(proxy\) returned NaN/inf for \d+ of 16 samples at batch 1 \(trainer ppo\); the last "
        rf"good checkpoint, {re.escape(str(ckpt))}, is intact: fix the cause and run the stage again",
    ):
        train(ci_config(data, *STOPPED))
    _assert_only_the_good_checkpoint(data, ckpt, digest)


@pytest.mark.slow
def test_a_nan_gradient_stops_training_at_its_batch_before_anything_is_saved(ci_data, monkeypatch):
    """Fault injection: a hook turns the embeddings' gradient into NaN while the loss stays finite."""
    from rlhf.trainers import setup

    load_models = setup._setup_models

    def with_nan_gradient(*args):
        policy, ref, value = load_models(*args)
        policy.get_input_embeddings().weight.register_hook(lambda grad: grad * float("nan"))
        return policy, ref, value

    monkeypatch.setattr(setup, "_setup_models", with_nan_gradient)
    message = r"the gradient norm became nan at batch 0 \(trainer online_dpo\); no checkpoint was saved yet \(train"
    with pytest.raises(RuntimeError, match=message):
        train(ci_config(ci_data, "train.total_episodes=16"))
    assert not (ci_data / "train" / "policy").exists() and not (ci_data / "metrics" / "train.json").exists()


def test_a_mistyped_command_after_the_runtime_wrapper_is_one_line_as_a_shell_says_it():
    """`python -m rlhf.runtime CMD` (the Makefile's and the docs' wrapper) with a CMD that does not exist or is not
    runnable: one line and a shell's exit code, not an execvp traceback."""
    for cmd, rc, why in [("pyhton", 127, "command not found"), ("./README.md", 126, "Permission denied")]:
        proc = subprocess.run(
            [sys.executable, "-m", "rlhf.runtime", cmd, "x"], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == rc and proc.stderr.splitlines() == [f"rlhf.runtime: {cmd}: {why}"], proc.stderr


def test_a_malformed_environment_variable_is_one_line_naming_it(tmp_path):
    env = {**os.environ, "RLHF_TORCH_THREADS": "two"}
    proc = run_cli("--profile", "ci", "prepare", f"data_dir={tmp_path}", env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "rlhf prepare: error: environment variable RLHF_TORCH_THREADS='two': expected an integer >= 1"
    ]
    with pytest.raises(ValueError, match="environment variable WANDB_MODE='offlne': expected one of online, offline"):
        wandb_mode("offline", {"WANDB_MODE": "offlne"})
    for variable, value, message in [
        ("PREFECT_PORT", "42OO", "environment variable PREFECT_PORT='42OO': expected an integer 1-65535"),
        ("PREFECT_PORT", "99999", "environment variable PREFECT_PORT='99999': expected an integer 1-65535"),
        (
            "RLHF_SERVER_START_TIMEOUT",
            "0",
            "environment variable RLHF_SERVER_START_TIMEOUT='0': expected an integer >= 1",
        ),
        ("PREFECT_LOGGING_LEVEL", "LOUD", "Prefect setting PREFECT_LOGGING_LEVEL='LOUD': Input should be 'DEBUG', "),
        ("PREFECT_SERVER_API_PORT", "x", "Prefect setting PREFECT_SERVER_API_PORT='x': Input should be a valid int"),
    ]:
        serve = subprocess.run(
            [sys.executable, "-m", "flows.deployments"],
            cwd=ROOT,
            env={**os.environ, "PREFECT_UNRELATED": value, variable: value},  # the variable, not its value, is named
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
        )
        assert serve.returncode == 2, serve.stderr[-2000:]
        assert serve.stderr.strip().splitlines()[-1].startswith(f"python -m flows.deployments: error: {message}")
        assert "Traceback" not in serve.stderr and "validation error" not in serve.stderr
    for args, message in [
        (["--port", "70000"], "argument --port: expected an integer 1-65535, got '70000'"),  # was a traceback
        (["--limit", "0"], "argument --limit: expected an integer >= 1, got '0'"),
    ]:
        serve = subprocess.run(
            [sys.executable, "-m", "flows.deployments", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert serve.returncode == 2 and "Traceback" not in serve.stderr, serve.stderr[-2000:]
        assert serve.stderr.strip().splitlines()[-1] == f"python -m flows.deployments: error: {message}"


@pytest.mark.slow
def test_a_ray_address_nothing_answers_is_one_line_naming_it(ci_data):
    """RAY_ADDRESS names a cluster to join; where none answers the run stops in seconds (ray.init retries for
    minutes), before training writes anything."""
    port = free_port()  # nothing listens there
    proc = run_cli(
        "--profile", "ci", "train", f"data_dir={ci_data}", "train.trainer=online_dpo_vllm",
        "train.engine_backend=ray", env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.strip().splitlines() if x.startswith("rlhf train: error:")]
    assert f"RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster answers there" in line
    assert "Traceback" not in proc.stderr and not (ci_data / "train" / "policy").exists()


def test_wandb_online_without_a_key_is_one_line(ci_data, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), WANDB_DIR=str(tmp_path / "wandb"), WANDB_CONFIG_DIR=str(tmp_path / "config"))
    proc = run_cli("--profile", "ci", "train", f"data_dir={ci_data}", "tracking.wandb_mode=online", env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.strip().splitlines() if x.startswith("rlhf train: error:")]
    assert "tracking.wandb_mode=online: W&B refused to start" in line and "set WANDB_API_KEY" in line
    assert "Traceback" not in proc.stderr and not (ci_data / "train" / "policy").exists()


def test_a_damaged_json_file_of_our_own_is_named_with_the_fix(ci_data, tmp_path):
    """Metrics, checkpoint state and records are read back through one reader (rlhf.io.read_json), the plots tables
    through another (read_csv): a truncated or hand-edited one is one line naming the file, not the parser's bare
    'Expecting value', nor a cut-off row read as missing values."""
    from rlhf.io import read_csv, read_json

    damaged = ci_data / "metrics" / "reward.json"
    damaged.write_text('{"agreement_heldout": 0.7,\n')  # cut off mid-write
    proc = run_cli("--profile", "ci", "report", f"data_dir={ci_data}")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    [line] = [x for x in proc.stderr.strip().splitlines() if x.startswith("rlhf report: error:")]
    assert f"{damaged}: damaged JSON" in line and "re-run the step that wrote it" in line
    with pytest.raises(ValueError, match="trainer_state.json: damaged JSON"):
        (ci_data / "trainer_state.json").write_bytes(b"\xff\xfe{")  # not even UTF-8
        read_json(ci_data / "trainer_state.json")
    table = ci_data / "train.csv"  # the plots tables, read back by the report, the same way
    table.write_text("train/episode,objective/kl\n16,0.5\n32,0.")  # cut short mid-row
    with pytest.raises(ValueError, match=rf"{re.escape(str(table))}: damaged CSV \(cut short: no newline at its end\)"):
        read_csv(table)
    table.write_text("a,b\n1,2\n3,4,5,6\n")  # a row of more fields than the header
    with pytest.raises(ValueError, match=r"train.csv: damaged CSV \(Error tokenizing data"):
        read_csv(table)


def test_a_stage_over_inputs_built_with_other_settings_names_the_stage_to_re_run(tmp_path):
    data = tmp_path / "data"
    built = run_cli("--profile", "ci", "prepare", f"data_dir={data}")
    assert built.returncode == 0, built.stderr[-2000:]
    assert json.loads((data / "prepared" / "built_with.json").read_text())["settings"]["data.n_sft"] == 400
    proc = run_cli("--profile", "ci", "gold", f"data_dir={data}", "data.n_sft=300")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [  # only what differs: the profile is the same
        f"rlhf gold: error: {data / 'prepared'} was built with other settings (data.n_sft: 400 then, 300 now): "
        "re-run `rlhf prepare` and the stages after it, or `dvc repro`"
    ]
    assert not (data / "gold").exists()
    other_profile = run_cli("--profile", "tiny", "gold", f"data_dir={data}")  # the case: ci data, tiny run
    assert other_profile.returncode == 1 and "profile ci then, tiny now" in other_profile.stderr


@pytest.mark.parametrize("stage, in_the_way", [("train", "train"), ("gold", "metrics"), ("evaluate", "plots")])
def test_an_output_folder_that_cannot_be_written_stops_the_stage_before_it_starts(tmp_path, stage, in_the_way):
    data = tmp_path / "data"
    data.mkdir()
    (data / in_the_way).write_text("not a folder")
    proc = run_cli("--profile", "ci", stage, f"data_dir={data}")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"rlhf {stage}: error: {data / in_the_way}: a file is in the way of this output folder; move it away"
    ]
    assert sorted(p.name for p in data.iterdir()) == [in_the_way]  # nothing was started, nothing written


@pytest.mark.parametrize("stage, change", [("prepare", "data.n_sft=300"), ("gold", "gold.c=1.0")])
def test_a_stage_failing_at_its_last_write_keeps_its_previous_outputs_whole(tmp_path, stage, change):
    data = tmp_path / "data"
    for built in ("prepare", "gold")[: 1 + (stage == "gold")]:
        assert run_cli("--profile", "ci", built, f"data_dir={data}").returncode == 0
    output = data / ("prepared" if stage == "prepare" else "gold")
    before = folder_digest(output)
    metrics = data / "metrics" / f"{stage}.json"
    metrics.unlink()
    metrics.mkdir()  # the stage's very last write fails, after all its work (no root-proof way to deny a write)
    proc = run_cli("--profile", "ci", stage, f"data_dir={data}", change)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"rlhf {stage}: error: {metrics}: a folder is in the way of this file: move it away and re-run"
    ]
    assert folder_digest(output) == before  # the previous outputs, whole: the new ones never moved in
    assert sorted(p.name for p in data.iterdir()) == sorted(["metrics", "prepared", "gold"][: 2 + (stage == "gold")])


@pytest.mark.slow
def test_a_train_run_failing_at_its_last_write_shows_nothing_of_itself_and_loses_nothing(ci_data):
    """Side outputs join the all-or-nothing rule: a new run (another learning rate) whose metrics file cannot be
    written leaves the previous run's policy, config.yaml, kept frontier policies, record and train.csv as they
    were, no temporary file, and its own checkpoints, from which the same command finishes once the way is clear."""
    train = ("--profile", "ci", "train", f"data_dir={ci_data}", "tracking.wandb_mode=disabled")
    first = run_cli(*train)
    assert first.returncode == 0, first.stderr[-2000:]
    assert any((ci_data / "train" / "frontier").iterdir())  # the ci profile keeps policies for the frontier
    before = {name: folder_digest(ci_data / name) for name in ("train", "plots")}
    metrics = ci_data / "metrics" / "train.json"
    metrics.unlink()
    metrics.mkdir()  # the run's last write fails, after all its work (no root-proof way to deny a write)
    second = run_cli(*train, "train.learning_rate=1e-2", "train.save_every=1")
    assert second.returncode == 1
    [line] = [x for x in second.stderr.splitlines() if x.startswith("rlhf train: error:")]
    assert line == f"rlhf train: error: {metrics}: a folder is in the way of this file: move it away and re-run"
    assert {name: folder_digest(ci_data / name) for name in before} == before
    assert not [p for p in ci_data.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    assert list((ci_data / "checkpoints").glob("*/batch-*"))  # the failed run's work: kept until its outputs land
    metrics.rmdir()
    third = run_cli(*train, "train.learning_rate=1e-2", "train.save_every=1")
    assert third.returncode == 0 and "resumed from" in third.stdout + third.stderr, third.stderr[-2000:]
    assert "learning_rate: 0.01" in (ci_data / "train" / "config.yaml").read_text()
    assert not any((ci_data / "checkpoints").iterdir())  # removed once the outputs were in place


@pytest.mark.slow
def test_a_second_run_of_a_stage_in_the_same_folder_is_refused_while_the_first_runs(ci_data):
    settings = [f"data_dir={ci_data}", "tracking.wandb_mode=disabled"]
    cmd = rlhf_command("--profile", "ci", "train", *settings, "train.total_episodes=8000")
    first = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        lock = lock_file(str(ci_data), "train")
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not (lock.exists() and lock.read_text() == str(first.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        second = run_cli("--profile", "ci", "train", *settings)
        assert second.returncode == 1
        assert second.stderr.strip().splitlines() == [
            f"rlhf train: error: another `rlhf train` (pid {first.pid}) is writing the outputs in {ci_data}: wait for "
            "it to finish or stop it; two runs would overwrite each other's results"
        ]
    finally:
        first.kill()
        first.wait()
    # the killed run's lock is stale (the kernel released it): the next run takes it over
    third = run_cli("--profile", "ci", "train", *settings, "train.total_episodes=8")
    assert third.returncode == 0, third.stderr[-2000:]


@pytest.mark.slow
def test_loss_going_nan_stops_training_and_keeps_the_last_checkpoint(stopped):
    data, ckpt, digest = stopped
    # The resumed policy comes from the checkpoint (finite); the KL reference from data/sft, now NaN: every
    # PPO quantity built on the KL, and so the loss, is NaN, while generation and the reward stay finite.
    _fill_nan(data / "sft", loading.load_causal_lm)
    with pytest.raises(
        RuntimeError,
        match=rf"loss became nan at batch 1 \(trainer ppo\); the last good checkpoint, "
        rf"{re.escape(str(ckpt))}, is intact",
    ):
        train(ci_config(data, *STOPPED))
    _assert_only_the_good_checkpoint(data, ckpt, digest)


@pytest.mark.slow
def test_disk_full_while_checkpointing_removes_the_partial_checkpoint(stopped, monkeypatch, capsys):
    data, ckpt, digest = stopped
    real_save_state = Accelerator.save_state

    def save_state_then_disk_full(self, output_dir=None, **kwargs):
        # SIMULATED full disk (no real one to fill here): the checkpoint files land, then the write fails.
        real_save_state(self, output_dir, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), output_dir)

    monkeypatch.setattr(Accelerator, "save_state", save_state_then_disk_full)
    with pytest.raises(
        OSError,
        match=r"checkpoint \S+/batch-000002 not written \(disk full\); its partial folder was removed, the "
        r"checkpoints already in \S+ are intact",
    ) as err:
        train(ci_config(data, *STOPPED))
    assert err.value.errno == errno.ENOSPC
    _assert_only_the_good_checkpoint(data, ckpt, digest)  # no .tmp-batch-000002 left filling the disk
    # space freed: the same command resumes from the intact checkpoint and finishes the run
    monkeypatch.undo()
    final = train(ci_config(data, *STOPPED))
    assert f"resumed from {ckpt} (batch 1)" in capsys.readouterr().out
    assert (final["episodes"], final["optimizer_steps"]) == (24, 6)
    assert loading.load_causal_lm(data / "train" / "policy").config.model_type == "llama"


def test_a_damaged_checkpoint_is_passed_over_for_the_newest_intact_one(tmp_path):
    """What the save recorded (files.json) decides: a file cut short or gone, or a JSON file edited into nonsense,
    makes a checkpoint pass over to the next older one; none intact is None with a line per checkpoint; a file that
    keeps its size but does not load is one error naming the checkpoint and the way out."""
    from rlhf.trainers import checkpoint

    acc = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    for batch in (1, 2, 3):
        checkpoint.save(acc, tmp_path, checkpoint.LoopState(batch=batch), {"shuffle_rng": []}, keep=3)
    one, two, three = (tmp_path / f"batch-00000{b}" for b in (1, 2, 3))
    assert checkpoint.latest(tmp_path) == (three, [])

    weights = three / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    (two / "metric_rows.json").write_text("[{")  # not written by this save: still checked as JSON
    (two / "rank_state_0.json").write_text('{"shuffle_rng": [')
    last, passed_over = checkpoint.latest(tmp_path)
    assert last == one
    size = weights.stat().st_size
    assert (
        passed_over[0]
        == f"checkpoint batch-000003 is damaged ({weights} has {size} bytes, its save wrote {size + 8}): passed over"
    )
    assert passed_over[1].startswith(f"checkpoint batch-000002 is damaged ({two / 'metric_rows.json'}: damaged JSON (")
    assert len(passed_over) == 2
    (one / "optimizer.bin").unlink()
    assert checkpoint.latest(tmp_path)[0] is None
    assert f"({one / 'optimizer.bin'} is missing)" in checkpoint.latest(tmp_path)[1][2]

    checkpoint.save(acc, tmp_path, checkpoint.LoopState(batch=4), {"shuffle_rng": []}, keep=3)
    optimizer_file = tmp_path / "batch-000004" / "optimizer.bin"
    optimizer_file.write_bytes(bytes(optimizer_file.stat().st_size))  # the same size, not a pickle any more
    assert checkpoint.latest(tmp_path) == (tmp_path / "batch-000004", [])
    with pytest.raises(
        RuntimeError,
        match=r"checkpoint \S+/batch-000004 could not be loaded \(\w+: .*\); move it "
        r"out of \S+ to resume from an older one, or delete \S+ to start over",
    ):
        checkpoint.load(acc, tmp_path / "batch-000004")


# --- the pipeline and the orchestrator ------------------------------------------------------------------


@pytest.mark.slow
def test_interrupted_dvc_repro_records_nothing_and_loses_nothing(tmp_path):
    """Ctrl-C during `dvc repro` of the sft stage (seconds of work past its start-up on any box; prepare and gold,
    which import no torch, finish in about as long as their start-up takes)."""
    repo = make_dvc_repo(tmp_path / "project")
    # DVC runs stages with $SHELL; unset (cron, CI), that is /bin/sh, which on Debian is dash: it forks rather
    # than exec the command and dies on SIGINT at once. dvc.yaml's `exec` makes the stage what DVC waits on.
    env = {**isolated_env(tmp_path), "SHELL": "/bin/sh"}
    params = repo / "params.yaml"
    params.write_text(re.sub(r"^profile: \S+", "profile: ci", params.read_text(), count=1, flags=re.M))
    for stage in ("prepare", "sft"):
        run_ok(["dvc", "repro", "--single-item", stage], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "prepare, sft"], repo, env)  # dvc.lock and the metrics files live in git
    lock, before = (repo / "dvc.lock").read_bytes(), folder_digest(repo / "data" / "sft")

    params.write_text(params.read_text().replace("\nsft: {}", "\nsft: {learning_rate: 0.002}", 1))  # to run again
    proc = subprocess.Popen(
        ["dvc", "repro", "--single-item", "sft"],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    stage = _child(proc, lambda cmd: cmd[-3:] == ["-m", "rlhf.cli", "sft"], COMMAND_TIMEOUT)
    # taken by `rlhf sft` once its interrupt handling is on; the stage runs the copy's code, with the copy's cache
    taken = repo / ".cache" / "locks" / lock_file(str(repo / "data"), "sft").name
    with contextlib.suppress(psutil.NoSuchProcess):  # mid-stage: past its start-up on a box of any speed
        while not (taken.exists() and taken.read_text() == str(stage.pid)) or sum(stage.cpu_times()[:2]) < 2.0:
            time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals DVC and the stage's process together
    out, _ = proc.communicate(timeout=COMMAND_TIMEOUT)
    assert proc.returncode == 255, out
    assert (
        "interrupted\nERROR: failed to reproduce 'sft': failed to run: exec python -m rlhf.cli sft, exited with 130"
        in out
    )
    assert (repo / "dvc.lock").read_bytes() == lock  # the interrupted run is not recorded as done
    assert not list((repo / "data").glob(".sft.*"))  # no half-written folder
    assert "sft" in json.loads(run_ok(["dvc", "status", "--json", "sft"], repo, env))
    # the outputs are `persist: true`: DVC leaves them to the stage, which had not replaced them yet
    assert folder_digest(repo / "data" / "sft") == before
    assert not run_ok(["git", "status", "--porcelain", "data/metrics"], repo, env)  # the metrics files as committed
    assert "Running stage 'sft'" in run_ok(["dvc", "repro", "--single-item", "sft"], repo, env)
    assert json.loads(run_ok(["dvc", "status", "--json", "sft"], repo, env)) == {}

    # a bad setting given through DVC fails at the stage's config load, and DVC has removed nothing
    run_ok(["git", "commit", "-qam", "sft.learning_rate"], repo, env)
    before, lock = folder_digest(repo / "data"), (repo / "dvc.lock").read_bytes()
    bad = subprocess.run(
        ["dvc", "exp", "run", "-S", "++data.n_sft=-5", "prepare"], cwd=repo, env=env, capture_output=True, text=True
    )
    assert bad.returncode != 0
    said = bad.stderr + bad.stdout
    assert (
        "rlhf prepare: error: invalid configuration:\n  data.n_sft: Input should be greater than 0 (got -5); " in said
    )
    assert "params.yaml still holds the value `dvc exp run -S` set: fix it, or `git checkout params.yaml`" in said
    assert folder_digest(repo / "data") == before and (repo / "dvc.lock").read_bytes() == lock
    assert "n_sft: -5" in params.read_text()  # what the hint is about: DVC left its -S value there


@pytest.fixture
def prefect_server(tmp_path_factory):
    """A throwaway server started by what `make serve` runs (flows.deployments.start_server), own database."""
    from flows.deployments import start_server, stop_server, wait_healthy

    home = tmp_path_factory.mktemp("prefect")
    port = free_port()
    env = {**isolated_env(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    with pytest.MonkeyPatch.context() as mp:  # the server inherits this process's environment
        mp.setenv("PREFECT_HOME", env["PREFECT_HOME"])
        server = start_server(port, home / "server.log")
    try:
        try:
            wait_healthy(env["PREFECT_API_URL"], server, COMMAND_TIMEOUT)
        except SystemExit as e:
            pytest.fail(f"{e}\n{(home / 'server.log').read_text()[-3000:]}")
        yield {"server": server, "port": port, "env": env}
    finally:
        stop_server(server)


@pytest.mark.slow
def test_a_prefect_server_that_does_not_answer_in_time_names_the_limit_and_is_stopped(tmp_path):
    from flows.deployments import _port_in_use

    port = free_port()
    env = {**isolated_env(tmp_path), "RLHF_SERVER_START_TIMEOUT": "1", "PREFECT_PORT": str(port)}
    serve = subprocess.run(
        [sys.executable, "-m", "flows.deployments"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    assert serve.returncode == 1, serve.stderr[-2000:]
    assert serve.stderr.strip().splitlines()[-1] == (
        f"prefect server did not answer http://127.0.0.1:{port}/api/health within 1 s (on a slow machine, set "
        "RLHF_SERVER_START_TIMEOUT to more seconds)"
    )
    assert "stopping the prefect server..." in serve.stdout
    assert not _port_in_use(port)  # nothing is left listening


@pytest.mark.slow
def test_prefect_server_gone_mid_run_fails_the_run_and_touches_nothing(prefect_server, tmp_path):
    repo = make_dvc_repo(tmp_path / "project", prepare_only=True)
    workspaces = tmp_path / "workspaces"
    # One client retry instead of Prefect's default 5 (which back off 2+4+8+16+32 s per call) keeps this short.
    env = {
        **prefect_server["env"],
        "RLHF_PROJECT_DIR": str(repo),
        "RLHF_WORKSPACES": str(workspaces),
        "PREFECT_CLIENT_MAX_RETRIES": "1",
    }
    # Prefect's event client retries each event queued after the server died 10 times over ~7 s (not a setting): ~1
    # min of this test for a `prepare`-only run (docs/reliability.md's row). Two attempts here: the same failure
    # and messages, without the minute.
    fewer_event_retries = (
        "from prefect.events.clients import PrefectEventsClient; from prefect.events.worker import EventsWorker; "
        "EventsWorker.set_client_override(PrefectEventsClient, reconnection_attempts=2); "
    )
    flow = subprocess.Popen(
        [
            sys.executable,
            "-c",
            fewer_event_retries + "from flows.rlhf_flow import rlhf; rlhf(trainer='ppo', profile='ci')",
        ],
        cwd=repo,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        _child(flow, lambda cmd: "repro" in cmd, COMMAND_TIMEOUT)  # the `prepare` task is running
        os.killpg(prefect_server["server"].pid, signal.SIGKILL)  # the server dies (crash, OOM kill, reboot)
        out, _ = flow.communicate(timeout=COMMAND_TIMEOUT)
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
    assert flow.returncode == 1, out[-3000:]
    assert "httpx.ConnectError: [Errno 111] Connection refused" in out  # the flow's final state could not be set
    assert f"Unable to connect to 'ws://127.0.0.1:{prefect_server['port']}/api/events/in'" in out  # names the server
    assert run_ok(["git", "status", "--porcelain"], repo, env).strip() == ""  # the checkout is untouched
    assert not (repo / "data").exists()
    assert list(workspaces.iterdir()) == []  # the run's temporary clone is gone
    # Prefect 3 reports task states as events, so the stages went on without the server: their finished work
    # is the run's DVC experiment, complete (dvc exp save ran after the stage), as with the server up.
    refs = run_ok(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], repo, env).split()
    assert len(refs) == 1 and re.fullmatch(r"refs/exps/\w\w/\w+/[\w-]+", refs[0]), refs  # named after the flow run


# --- security defaults ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_prefect_server_listens_on_loopback_only(prefect_server):
    root = psutil.Process(prefect_server["server"].pid)
    listening = [
        c.laddr
        for p in (root, *root.children(recursive=True))
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert prefect_server["port"] in {a.port for a in listening}
    assert {a.ip for a in listening} == {"127.0.0.1"}
    assert "python -m flows.deployments --port" in (ROOT / "Makefile").read_text()  # `make serve` starts it so


def test_remote_code_is_never_run(tmp_path):
    pattern = re.compile(r"""trust_remote_code["']?\s*[=:]\s*(?!False\b)""")
    offenders = [
        f"{p.relative_to(ROOT)}:{n}"
        for top in ("rlhf", "flows", "tasks", "bench")
        for p in (ROOT / top).rglob("*.py")
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
    # a model folder that ships its own code (auto_map) is refused, and that code never runs
    folder, marker = tmp_path / "custom", tmp_path / "custom_code_ran"
    folder.mkdir()
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (folder / name).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    auto_map = {
        "AutoConfig": "configuration_custom.CustomConfig",
        "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
    }
    (folder / "config.json").write_text(
        json.dumps({"model_type": "custom", "architectures": ["CustomForCausalLM"], "auto_map": auto_map})
    )
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(folder))}: could not load AutoModelForCausalLM [\s\S]*trust_remote_code"
    ):
        loading.load_causal_lm(folder)
    assert not marker.exists()


class _RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling this creates the marker file


def test_pickle_weights_are_refused_unopened(tmp_path):
    from transformers import LlamaConfig

    folder, marker = tmp_path / "pickled", tmp_path / "unpickled"
    LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=1
    ).save_pretrained(folder)
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(marker)))
    with pytest.raises(
        FileNotFoundError, match=rf"{re.escape(str(folder / 'pytorch_model.bin'))}: pickle weights are not loaded"
    ):
        loading.load_causal_lm(folder)
    with pytest.raises(FileNotFoundError, match="pickle weights are not loaded"):
        loading.load_reward_model(folder)
    assert not marker.exists()


SECRET_NAME = re.compile(r"(^|_)(api_?key|token|secret|password|passwd|credentials?)$", re.I)


def _secret_env(monkeypatch) -> dict[str, str]:
    values = {
        "WANDB_API_KEY": secrets.token_hex(20),
        "HF_TOKEN": f"hf_{secrets.token_hex(16)}",
        "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20),
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def test_params_have_no_secret_fields_and_the_resolved_config_no_secret_values(monkeypatch):
    import yaml

    def names(node, prefix=""):
        for key, value in node.items() if isinstance(node, dict) else ():
            yield f"{prefix}{key}"
            yield from names(value, f"{prefix}{key}.")

    fields = [f"{s}.{n}" for s, f in Config.model_fields.items() for n in getattr(f.annotation, "model_fields", {})]
    offenders = [
        k for k in [*fields, *names(yaml.safe_load(PARAMS.read_text()))] if SECRET_NAME.search(k.rsplit(".", 1)[-1])
    ]
    assert fields and offenders == []
    values = _secret_env(monkeypatch)
    proc = run_cli("--profile", "ci", "config")  # what W&B gets as the run's config, and what `rlhf config` shows
    assert proc.returncode == 0 and "train:" in proc.stdout
    assert [name for name, v in values.items() if v in proc.stdout + proc.stderr] == []


def test_no_secret_from_the_environment_reaches_wandb_files(tmp_path, monkeypatch):
    values = _secret_env(monkeypatch)
    monkeypatch.setenv("WANDB_MODE", "offline")  # a key alone would switch the run online (rlhf.tracking)
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    tracker = Tracker(
        Config(profile="test", data_dir=str(tmp_path / "data"), tracking=TrackingConfig(wandb_mode="offline")), "train"
    )
    print("a line for the console log W&B captures")
    tracker.log({STEP: 8, "objective/scores": 0.5})
    tracker.completions(8, ["a film"] * 2, ["that shines", "that bores"], [0.5, -0.25], [0.875, 0.125])
    tracker.finish({"final/objective/scores": 0.5})
    wandb.teardown()  # stops W&B's service process, which writes the offline run file in the background
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    [record] = [p for p in files if p.suffix == ".wandb"]  # the offline run: config, history, console
    assert str(tmp_path / "data").encode() in record.read_bytes()  # the run's config is in it (data_dir)
    assert {"output.log", "debug.log", "debug-internal.log"} <= {p.name for p in files}
    leaks = [
        f"{name} in {p.relative_to(tmp_path)}"
        for p in files
        for name, v in values.items()
        if v.encode() in p.read_bytes()
    ]
    assert leaks == []


# --- the docs table -------------------------------------------------------------------------------------


def _table(section: str) -> list[str]:
    """The body rows of the first markdown table under `## section` in docs/reliability.md."""
    body = DOC.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return rows[2:]  # header and separator


def test_docs_tables_match_the_tests_one_to_one(request):
    rows = {section: _table(section) for section in ("Bad inputs", "Security defaults")}
    assert len(rows["Bad inputs"]) >= 15
    ids = []
    for section, lines in rows.items():
        for line in lines:
            found = re.findall(r"`(tests/\w+\.py::[^`]+)`", line.rstrip(" |").rsplit(" | ", 1)[-1])
            assert len(found) == 1, f"{section}: each row names exactly one test in its last column: {line}"
            ids += found
    assert len(set(ids)) == len(ids), "two rows name the same test"
    files = sorted({i.split("::")[0] for i in ids})
    # every xdist worker collects the whole run; under --dist loadgroup, a grouped test's id ends in "@<group>"
    collected = {
        item.nodeid.rsplit("@", 1)[0] if item.get_closest_marker("xdist_group") else item.nodeid
        for item in request.session.items
    }
    output = "this session's tests"
    if not all(any(c.startswith(f"{f}::") for c in collected) for f in files):  # run on its own: collect them
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
        collected, output = set(proc.stdout.splitlines()), proc.stdout[-3000:] + proc.stderr[-3000:]
    collected |= {c.split("[")[0] for c in collected}  # a row may name a parametrized test as a whole
    assert [i for i in ids if i not in collected] == [], output
    here = {name for name in globals() if name.startswith("test_")} - {"test_docs_tables_match_the_tests_one_to_one"}
    assert {i.split("::")[1].split("[")[0] for i in ids if i.startswith("tests/test_bad_inputs.py::")} == here
