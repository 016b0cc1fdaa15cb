"""The GPU scripts' logic on the CPU: `make gpu-check`'s dry run (bench/gpu_check.py --cpu-dry-run) and
`make gpu-smoke`'s check list, time limits and GPU-placement check (tests/gpu_smoke.py). The only mock is
MOCK_NVIDIA_SMI, a stand-in for a GPU's memory report (there is no GPU here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gpu_smoke
import psutil
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402
import gpu_profile  # noqa: E402

DRY_RUN = ["train ppo bf16+ckpt+lora", "llama-1b step", "llama-1b step grad-ckpt", "llama-1b weight sync"]
PROFILE = [
    "profile llama-1b compiled",
    "profile hf decode",
    *(f"profile {shape} {what}" for shape in ("tldr", "pythia-1b") for what in ("data", "ppo", "online_dpo")),
]


def test_gpu_check_plans_the_ci_stages_three_trainers_and_the_llama_checks(tmp_path):
    names = [c.name for c in gpu_check.plan(tmp_path, dry_run=False)]
    assert names[:7] == [f"stage {s}" for s in gpu_check.STAGES]
    trainers = [f"train {t} bf16+ckpt+lora" for t in ("ppo", "rloo", "online_dpo")]
    assert names[7:15] == [*trainers, "launch ppo zero2", "launch online_dpo zero3", *DRY_RUN[1:]]
    big = gpu_check.plan(tmp_path, dry_run=False)[14].args
    assert (big["hidden"], big["layers"], big["heads"], big["vocab"]) == (2048, 16, 32, 32000)
    pythia = [f"pythia-1b {s}" for s in ("prepare", "gold", "sft", "reward", "train ppo", "profile ppo")]
    assert names[15:24] == [*pythia, "pythia-1b train online_dpo", "pythia-1b generate", "pythia-1b evaluate"]
    assert names[24:] == PROFILE


def test_gpu_checks_profile_group_is_picked_by_its_first_word_and_says_its_targets(tmp_path):
    """`--only profile` picks the group and nothing else (no other check's name starts with "profile "); the issue's
    targets ride on the checks that measure them."""
    checks = gpu_check.plan(tmp_path / "data", dry_run=False)
    picked, unknown = gpu_check.select(checks, "profile")
    assert [c.name for c in picked] == PROFILE and not unknown
    targets = {c.name: c.targets for c in picked if c.targets}
    assert targets == {
        "profile llama-1b compiled": {"peak_share": (">=", 0.40)},
        "profile hf decode": {"best_ms": ("<=", 5.0)},
        "profile pythia-1b ppo": {"step_s": ("<=", 0.3)},
        "profile tldr ppo": {"busy": (">=", 0.80)},
        "profile tldr online_dpo": {"busy": (">=", 0.80)},
    }
    assert {c.args["cli"][-2].split("=")[0] for c in picked if "cli" in c.args} == {"train.total_episodes"}


def test_gpu_checks_tldr_shape_is_the_papers_batch_with_pythia_410ms_layout(tmp_path):
    """The TL;DR checks' settings validate and give 64 prompts x 53 new tokens an update, 4 updates, room for prompts
    of up to 587 tokens (440 words are ~514 tokens, bench/gpu_profile.py), PPO with one sample a prompt, and a model
    of Pythia-410m's layout (~0.31B parameters with the 4k vocabulary)."""
    from rlhf.config.loader import load_config
    from rlhf.models import tiny

    checks = {c.name: c for c in gpu_check.plan(tmp_path / "data", dry_run=False)}
    ppo = [a for a in checks["profile tldr ppo"].args["cli"] if "=" in a]
    assert f"data_dir={tmp_path / 'profile-tldr'}" in ppo and "train.k=1" in ppo
    cfg = load_config(ROOT / "params.yaml", "ci", [*ppo, "train.trainer=ppo"])
    t = cfg.train
    prompts = t.per_device_train_batch_size * t.gradient_accumulation_steps * t.num_mini_batches
    assert (prompts, t.response_length, t.num_batches(), t.k, cfg.data.prompt_words) == (64, 53, 4, 1, 440)
    assert cfg.model.max_position_embeddings - t.response_length == 587
    tok = tiny.train_word_tokenizer(["a b c"], vocab_size=64)
    tok.add_tokens([f"w{i}" for i in range(cfg.model.vocab_size - len(tok))])
    with torch.device("meta"):
        model = tiny.build_tiny_model(cfg.model, tok, seed=0)
    assert (model.config.num_hidden_layers, model.config.hidden_size, model.config.num_attention_heads) == (
        24,
        1024,
        16,
    )
    assert 0.30e9 < tiny.count_parameters(model) < 0.32e9
    data = [a for a in checks["profile tldr data"].args["common"] if "=" in a]
    assert set(data) < set(ppo) and "train.k=1" not in data  # the data stages share the train stage's settings


def test_gpu_check_only_takes_names_or_their_first_words(tmp_path):
    checks = gpu_check.plan(tmp_path, dry_run=True)
    picked, unknown = gpu_check.select(checks, "pythia-1b, llama-1b weight sync,nosuch,pythia")
    assert [c.name for c in picked][0] == "llama-1b weight sync" and unknown == ["nosuch", "pythia"]
    assert [c.name for c in picked][1:] == [c.name for c in checks if c.name.startswith("pythia-1b ")]
    assert len(gpu_check.select(checks, "stage,train,launch,llama-1b")[0]) == 15


def test_gpu_check_pythia_stages_share_one_valid_setting_at_pythia_1bs_shape(tmp_path):
    """Every stage of check e. gets the same settings (else a later stage refuses the earlier one's output), they
    validate, and the model they build is Pythia-1B's shape: ~0.82B parameters with the 4k vocabulary."""
    from rlhf.config.loader import load_config
    from rlhf.models import tiny

    checks = [c for c in gpu_check.plan(tmp_path, dry_run=False) if c.name.startswith("pythia-1b")]
    settings = {tuple(a for a in c.args["cli"] if "=" in a) for c in checks}
    assert len(settings) == 1 and next(iter(settings))[0] == f"data_dir={tmp_path.with_name('pythia')}"
    cfg = load_config(ROOT / "params.yaml", "ci", list(next(iter(settings))))
    assert cfg.train.mixed_precision == "bf16" and cfg.train.gradient_checkpointing
    tok = tiny.train_word_tokenizer(["a b c"], vocab_size=64)
    tok.add_tokens([f"w{i}" for i in range(cfg.model.vocab_size - len(tok))])  # the full 4k vocabulary
    with torch.device("meta"):
        model = tiny.build_tiny_model(cfg.model, tok, seed=0)
    assert model.config.model_type == "gpt_neox" and model.config.hidden_size // model.config.num_attention_heads == 256
    assert 0.81e9 < tiny.count_parameters(model) < 0.83e9


# slow: the device call's script end to end on the CPU, data stages and runs in fresh interpreters (~45-130 s)
@pytest.mark.slow
def test_gpu_check_dry_run_prints_a_line_and_figures_per_check(ci_data, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--data", str(ci_data), "--out", str(out)]
    proc = subprocess.run([*cmd, "--only", ",".join(DRY_RUN)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("ok", "FAIL"))]
    assert [x.split("  ")[0] for x in lines] == ["ok"] * 4 and all(n in proc.stdout for n in DRY_RUN)
    checks = {c["name"]: c for c in json.loads((out / "gpu_check.json").read_text())["checks"]}
    assert all(c["ok"] and c["peak_gib"] > 0 and c["peak_kind"] == "rss" for c in checks.values())
    train = checks["train ppo bf16+ckpt+lora"]["figures"]
    assert train["step"] > 0 and train["eps"] > 0 and train["updates"] == 2 and "weight_sync" in train
    for name in DRY_RUN[1:3]:
        step = checks[name]["figures"]
        assert step["tokens_per_s"] > 0 and step["batch_x_seq"] == "2x32" and 0.05 < step["params_m"] < 0.2
    sync = checks["llama-1b weight sync"]["figures"]
    assert sync["d2d_gbps"] > 0 and sync["shared_d2h_gbps"] > 0 and sync["shared_h2d_gbps"] > 0
    assert sync["pageable_d2h_gbps"] > 0 and sync["shared_first_s"] > 0
    assert "train.lora.rank=4" in (out / "gpu_check.log").read_text()


def test_gpu_smoke_lists_the_new_checks_each_with_a_time_limit(tmp_path):
    checks = {c.name: c for c in gpu_smoke.checks(tmp_path, gpus=3, vllm_cuda=True)}
    assert all(c.timeout > 0 for c in checks.values())
    assert "engine-vs-learner log-probs after a sync" in checks
    zero3 = checks["train async zero3 x2 + engine on its own GPU"]
    assert "configs/zero3.yaml" in " ".join(zero3.cmd) and zero3.gpus == (0, 1, 2)
    neox = [c for name, c in checks.items() if name.startswith("gpt_neox:")]
    assert neox and all("model.architecture=gpt_neox" in c.cmd for c in neox)
    assert checks["train ppo (hf)"].data == tmp_path and checks["math: stage train"].data == tmp_path / "math"
    assert "engine-vs-learner log-probs after a sync" not in {c.name for c in gpu_smoke.checks(tmp_path, 1, False)}


def test_gpu_smoke_checks_see_the_gpus_reversed_and_expect_the_physical_ones():
    assert gpu_smoke.visible_order(None, 3) == ["2", "1", "0"]
    assert gpu_smoke.visible_order("4, 5,6", 3) == ["6", "5", "4"]
    engine_on_cuda1 = gpu_smoke.Check("x", [], gpus=(0, 1))
    assert gpu_smoke.expected_gpus(engine_on_cuda1, ["6", "5", "4"]) == {"6", "5"}


def test_a_gpu_smoke_check_past_its_time_limit_fails_and_its_processes_are_killed(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    spawn = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    code = f"{spawn}; open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    start = time.perf_counter()
    ok, tail = gpu_smoke.run_check(gpu_smoke.Check("sleeper", [sys.executable, "-c", code], timeout=3), ["0"])
    assert not ok and tail == "timeout after 3 s" and time.perf_counter() - start < 30
    grandchild = int(pid_file.read_text())

    def gone() -> bool:
        try:
            return psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE  # killed, not yet reaped
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously: on a busy box, a moment later
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()


MOCK_NVIDIA_SMI = """#!/bin/sh
# MOCK: a GPU's memory report (no GPU here): two GPUs, index 0 and 1; a "check" writes the MiB it takes on each
cat {usage} 2>/dev/null || printf '0, 100\\n1, 100\\n'
"""


@pytest.mark.parametrize("physical, ok", [("1", True), ("0", False)])
def test_a_gpu_smoke_check_on_another_gpu_than_its_own_fails(tmp_path, monkeypatch, physical, ok):
    """With the GPUs reversed ("1,0") a one-GPU check belongs on physical GPU 1: taking memory on GPU 0 instead
    (an engine that ignored its parent's CUDA_VISIBLE_DEVICES) fails it."""
    usage = tmp_path / "usage"
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(MOCK_NVIDIA_SMI.format(usage=usage))
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    rows = {"0": "100", "1": "100", physical: "2100"}
    code = f"import time; open({str(usage)!r}, 'w').write('0, {rows['0']}\\n1, {rows['1']}\\n'); time.sleep(1.5)"
    result, tail = gpu_smoke.run_check(gpu_smoke.Check("gpu", [sys.executable, "-c", code]), ["1", "0"])
    assert result is ok, tail
    assert f"gpu{physical}+2000MiB" in tail
    if not ok:
        assert "wrong GPUs: used ['0'], expected ['1']" in tail


def test_gpu_check_profiled_train_reports_the_ops_time_against_the_steps(ci_data, tmp_path):
    """e.'s PPO under torch.profiler, run as gpu_check runs it (a child process), on the CPU with the ci data: the ops'
    own time, the steps' wall time, their ratio, and the busiest ops' table in the log."""
    result = tmp_path / "result.json"
    cli = ["train", "--trainer", "ppo", f"data_dir={ci_data}", "tracking.wandb_mode=disabled"]
    cmd = [sys.executable, "bench/gpu_check.py", "--child", "profiled_stage", "--result", str(result)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([*cmd, "--args", json.dumps({"cli": cli})], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    figures = json.loads(result.read_text())["figures"]
    assert figures["updates"] == 2 and figures["kernels_per_update"] == 0  # no GPU, no kernels
    assert 0 < figures["cpu_ops_s"] and 0 < figures["steps_s"] and figures["busy"] > 0
    assert "Self CPU" in proc.stdout  # the table, for the log


# slow: the device call's script end to end on the CPU, data stages and runs in fresh interpreters (~45-130 s)
@pytest.mark.slow
def test_gpu_check_profile_groups_dry_run_measures_every_figure_beside_its_target(tmp_path):
    """`--cpu-dry-run --only profile` as the device call runs it, data stages included, at tiny sizes: every check ok,
    its figures measured and consistent with one another, each target printed beside its figure."""
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_check.py", "--cpu-dry-run", "--only", "profile", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("ok", "FAIL"))]
    assert len(lines) == len(PROFILE) and all(x.startswith("ok") and n in x for n, x in zip(PROFILE, lines))
    checks = {c["name"]: c for c in json.loads((out / "gpu_check.json").read_text())["checks"]}
    figures = {name: c["figures"] for name, c in checks.items()}
    llama = figures["profile llama-1b compiled"]
    assert (
        llama["compile_s"] > 0
        and llama["graphs"] == 1
        and llama["peak_share"] == pytest.approx(llama["tflops"] / llama["matmul_tflops"], 0.01)
    )
    decode = figures["profile hf decode"]
    assert decode["dynamic_ms"] > 0 and decode["static_ms"] > 0 and decode["static_graphs"] == 1
    assert decode["best_ms"] == min(decode["dynamic_ms"], decode["static_ms"]) and 0 <= decode["rows_alike"] <= 1
    assert decode["dynamic_repeats"] is True and decode["static_repeats"] is True  # one CPU, one seed: bit for bit
    short, tldr = figures["profile pythia-1b data"], figures["profile tldr data"]
    assert all(short[f"{s}_s"] > 0 and tldr[f"{s}_s"] > 0 for s in ("prepare", "gold", "sft", "reward"))
    assert short["prompt_tokens_mean"] < 20 < tldr["prompt_tokens_mean"] <= tldr["prompt_tokens_max"] <= 80 - 12
    for name in PROFILE[3:5] + PROFILE[6:]:  # the trainers
        train = figures[name]
        assert train["updates"] == 4 and train["ops_per_update"] > 1000 and 0 < train["busy"] <= 1.5
        phases = sum(train[f"{p}_s"] for p in ("generation", "scoring", "reference", "update", "weight_sync"))
        assert 0 < phases <= train["step_s"] * 1.05 and train["profiled_s"] > 0
    assert checks["profile tldr ppo"]["targets"] == {"busy": ">= 0.8"}
    assert checks["profile tldr ppo"]["met"] == {"busy": figures["profile tldr ppo"]["busy"] >= 0.8}
    assert "busy=" in lines[3] and "(target >= 0.8: " in lines[3] and "(target <= 0.3: " in lines[6]
    assert "Self CPU" in (out / "gpu_check.log").read_text()  # the profiled windows' busiest ops, for the log


MOCK_UTILISATION = """#!/bin/sh
# MOCK: nvidia-smi's utilisation stream (no GPU here), as `-lms 100` prints it: 40 and 60 in turn, every 0.1 s
while true; do echo 40; sleep 0.1; echo 60; sleep 0.1; done
"""


def test_gpu_check_reads_nvidia_smis_utilisation_within_the_updates_it_is_asked_about(tmp_path, monkeypatch):
    """The profile group's second reading of busy: nvidia-smi's stream read while the block runs, stamped on
    arrival, averaged over the windows asked for (none in a window: no figure), the stream stopped at the end."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(MOCK_UTILISATION)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpu_profile.Utilisation(torch.device("cuda", 0)) as smi_busy:
        start = time.perf_counter()
        time.sleep(1.2)
        end = time.perf_counter()
    assert len(smi_busy.samples) >= 5 and smi_busy._proc.poll() is not None
    assert 0.4 <= smi_busy.mean([(start, end)]) <= 0.6 and smi_busy.mean([(end + 1, end + 2)]) is None
    assert gpu_profile.Utilisation(torch.device("cpu")).__enter__()._proc is None  # the dry run reads none
