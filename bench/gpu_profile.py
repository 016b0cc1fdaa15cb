"""`make gpu-check`'s profile group (`--only profile`; bench/gpu_check.py runs each check in a child process): where
an update's time goes on the GPU, each figure printed beside its target from the issue. In order:

  profile llama-1b compiled   a bf16 matmul's TFLOP/s (8192^3: the card's measured peak), then the ~1B Llama's step
                              (fused AdamW, each decoder layer torch.compiled) as a share of it (target >= 0.40)
  profile hf decode           the HF engine's ms per decoding step at batch 64 on Pythia-1B (1.01B, its own 50k
                              vocabulary), 512-token prompts, dynamic vs static+compiled cache (target <= 5 ms for the
                              faster); whether each repeats itself bit for bit, and how many rows the two share
                              (bench/gpu_decode.py)
  profile tldr data/ppo/online_dpo        the paper's TL;DR shape: 64 prompts x 53 new tokens after ~512-token
                              prompts, with the paper's policy size (Pythia-410m's layout), 4 updates; PPO with k = 1
  profile pythia-1b data/ppo/online_dpo   the `ci` stages at Pythia-1B's shape, 8 prompts x 8 new tokens, 6 updates
A shape's data stages run in one process, their sampling with the dynamic cache (RLHF_HF_DECODE); its trainers
sample with the engine's default (static on a GPU). Each train check reports per update (the first, CUDA's warm-up
and the static decode's compile, left out): the mean seconds of the step and of each phase over the updates not
profiled (the loop's Clock times them on the device), over the profiled ones GPU busy (the device's kernel and copy
time over their wall time) and kernels per update, and nvidia-smi's utilisation over the others (`smi_busy`, a
coarse reading that needs no profiler); peak memory is the check's. Targets: busy >= 0.80 at the TL;DR shape; PPO at
Pythia-1B's 8 x 8 <= 0.3 s a step.

Sized for one 10-minute device call on an H200 (estimated, not yet run: ~8-9 minutes, most of it in the compiles, a
few tens of seconds each, and the 1B data stages): the device call is the module docstring's of bench/gpu_check.py
with `--only profile`. Each check writes gpu_check.json as it ends; a call cut short keeps what ran, and `--only
"profile pythia-1b"` runs the rest.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_decode import DECODE_1B, DECODE_TINY
from gpu_llama import LLAMA_1B, LLAMA_TINY
from gpu_stages import PYTHIA_1B, ROOT, TRAINER_SETTINGS, Check, data_dir, stage

# The paper's TL;DR shape with its policy's size: Pythia-410m's layout (24 x 1024, 16 heads, MLP 4096; the 4k word
# vocabulary: ~0.31B parameters). 440 review words are 514 tokens on average (448-589) under ci's word tokenizer; a
# context of 640 keeps every prompt up to 587 tokens (640 - 53). 8 prompts x 8 micro-batches = 64 per update.
TLDR_410M = (
    "model.architecture=gpt_neox",
    "model.hidden_size=1024",
    "model.num_layers=24",
    "model.num_heads=16",
    "model.intermediate_size=4096",
    "model.vocab_size=4096",
    "model.max_position_embeddings=640",
    "sft.learning_rate=3e-4",
    "data.prompt_words=440",
    "data.n_rl_prompts=256",
    "train.response_length=53",
    "train.per_device_train_batch_size=8",
    "train.gradient_accumulation_steps=8",
    "train.num_mini_batches=1",
)
# The dry run's: ci's model as GPT-NeoX, 40-word prompts (~47 tokens), 12 new tokens, 4 prompts per update
TLDR_TINY = (
    "model.architecture=gpt_neox",
    "model.max_position_embeddings=80",
    "data.prompt_words=40",
    "train.response_length=12",
    "train.per_device_train_batch_size=2",
    "train.gradient_accumulation_steps=2",
    "train.num_mini_batches=1",
)


@dataclass(frozen=True)
class Shape:
    name: str
    settings: tuple[str, ...]
    episodes: int  # over the run: updates x prompts per update
    profiled: tuple[int, ...]  # the updates run under the profiler; the others (but the first) give the step times
    ppo: tuple[str, ...] = ()  # PPO's own settings
    targets: dict | None = None  # trainer -> {figure: (op, bound)}


def shapes(dry_run: bool) -> list[Shape]:
    """The TL;DR shape (4 updates of 64 prompts, the third profiled) and Pythia-1B at 8 x 8 (6 of 8, the fourth and
    fifth profiled), in that order: a call cut short keeps the two busy targets; the dry run's at ci's model (4
    updates each, the third profiled)."""
    busy = {"busy": (">=", 0.80)}
    if dry_run:
        return [
            Shape("tldr", TLDR_TINY, 16, (2,), ("train.k=1",), {"ppo": busy, "online_dpo": busy}),
            Shape("pythia-1b", ("model.architecture=gpt_neox",), 32, (2,), targets={"ppo": {"step_s": ("<=", 0.3)}}),
        ]
    return [
        Shape("tldr", TLDR_410M, 256, (2,), ("train.k=1",), {"ppo": busy, "online_dpo": busy}),
        Shape("pythia-1b", PYTHIA_1B, 48, (3, 4), targets={"ppo": {"step_s": ("<=", 0.3)}}),
    ]


def profile_plan(work: Path, dry_run: bool) -> list[Check]:
    """The group in order: the two checks that need no data first, then each shape's data stages and trainers in a
    data_dir of its own (`work`/profile-<shape>)."""
    llama = {**(LLAMA_TINY if dry_run else LLAMA_1B), "matmul_n": 256 if dry_run else 8192}
    llama["backend"] = "aot_eager" if dry_run else "inductor"  # the dry run traces the step, generating no code
    decode = {**(DECODE_TINY if dry_run else DECODE_1B), "repeats": 3, "backend": "eager" if dry_run else None}
    out = [
        Check("profile llama-1b compiled", "llama_compiled", llama, 240.0, {"peak_share": (">=", 0.40)}),
        Check("profile hf decode", "hf_decode", decode, 240.0, {"best_ms": ("<=", 5.0)}),
    ]
    for shape in shapes(dry_run):
        out += shape_checks(work / f"profile-{shape.name}", shape)
    return out


def shape_checks(folder: Path, shape: Shape) -> list[Check]:
    common = [f"data_dir={folder}", "tracking.wandb_mode=disabled", *TRAINER_SETTINGS[:2], *shape.settings]
    common += [f"train.total_episodes={shape.episodes}", "train.eval_checkpoints=[1.0]"]  # one policy saved, at the end
    out = [Check(f"profile {shape.name} data", "data_stages", {"common": common}, 300.0)]
    for trainer in ("ppo", "online_dpo"):
        cli = ["train", "--trainer", trainer, *(shape.ppo if trainer == "ppo" else ()), *common]
        targets = (shape.targets or {}).get(trainer, {})
        out.append(
            Check(
                f"profile {shape.name} {trainer}",
                "profiled_train",
                {"cli": cli, "profiled": shape.profiled},
                300.0,
                targets,
            )
        )
    return out


# --- the children -------------------------------------------------------------------------------------------------


def data_stages(device, common: list[str]) -> dict:
    """prepare, gold, sft and reward of one shape's data_dir in this one process (a process each would pay the imports
    four times): each one's seconds, the model's size, and the RL prompts' lengths in tokens as the loop will see them
    (those that fit the context). The reward stage samples its 64 pairs with the dynamic cache: a static one's compile
    would cost more than it saves, in a stage the group does not measure."""
    import os

    from rlhf.config.loader import load_config
    from rlhf.models.loading import load_tokenizer
    from rlhf.trainers.setup import load_rl_prompts

    os.environ["RLHF_HF_DECODE"] = "dynamic"  # this check's own process
    figures = {}
    for name in ("prepare", "gold", "sft", "reward"):
        start = time.perf_counter()
        stage(device, [name, *common])
        figures[f"{name}_s"] = round(time.perf_counter() - start, 2)
    cfg = load_config(ROOT / "params.yaml", "ci", common)
    figures["params_m"] = round(json.loads(cfg.path("metrics", "sft.json").read_text())["n_params"] / 1e6, 1)
    prompts = [len(p) for p in load_rl_prompts(cfg, load_tokenizer(cfg.path("sft")))]
    figures |= {"prompts": len(prompts), "prompt_tokens_mean": round(sum(prompts) / len(prompts), 1)}
    return {**figures, "prompt_tokens_max": max(prompts)}


class UpdateProfiler:
    """Chosen updates of the train loop, each under a torch.profiler of its own. The loop makes one Clock at the start
    of every update (rlhf.trainers.loop.iterate), so a Clock made while `hooked` first closes the window of the update
    before it and, for a chosen update, opens the next: a window is a whole iteration, its metrics included, the
    device synchronised at both ends so that it holds all its kernels. The profiler's own start and stop, and the
    last update (which no Clock follows), fall outside every window."""

    def __init__(self, device, chosen: tuple[int, ...]):
        self.device, self.chosen, self.update = device, set(chosen), -1
        self.windows: list[tuple[object, float]] = []  # (the stopped profiler, the window's wall seconds)
        self.starts: list[float] = []  # when each update began (its Clock was made), perf_counter seconds
        self._open: tuple[object, float] | None = None

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def next_update(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.update += 1
        if self._open is not None:
            self._sync()
            prof, start = self._open
            self.windows.append((prof, time.perf_counter() - start))
            prof.stop()
            self._open = None
        if self.update in self.chosen:  # CUDA's activity only on a GPU: no per-op host hooks slowing the window
            kind = ProfilerActivity.CUDA if self.device.type == "cuda" else ProfilerActivity.CPU
            prof = profile(activities=[kind])
            prof.start()
            self._sync()
            self._open = (prof, time.perf_counter())
        self.starts.append(time.perf_counter())

    @contextlib.contextmanager
    def hooked(self):
        """rlhf.trainers.loop.Clock replaced by one that calls `next_update` first, inside the block."""
        from rlhf.trainers import loop

        base, profiler = loop.Clock, self

        class ProfiledClock(base):
            def __init__(self, *args, **kwargs):
                profiler.next_update()
                super().__init__(*args, **kwargs)

        loop.Clock = ProfiledClock
        try:
            yield
        finally:
            loop.Clock = base
            if self._open is not None:  # the run ended inside a window: not counted
                self._open[0].stop()
                self._open = None


def activity(prof, cuda: bool) -> tuple[float, int]:
    """(seconds busy, work items) of one profiler's trace. On a GPU the device's: every kernel, copy and fill, summed
    (one stream here, so nothing overlaps), and the kernels' count; on the CPU the ops' own time and the aten ops."""
    from torch.autograd import DeviceType

    events = prof.events()
    if cuda:
        device = [e for e in events if e.device_type == DeviceType.CUDA]
        kernels = sum(not e.name.startswith(("Memcpy", "Memset")) for e in device)
        return sum(e.time_range.elapsed_us() for e in device) / 1e6, kernels
    ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    return sum(e.self_cpu_time_total for e in ops) / 1e6, sum(e.name.startswith("aten::") for e in ops)


class Utilisation:
    """nvidia-smi's utilisation of the GPU (the share of its last sample period, 1/6 s to 1 s by product, in which a
    kernel ran) every 100 ms while the block runs, each sample stamped as it arrives: a coarse second reading of busy
    that needs no profiler. CUPTI may miss or mistime the kernels of CUDA graphs captured before a profiler first
    started (the static decode's, in the first update; pytorch/kineto#1165, fixed in CUDA 13.1's CUPTI): where the two
    disagree, this one has no such blind spot. Nothing on a box without nvidia-smi (the dry run)."""

    def __init__(self, device):
        self.device, self.samples, self._proc = device, [], None

    def __enter__(self):
        import os
        import shutil
        import subprocess
        import threading

        if self.device.type != "cuda" or not shutil.which("nvidia-smi"):
            return self
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        gpu = visible[self.device.index or 0] if visible else str(self.device.index or 0)
        cmd = ["nvidia-smi", "-i", gpu, "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-lms", "100"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.samples.append((time.perf_counter(), int(line) / 100))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()

    def mean(self, windows: list[tuple[float, float]]) -> float | None:
        """The mean of the samples that arrived within `windows` ((start, end) seconds); None without any."""
        inside = [u for t, u in self.samples if any(a <= t <= b for a, b in windows)]
        return round(sum(inside) / len(inside), 3) if inside else None


def step_figures(rows: list[dict], profiled: list[int]) -> dict:
    """From the train stage's rows: the first update's seconds, and the step's and each phase's mean seconds over the
    updates neither first (CUDA's warm-up, the static decode's compile) nor profiled."""
    clean = [r for i, r in enumerate(rows) if i and i not in profiled]
    mean = lambda k: round(sum(float(r[k]) for r in clean) / len(clean), 4)  # noqa: E731
    phases = [k for k in rows[0] if k.startswith("timing/") and k not in ("timing/elapsed", "timing/step")]
    figures = {"updates": len(rows), "first_s": round(float(rows[0]["timing/step"]), 3), "step_s": mean("timing/step")}
    return figures | {f"{k.removeprefix('timing/')}_s": mean(k) for k in phases}


def profiled_train(device, cli: list[str], profiled: list[int]) -> dict:
    """The train stage with the updates `profiled` under torch.profiler: `step_figures`, then over the profiled
    updates the device's busy share and kernels per update (on the CPU, the dry run: the ops' own time and aten ops
    per update), and nvidia-smi's busy over the others. The last window's busiest work goes to the log."""
    from rlhf.tracking import logged_rows

    cuda = device.type == "cuda"
    profiler = UpdateProfiler(device, tuple(profiled))
    with profiler.hooked(), Utilisation(device) as smi:
        stage(device, cli)
    if len(profiler.windows) != len(profiled):
        raise RuntimeError(f"profiled {len(profiler.windows)} of the updates {profiled}: one Clock per update no more?")
    figures = step_figures(logged_rows(data_dir(cli)), profiled)
    busy, work = zip(*(activity(prof, cuda) for prof, _ in profiler.windows))
    wall, n = sum(seconds for _, seconds in profiler.windows), len(profiler.windows)
    last = profiler.windows[-1][0].key_averages()
    print(last.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=20), flush=True)
    figures |= {"profiled_s": round(wall / n, 4), "busy": round(sum(busy) / wall, 3)}
    figures[("kernels_per_update" if cuda else "ops_per_update")] = round(sum(work) / n)
    unprofiled = [w for i, w in enumerate(zip(profiler.starts, profiler.starts[1:])) if i and i not in profiled]
    if (smi_busy := smi.mean(unprofiled)) is not None:
        figures["smi_busy"] = smi_busy  # over the updates not profiled: no profiler's overhead in them either
    return figures
