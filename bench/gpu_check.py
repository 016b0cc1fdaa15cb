"""`make gpu-check`: what one lent GPU can tell us, each check in a process of its own. a.-d. took ~6 minutes and e.
~4 on an H100/H200, before the HF engine compiled its decode step on a GPU (each process that samples now pays a
compile first: tens of seconds at 1B, reasoned); f. ~8-9 (estimated: not yet run). Within a 10-minute device call,
run them as three calls: `--only stage,train,launch,llama-1b`, `--only pythia-1b` and `--only profile`.

Checks, in order (later ones use what earlier ones wrote):
  a. the `ci` stages end to end on CUDA with the HF engine (prepare, gold, sft, reward, train, generate, evaluate);
  b. PPO, RLOO and online DPO (HF engine) with bf16 mixed precision, gradient checkpointing and LoRA together;
  c. PPO under DeepSpeed ZeRO-2 and online DPO under ZeRO-3 (bf16 + LoRA), each as `accelerate launch` of rlhf.cli
     with configs/zero{2,3}.yaml on the one GPU (DeepSpeed's wheel is built here and carried);
  d. a random-initialised ~1B Llama (hidden 2048, 16 layers, 32 heads, vocab 32000): bf16-autocast AdamW steps
     (fp32 master weights) at 8 x 512 tokens, without and with gradient checkpointing; and one host-memory weight
     sync of its state dict (GPU -> the project's SharedWeights -> GPU) against a device-to-device copy;
  e. the `ci` pipeline again at Pythia-1B's shape (GPT-NeoX, ~0.82B with a 4k vocabulary) in a data_dir of its own:
     every stage, PPO (policy, value model, reference, RM) and online DPO with bf16 and gradient checkpointing, and
     PPO again under torch.profiler: the GPU's kernel time against the steps' wall time (GPU- or host-bound?);
  f. the profile group (bench/gpu_profile.py, names "profile ..."), each figure beside the issue's target: the 1B
     Llama step compiled, with fused AdamW, against the card's matmul peak measured in the same process; the HF
     engine's ms per decoding step at batch 64 on Pythia-1B, dynamic vs static cache; PPO and online DPO at
     Pythia-1B's 8 x 8 shape and at the paper's TL;DR shape (64 prompts x 53 tokens after ~512-token prompts,
     Pythia-410m's layout), each shape with its own data stages: seconds per phase, GPU busy, kernels per update.
One line per check: ok/FAIL, seconds, the peak memory of its process (torch.cuda.max_memory_allocated; on the CPU
the peak RSS), key figures (a figure with a target: `busy=0.83 (target >= 0.8: met)`). The full log
(gpu_check.log) and the figures (gpu_check.json, with each target and whether it was met) go to --out.
`--cpu-dry-run` runs the same logic on the CPU at tiny sizes (tests/test_gpu_scripts.py runs parts of it and all
of f.).

It runs on the lent machine's own python3 (torch 2.11, transformers 5.17; no venv, no `rlhf` console script):
children are `python3 bench/gpu_check.py --child ...`, stages run through rlhf.cli.main in that child. The
wheels its image lacks travel in .whl/ (`make gpu-wheels`, bench/gpu_wheels.txt). The device `run` call (f.: the
same with `--only profile`; its checks write gpu_check.json as each ends, so a call cut short keeps what ran):

  command: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
           .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 &&
           timeout 560 python3 bench/gpu_check.py --out $OUT --only pythia-1b
  carry: [".whl"]    timeout_s: 600

Here: `make gpu-check` (a CUDA box with the venv), or `.venv/bin/python bench/gpu_check.py --cpu-dry-run`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# beside this script in bench/: the profile group's decode check, d.'s children, the profile group, what all share
from gpu_decode import hf_decode
from gpu_llama import LLAMA_1B, LLAMA_TINY, llama_compiled, llama_step, weight_sync
from gpu_profile import activity, data_stages, profile_plan, profiled_train
from gpu_stages import PYTHIA_1B, ROOT, STAGES, TRAINER_SETTINGS, Check, data_dir, stage, stage_figures

TRAINERS = ("ppo", "rloo", "online_dpo")
# c.: (trainer, accelerate config, settings) launched as a user launches them
LAUNCHED = (("ppo", "zero2", ("train.mixed_precision=bf16",)), ("online_dpo", "zero3", TRAINER_SETTINGS[::2]))
PYTHIA_EPISODES = 64  # e.: 8 updates of 8 prompts: steady-state step times (ci's 16 episodes are 2 updates)


def plan(data: Path, dry_run: bool) -> list[Check]:
    """The checks in order; `data` is the ci data_dir they share."""
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled"]
    out = [Check(f"stage {s}", "stage", {"cli": [s, *common]}, 150.0) for s in STAGES]
    for trainer in TRAINERS:
        cli = ["train", "--trainer", trainer, *TRAINER_SETTINGS, *common]
        out.append(Check(f"train {trainer} bf16+ckpt+lora", "stage", {"cli": cli}, 150.0))
    for trainer, zero, settings in LAUNCHED:
        cli = ["train", "--trainer", trainer, *settings, *common]
        out.append(Check(f"launch {trainer} {zero}", "launch", {"zero": zero, "cli": cli}, 180.0))
    shape = LLAMA_TINY if dry_run else LLAMA_1B
    out.append(Check("llama-1b step", "llama_step", {**shape, "ckpt": False}, 150.0))
    out.append(Check("llama-1b step grad-ckpt", "llama_step", {**shape, "ckpt": True}, 150.0))
    out.append(Check("llama-1b weight sync", "weight_sync", {**shape, "repeats": 3}, 150.0))
    return out + pythia_plan(data.with_name("pythia"), dry_run) + profile_plan(data.parent, dry_run)


def pythia_plan(data: Path, dry_run: bool) -> list[Check]:
    """e.: every stage at Pythia-1B's shape in a data_dir of its own; the trainers with bf16 and checkpointing, and
    PPO once more under torch.profiler."""
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled", *TRAINER_SETTINGS[:2]]
    common += ["model.architecture=gpt_neox"] if dry_run else [*PYTHIA_1B, f"train.total_episodes={PYTHIA_EPISODES}"]

    def check(name: str, cli: list[str], func: str = "stage") -> Check:
        return Check(f"pythia-1b {name}", func, {"cli": [*cli, *common]}, 150.0)

    trainers = [  # generate and evaluate take the last one trained, which must be the default trainer's (online DPO)
        check("train ppo", ["train", "--trainer", "ppo"]),
        check("profile ppo", ["train", "--trainer", "ppo"], "profiled_stage"),
        check("train online_dpo", ["train", "--trainer", "online_dpo"]),
    ]
    before, after = STAGES[: STAGES.index("train")], STAGES[STAGES.index("train") + 1 :]
    return [check(s, [s]) for s in before] + trainers + [check(s, [s]) for s in after]


def select(checks: list[Check], only: str) -> tuple[list[Check], list[str]]:
    """The checks `--only` names, in plan order: a full name or its first words ("pythia-1b", "stage"); and the
    names that pick none."""
    names = [n.strip() for n in only.split(",") if n.strip()]
    picks = lambda c, n: c.name == n or c.name.startswith(n + " ")  # noqa: E731
    unknown = [n for n in names if not any(picks(c, n) for c in checks)]
    return [c for c in checks if any(picks(c, n) for n in names)], unknown


# --- the parent: runs each check in a child, prints its line, keeps the log and the figures ---------------------


def run_check(check: Check, out: Path, env: dict, log) -> dict:
    """Run one check in a child process; its result (ok, seconds, peak memory, figures, error)."""
    result_file = out / "child_result.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", check.func, "--result", str(result_file)]
    cmd += ["--args", json.dumps(check.args)]
    log.write(f"\n===== {check.name}: {' '.join(cmd)}\n")
    log.flush()
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=check.timeout)
        error = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        error = f"timeout after {check.timeout:.0f} s"
    seconds = time.perf_counter() - start
    child = json.loads(result_file.read_text()) if result_file.exists() else {}
    error = (child.get("error") or error) if error else None  # the child's own line says more than its exit code
    result = {"name": check.name, "ok": error is None, "seconds": round(seconds, 2), **child, "error": error}
    return result | targets(check.targets, result.get("figures", {}))


def targets(wanted: dict, figures: dict) -> dict:
    """The issue's targets for a check's figures, {"targets": {figure: ">= 0.8"}, "met": {figure: bool}}: whether
    each was met is read at a glance, not what makes a check ok (that it ran). A figure missing is not met."""
    if not wanted:
        return {}
    met = {
        k: k in figures and (figures[k] >= bound if op == ">=" else figures[k] <= bound)
        for k, (op, bound) in wanted.items()
    }
    return {"targets": {k: f"{op} {bound:g}" for k, (op, bound) in wanted.items()}, "met": met}


def line(r: dict) -> str:
    """The check's line: ok/FAIL, name, seconds, peak memory, figures (or the error), each figure with a target
    followed by it and whether it was met: busy=0.83 (target >= 0.8: met)."""
    peak = r.get("peak_gib")
    memory = f"peak {peak:7.2f} GiB ({r.get('peak_kind', '?')})" if peak is not None else "peak       ?"
    figures, wanted, met = r.get("figures", {}), r.get("targets", {}), r.get("met", {})
    marks = {k: f" (target {wanted[k]}: {'met' if met[k] else 'MISSED'})" for k in wanted}
    tail = r["error"] if r["error"] else "  ".join(f"{k}={_fmt(v)}{marks.get(k, '')}" for k, v in figures.items())
    tail = "  ".join([tail, *(f"{k} (target {wanted[k]}): not measured" for k in wanted if k not in figures)])
    return f"{'ok  ' if r['ok'] else 'FAIL'}  {r['name']:<32} {r['seconds']:6.1f} s  {memory}  {tail}"


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def child_env(work: Path, dry_run: bool) -> dict:
    """The children's environment: the project's offline settings, caches in the scratch folder, more torch threads
    on a GPU box (its 16 cores are ours alone)."""
    env = {**os.environ, "RLHF_CACHE_DIR": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, even on a box with a GPU
    else:
        env.setdefault("RLHF_TORCH_THREADS", "4")
    return env


def environment(dry_run: bool) -> dict:
    """Device and library versions, for the first line and the JSON."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    names = (
        "torch",
        "transformers",
        "accelerate",
        "deepspeed",
        "peft",
        "datasets",
        "pyarrow",
        "pandas",
        "pydantic",
        "pandera",
    )
    versions = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda and not dry_run else "cpu (dry run)"
    return {"device": device, "cuda": torch.version.cuda, "versions": versions}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "gpu-check"), help="folder for the log and the JSON")
    ap.add_argument("--cpu-dry-run", action="store_true", help="the same checks on the CPU at tiny sizes")
    ap.add_argument("--data", help="an existing ci data_dir to use (copied) instead of a fresh one")
    ap.add_argument(
        "--only", help="comma-separated check names or their first words, e.g. 'stage,pythia-1b' (default: all)"
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--args", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args.child, Path(args.result), json.loads(args.args))
    return parent_main(args)


def parent_main(args) -> int:
    env_info = environment(args.cpu_dry_run)
    if not args.cpu_dry_run and env_info["device"] == "cpu (dry run)":
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); --cpu-dry-run runs it on the CPU")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    data = work / "data"
    if args.data:
        shutil.copytree(args.data, data)
    checks = plan(data, args.cpu_dry_run)
    if args.only:
        checks, unknown = select(checks, args.only)
        if unknown:
            print(f"gpu-check: --only: unknown check(s) {unknown}; choose among {[c.name for c in plan(data, False)]}")
            return 2
    print(f"gpu-check: {env_info['device']}, CUDA {env_info['cuda']}; {env_info['versions']}", flush=True)
    results = []
    with (out / "gpu_check.log").open("w") as log:
        for check in checks:
            results.append(run_check(check, out, child_env(work, args.cpu_dry_run), log))
            print(line(results[-1]), flush=True)
            (out / "gpu_check.json").write_text(json.dumps({**env_info, "checks": results}, indent=1))
    (out / "child_result.json").unlink(missing_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    failed = sum(not r["ok"] for r in results)
    print(f"gpu-check: {'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return 1 if failed else 0


# --- the children --------------------------------------------------------------------------------------------


def child_main(func: str, result: Path, args: dict) -> int:
    """Run CHILDREN[func](**args) on this process's device; write its figures and peak memory to `result`."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the dry run's children see no GPU
    try:
        figures = CHILDREN[func](device=device, **args)
        error = figures.pop("error", None)  # a check that measured what it could, then found a fault
        peak = figures.pop("peak", None)  # a check whose GPU work ran in processes of its own measures it itself
    except Exception as e:  # the parent prints one line; the traceback is in the log
        import traceback

        traceback.print_exc()
        figures, error, peak = {}, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200], None
    result.write_text(json.dumps({"figures": figures, "error": error, **(peak or peak_memory(device))}))
    return 0 if error is None else 1


def peak_memory(device) -> dict:
    """The process's peak memory: CUDA's allocator peak when it ran on a GPU, else the peak resident set."""
    import resource

    import torch

    if device.type == "cuda" and torch.cuda.is_initialized():
        return {"peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3), "peak_kind": "cuda"}
    return {"peak_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3), "peak_kind": "rss"}


def profiled_stage(device, cli: list[str]) -> dict:
    """`stage` under torch.profiler: is a train step GPU-bound or host-bound? The device's kernel and copy time
    against the wall time of the steps (the profiler's overhead is the host's, so `busy` is a lower bound), the kernels
    per update; the table of the busiest ops goes to the log. On the CPU (dry run): the ops' own CPU time instead."""
    from torch.profiler import ProfilerActivity, profile

    from rlhf.tracking import logged_rows

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        figures = stage(device, cli)
    ops = prof.key_averages()
    print(ops.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25), flush=True)
    steps_s = sum(float(r["timing/step"]) for r in logged_rows(data_dir(cli)))
    # the device's own events only: summing every op's self device time counted each kernel twice, once as the
    # kernel and once in the op that launched it
    own_s, work = activity(prof, cuda)
    return {
        "updates": figures["updates"],
        "steps_s": round(steps_s, 3),
        "device_s" if cuda else "cpu_ops_s": round(own_s, 3),
        "busy": round(own_s / steps_s, 3),  # includes the loading's copies: a little generous on a GPU
        "kernels_per_update": round(work / figures["updates"]) if cuda else 0,
    }


def launch(device, zero: str, cli: list[str]) -> dict:
    """`accelerate launch --config_file configs/<zero>.yaml --num_processes 1 -m rlhf.cli ... <cli>` as a fresh
    process; the train figures, and the most GPU memory in use while it ran (nvidia-smi, every 0.5 s)."""
    import threading

    config = str(ROOT / "configs" / f"{zero}.yaml")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "1"]
    rlhf = ["-m", "rlhf.cli", "--params", str(ROOT / "params.yaml"), "--profile", "ci", *cli]
    used, done = [], threading.Event()

    def poll():
        while device.type == "cuda" and not done.wait(0.5):
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            )
            used.extend(int(x) for x in smi.stdout.split() if x.isdigit())

    watcher = threading.Thread(target=poll, daemon=True)
    watcher.start()
    try:
        code = subprocess.run([*launcher, *rlhf], cwd=ROOT).returncode
    finally:
        done.set()
        watcher.join()
    if code != 0:
        raise RuntimeError(f"accelerate launch ({zero}) exited {code} (its error line is in the log)")
    data = data_dir(cli)
    peak = {"peak": {"peak_gib": round(max(used) / 1024, 3), "peak_kind": "nvidia-smi, whole GPU"}} if used else {}
    return {**stage_figures(data, "train"), **peak}


CHILDREN = {
    "stage": stage,
    "profiled_stage": profiled_stage,
    "launch": launch,
    "llama_step": llama_step,
    "weight_sync": weight_sync,
    "llama_compiled": llama_compiled,
    "hf_decode": hf_decode,
    "data_stages": data_stages,
    "profiled_train": profiled_train,
}

if __name__ == "__main__":
    sys.exit(main())
