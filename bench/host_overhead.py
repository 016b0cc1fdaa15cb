"""The learner's host overhead, measured on the CPU the way a GPU would feel it: per update of PPO, RLOO and online
DPO on a deep, narrow model (Pythia-1B's 16 GPT-NeoX layers at width 64, where the arithmetic is negligible):

- syncs_per_update: device-to-host reads in the loop's own code (rlhf/, the engine's package aside): every `.item()`,
  `.tolist()`, `.cpu()`, `.numpy()` and tensor truth or number value (`bool`, `float`, `int`, an index). On a GPU
  each one waits for every kernel queued before it. Reads inside the libraries the loop calls are counted apart
  (`library_syncs_per_update`; most are torch's CPU AdamW reading its step counters, which a GPU's fused AdamW keeps
  on the device);
- overhead_share: the share of the loop's wall time not spent inside the models' own work (the forwards of the
  policy, value model, reference and reward model, the backward, the optimizer step with its gradient clipping):
  Python, the loop's own small ops, reads, copies. On a GPU that is host time in which no model kernel is queued.
  The gold judge's scoring (scikit-learn on the host, an instrument rather than training) is left out of both, as
  the engine's sampling is: a judge that costs more (the one that reads the prompt) must not look like less overhead.
  Where the loop decodes the responses for the judge alone, after the update is queued (`readback.gold_scores`; on a
  GPU the device is busy with the update meanwhile), the decoding is the judge's; before, it decoded every batch
  before the update, where a GPU waits, and that counts as the loop's;
- ops_per_update: the ATen ops the host dispatches (torch.profiler; each is at least one kernel launch on a GPU);
- the phases' seconds (rlhf.trainers.loop's Clock), the engine's generation apart.

The loop runs under the garbage collector's schedule `train()` uses (rlhf.runtime.scheduled_gc: no collection inside
the timed updates); one scheduled collection is timed apart (`gc_s_per_collection`, every train.gc_every batches).

Everything outside the engine's `receive` and the gold judge counts (steps 3-10 of rlhf.trainers.loop:
post-processing, scoring, reference, update, read-back, weight sync, log); the HF engine's generation is reported
apart (issue 56 item 3).

    .venv/bin/python -m rlhf.runtime python bench/host_overhead.py --label after

writes bench/metrics/host_overhead.json (the entry `--label` names, the others kept) and prints a table. One torch
thread; every trainer in the same process, after the same warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import ROOT, positive_int, run_main  # bench/, beside this script

TRAINERS = ("ppo", "rloo", "online_dpo")
# Pythia-1B's depth and layout, ci's vocabulary, a width where the math is negligible (head_dim 32)
DEEP_NARROW = (
    "model.architecture=gpt_neox",
    "model.num_layers=16",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.intermediate_size=256",
)
SHAPE = ("train.per_device_train_batch_size=4", "train.num_mini_batches=2", "train.response_length=8")  # 8 x 8
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
OUT = ROOT / "bench" / "metrics" / "host_overhead.json"
PHASES = [f"timing/{p}" for p in ("generation", "scoring", "reference", "update", "weight_sync", "step")]
PACKAGE = str(ROOT / "rlhf")
ENGINE_PACKAGE = str(ROOT / "rlhf" / "generation")


class ReadCounter:
    """Counts device-to-host reads by where they are called from: the loop's code (rlhf/ outside rlhf/generation),
    libraries, or the engine (anything while the engine's `receive` runs)."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()  # "file:line method" of the loop's own reads
        self.library_sites: Counter = Counter()  # of the reads in libraries the loop calls
        self.in_engine = False
        self.active = True  # counting; a caller may count only some spans (tests/test_trainers.py: iterations)

    @contextlib.contextmanager
    def installed(self):
        import torch

        saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, original in saved.items():
            setattr(torch.Tensor, name, self._counting(name, original))
        try:
            yield self
        finally:
            for name, original in saved.items():
                setattr(torch.Tensor, name, original)

    def _counting(self, name, original):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            where = caller.f_code.co_filename
            if not self.active:
                pass
            elif self.in_engine:
                self.counts["engine"] += 1
            elif caller.f_code.co_name == "host_list":  # refuses device tensors: never a sync
                self.counts["host"] += 1
            elif where.startswith(PACKAGE) and not where.startswith(ENGINE_PACKAGE):
                self.counts["loop"] += 1
                self.sites[f"{Path(where).relative_to(ROOT)}:{caller.f_lineno} {name}"] += 1
            else:
                self.counts["library"] += 1
                self.library_sites[f"{_short(where)}:{caller.f_lineno} {name}"] += 1
            return original(tensor, *args, **kwargs)

        return read


def _short(path: str) -> str:
    """A library file's path from its package on (".../site-packages/transformers/x.py" -> "transformers/x.py")."""
    return path.split("site-packages/")[-1]


def build_data(work: Path, extra: list[str]) -> Path:
    """The ci pipeline's inputs (prepare, gold, sft, reward) at the deep, narrow shape, in work/data."""
    from rlhf.cli import main as rlhf_main

    data = work / "data"
    for stage in ("prepare", "gold", "sft", "reward"):
        cli = ["--params", str(ROOT / "params.yaml"), "--profile", "ci", stage, f"data_dir={data}"]
        if rlhf_main([*cli, "tracking.wandb_mode=disabled", *DEEP_NARROW, *extra]) != 0:
            raise SystemExit(f"host_overhead.py: the {stage} stage failed (its error is above)")
    return data


class ModelTime:
    """Seconds inside the models' own work: their forwards (the outermost call: the policy, value model, reference
    and reward model), the backward and the optimizer step. The rest of the loop's time is its overhead: on a GPU,
    the host time in which no model kernel is queued. The engine's forwards (while it samples) are not counted."""

    def __init__(self, counter: ReadCounter):
        self.counter, self.seconds, self.depth, self.start = counter, 0.0, 0, 0.0

    def enter(self, *_) -> None:
        if self.depth == 0:
            self.start = time.perf_counter()
        self.depth += 1

    def exit(self, *_) -> None:
        self.depth -= 1
        if self.depth == 0 and not self.counter.in_engine:
            self.seconds += time.perf_counter() - self.start

    def watch(self, module) -> None:
        """Time `module`'s forwards, and those of its backbone and head, which scorers call directly."""
        for part in (module, getattr(module, "base_model", None), getattr(module, "score", None)):
            if part is not None:
                part.register_forward_pre_hook(self.enter)
                part.register_forward_hook(self.exit)

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.enter()
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, name, timed)


