"""The learner's host overhead, measured on the CPU the way a GPU would feel it: per update of PPO, RLOO and online
DPO on a deep, narrow model (Pythia-1B's 16 GPT-NeoX layers at width 64, where the arithmetic is negligible), the
loop's time by phase, the share of it not spent inside ATen's ops (torch.profiler), the ops the host dispatches,
and its device-to-host reads: every `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and tensor truth or number value
(`bool`, `float`, `int`, an index) taken in the loop's own code (rlhf/, the engine's package aside). On a GPU each
read waits for every kernel queued before it; each dispatched op costs the host its launch.

Everything outside the engine's `receive` counts (steps 3-9 of rlhf.trainers.loop: post-processing, scoring,
reference, update, weight sync, log); the HF engine's generation is reported apart (issue 56 item 3). Reads inside
libraries the loop calls (transformers, accelerate, torch) are counted apart too: `library_syncs_per_update`.

    .venv/bin/python -m rlhf.runtime python bench/host_overhead.py --label after

writes bench/metrics/host_overhead.json (the entry `--label` names, the others kept) and prints a table. The
profiler's own host cost is in the wall time: shares are comparable between runs of this script, not absolute.
"""

from __future__ import annotations

import argparse
import contextlib
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
            if self.in_engine:
                self.counts["engine"] += 1
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


def measure(data: Path, trainer: str, warmup: int, updates: int, extra: list[str]) -> dict:
    """One trainer's updates, after `warmup` unmeasured ones: phases (s per update), ops, reads, overhead share."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rlhf.config import load_config
    from rlhf.tracking import Tracker
    from rlhf.trainers import loop
    from rlhf.trainers.checkpoint import LoopState
    from rlhf.trainers.setup import setup

    episodes = 8 * (warmup + updates)
    overrides = [f"data_dir={data}", "tracking.wandb_mode=disabled", f"train.trainer={trainer}", *DEEP_NARROW]
    overrides += [*SHAPE, f"train.total_episodes={episodes}", "train.save_every=0", *extra]
    cfg = load_config(ROOT / "params.yaml", "ci", overrides)
    run = setup(cfg)
    counter, state = ReadCounter(), LoopState()
    tracker = Tracker(cfg, "train", enabled=True, rows=[], run_id=None)
    receive = run.engine.receive

    def timed_receive():
        counter.in_engine = True
        try:
            with record_function("engine.receive"):
                return receive()
        finally:
            counter.in_engine = False

    run.engine.receive = timed_receive
    phases: Counter = Counter()

    def iteration(t: int) -> None:
        clock = loop.Clock(run.acc.device)
        collected = loop.collect(run, t, clock)
        stats = loop.update(run, collected.groups, t, state)
        clock.mark("update")
        loop.sync(run, state, t)
        clock.mark("weight_sync")
        start = time.perf_counter()
        loop.log(run, tracker, state, t, collected, stats, clock)
        if t >= warmup:
            phases.update({**clock.seconds, "log": time.perf_counter() - start, "generation": collected.gen.seconds})
            phases["wait"] -= collected.gen.seconds  # the HF engine samples inside `wait`: the rest is the loop's

    with contextlib.closing(run.engine):
        for t in range(warmup):
            iteration(t)
        with counter.installed(), profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for t in range(warmup, warmup + updates):
                iteration(t)
            wall = time.perf_counter() - start
    return summarise(prof, counter, phases, wall, updates)


def summarise(prof, counter: ReadCounter, phases: Counter, wall: float, updates: int) -> dict:
    """Per update: ops dispatched (ATen calls not made by another ATen op), the ops' own time against the wall time
    outside the engine (the rest is the host's: Python, modules, dispatch around the ops), reads by caller."""
    engine_s, own_s, ops, engine_ops = 0.0, 0.0, 0, 0
    for event in prof.events():
        if event.name == "engine.receive":
            engine_s += event.cpu_time_total / 1e6
        if not event.name.startswith("aten::"):
            continue
        parent, in_engine, top = event.cpu_parent, False, True
        while parent is not None:
            in_engine |= parent.name == "engine.receive"
            top &= not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if in_engine:
            engine_ops += top
        else:
            ops += top
            own_s += event.self_cpu_time_total / 1e6
    learner_s = wall - engine_s
    return {
        "updates": updates,
        "syncs_per_update": counter.counts["loop"] / updates,
        "library_syncs_per_update": counter.counts["library"] / updates,
        "ops_per_update": round(ops / updates),
        "overhead_share": round(1 - own_s / learner_s, 4),
        "learner_s_per_update": round(learner_s / updates, 4),
        "phases_s_per_update": {k: round(v / updates, 4) for k, v in sorted(phases.items())},
        "engine": {
            "syncs_per_generation": counter.counts["engine"] / updates,
            "ops_per_generation": round(engine_ops / updates),
        },
        "sync_sites": dict(sorted(counter.sites.items())),
        "library_sync_sites": dict(counter.library_sites.most_common(8)),
    }


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
    lines = [f"{'trainer':<11} {'syncs':>6} {'lib':>5} {'ops':>6} {'overhead':>9} {'learner s':>10}  phases (s/update)"]
    for trainer, r in entry["trainers"].items():
        phases = " ".join(f"{k}={v:.3f}" for k, v in r["phases_s_per_update"].items())
        lines.append(
            f"{trainer:<11} {r['syncs_per_update']:>6.1f} {r['library_syncs_per_update']:>5.1f} "
            f"{r['ops_per_update']:>6} {r['overhead_share']:>9.3f} {r['learner_s_per_update']:>10.3f}  {phases}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="after", help="the JSON entry to write (e.g. before, after)")
    ap.add_argument("--trainers", default=",".join(TRAINERS), help="comma-separated, of " + ", ".join(TRAINERS))
    ap.add_argument("--warmup", type=positive_int, default=2, help="unmeasured updates first (default 2)")
    ap.add_argument("--updates", type=positive_int, default=4, help="measured updates (default 4)")
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
        results = {t: measure(data, t, args.warmup, args.updates, args.settings) for t in trainers}
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