def measure(data: Path, trainer: str, args, extra: list[str]) -> dict:
    """One trainer: `warmup` unmeasured updates, `updates` timed ones (phases, model time, reads), then `profiled`
    ones under torch.profiler (ops dispatched; the profiler's own cost stays out of the timed updates)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rlhf.config import load_config
    from rlhf.tracking import Tracker
    from rlhf.trainers import loop
    from rlhf.trainers.checkpoint import LoopState
    from rlhf.trainers.setup import setup

    episodes = 8 * (args.warmup + args.updates + args.profiled)
    overrides = [f"data_dir={data}", "tracking.wandb_mode=disabled", f"train.trainer={trainer}", *DEEP_NARROW]
    overrides += [*SHAPE, f"train.total_episodes={episodes}", "train.save_every=0", *extra]
    cfg = load_config(ROOT / "params.yaml", "ci", overrides)
    run = setup(cfg)
    counter, state = ReadCounter(), LoopState()
    model_time = ModelTime(counter)
    tracker = Tracker(cfg, "train", enabled=True, rows=[], run_id=None)
    receive = run.engine.receive

    def engine_receive():
        counter.in_engine = True
        try:
            with record_function("engine.receive"):
                return receive()
        finally:
            counter.in_engine = False

    run.engine.receive = engine_receive
    for model in (run.model, run.ref, getattr(run.reward_fn, "model", None)):
        if isinstance(model, torch.nn.Module):
            model_time.watch(model)
    model_time.wrap(run.acc, "backward")
    # gradient clipping is the optimizer's work (DeepSpeed clips inside its step; a GPU does it in a few foreach
    # kernels), not the loop's: on the CPU torch clips parameter by parameter, ~8 ms a PPO update here
    model_time.wrap(loop, "_clip_gradients")
    judge_time = ModelTime(counter)  # the gold judge: timed apart and left out (module docstring)
    if run.gold is not None:
        judge_time.wrap(*_gold_call(run))
    for name in ("step", "zero_grad"):
        model_time.wrap(run.optimizer, name)
    phases: Counter = Counter()
    engine_s = 0.0

    def iteration(t: int, timed: bool = True) -> None:
        nonlocal engine_s
        row = loop.iterate(run, tracker, state, t)
        if timed:
            phases.update({k.removeprefix("timing/"): row[k] for k in PHASES})
            engine_s += row["timing/generation"]

    with contextlib.closing(run.engine), _gc_schedule(cfg):
        for t in range(args.warmup):
            iteration(t, timed=False)
        model_time.seconds = judge_time.seconds = 0.0
        timed = range(args.warmup, args.warmup + args.updates)
        with counter.installed():
            start = time.perf_counter()
            for t in timed:
                iteration(t)
            wall = time.perf_counter() - start
        learner_s, model_s = wall - engine_s - judge_time.seconds, model_time.seconds
        # the loop's scheduled collection (every train.gc_every batches, none in the timed ones): its cost, apart
        gc_start = time.perf_counter()
        gc.collect(1)
        gc_s = time.perf_counter() - gc_start
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for t in range(timed.stop, timed.stop + args.profiled):
                iteration(t, timed=False)
    n = args.updates
    return {
        "updates": n,
        "syncs_per_update": counter.counts["loop"] / n,
        "library_syncs_per_update": counter.counts["library"] / n,
        "host_reads_per_update": counter.counts["host"] / n,
        **dispatched(prof, args.profiled),
        "overhead_share": round(1 - model_s / learner_s, 4),
        "learner_s_per_update": round(learner_s / n, 4),
        "model_s_per_update": round(model_s / n, 4),
        "phases_s_per_update": {k: round(v / n, 4) for k, v in sorted(phases.items())},
        "gc_s_per_collection": round(gc_s, 5),
        "engine_syncs_per_generation": counter.counts["engine"] / n,
        "sync_sites": dict(sorted(counter.sites.items())),
        "library_sync_sites": dict(counter.library_sites.most_common(8)),
    }


def _gc_schedule(cfg):
    """The garbage collector's schedule `train()` runs the loop under (rlhf.runtime.scheduled_gc: off inside steps,
    a collection every train.gc_every batches), where the code has one; the code before issue 56 had none."""
    from rlhf import runtime

    schedule = getattr(runtime, "scheduled_gc", None)
    return contextlib.nullcontext() if schedule is None else schedule(cfg.train.gc_every)


def _gold_call(run) -> tuple:
    """(owner, name) of the loop's call of the gold judge: with its decoding of the responses where the loop decodes
    for the judge alone, after the update is queued (readback.gold_scores); the judge's own call before that."""
    try:
        from rlhf.trainers import readback
    except ImportError:  # the code before issue 56
        return run, "gold"
    return (readback, "gold_scores") if hasattr(readback, "gold_scores") else (run, "gold")


def dispatched(prof, updates: int) -> dict:
    """Ops the host dispatched per update (ATen calls not made by another ATen op: from Python or autograd), outside
    the engine's `receive` and in it."""
    ops, engine_ops = 0, 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, in_engine, top = event.cpu_parent, False, True
        while parent is not None:
            in_engine |= parent.name == "engine.receive"
            top &= not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if top:
            engine_ops, ops = (engine_ops + 1, ops) if in_engine else (engine_ops, ops + 1)
    return {"ops_per_update": round(ops / updates), "engine_ops_per_generation": round(engine_ops / updates)}


def cpu_flags() -> str:
    """The CPU's vector extensions that decide its kernels (benchmark tables name them)."""
    try:
        flags = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")).split()
    except (OSError, StopIteration):
        return platform.processor()
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "no avx2"


def git_commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def table(entry: dict) -> str:
    head = f"{'trainer':<11} {'syncs':>6} {'lib':>5} {'ops':>6} {'overhead':>9} {'learner s':>10} {'model s':>8}"
    lines = [head + "  phases (s/update)"]
    for trainer, r in entry["trainers"].items():
        phases = " ".join(f"{k}={v:.3f}" for k, v in r["phases_s_per_update"].items())
        lines.append(
            f"{trainer:<11} {r['syncs_per_update']:>6.1f} {r['library_syncs_per_update']:>5.1f} "
            f"{r['ops_per_update']:>6} {r['overhead_share']:>9.3f} {r['learner_s_per_update']:>10.3f} "
            f"{r['model_s_per_update']:>8.3f}  {phases}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="after", help="the JSON entry to write (e.g. before, after)")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated, of " + ", ".join(TRAINERS))
    ap.add_argument("--warmup", type=positive_int, default=2, help="unmeasured updates first (default 2)")
    ap.add_argument("--updates", type=positive_int, default=4, help="timed updates (default 4)")
    ap.add_argument("--profiled", type=positive_int, default=2, help="updates under torch.profiler (default 2)")
    ap.add_argument("--out", default=str(OUT), help="the JSON file (default bench/metrics/host_overhead.json)")
    ap.add_argument("--data", help="a data_dir from an earlier run of this script (skips building it)")
    ap.add_argument("settings", nargs="*", help="extra settings for every stage, e.g. train.mixed_precision=bf16")
    args = ap.parse_args()
    trainers = [t for t in args.trainers.split(",") if t]
    if unknown := sorted(set(trainers) - set(TRAINERS)):
        ap.error(f"--trainers: unknown {unknown}; choose among {list(TRAINERS)}")
    import torch

    torch.set_num_threads(1)  # one thread: the host's cost per op, not the cores' parallelism
    with tempfile.TemporaryDirectory(prefix="host-overhead-") as work:
        data = Path(args.data) if args.data else build_data(Path(work), args.settings)
        results = {t: measure(data, t, args, args.settings) for t in trainers}
    entry = {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_flags(),
        "torch": torch.__version__,
        "shape": [*DEEP_NARROW, *SHAPE, *args.settings],
        "trainers": results,
    }
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else {}
    from rlhf.io import write_text

    write_text(out, json.dumps({**previous, args.label: entry}, indent=1) + "\n")
    print(table(entry))
    print(f"host_overhead.py: wrote {out} [{args.label}]")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
