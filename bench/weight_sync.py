"""Weight sync's share of a training step on SmolLM2-135M, colocated and async vLLM (issue 15's measurement).

Usage:
    .venv/bin/python -m rlhf.runtime python bench/weight_sync.py [--episodes 48] [--label after] [key=value ...]
Runs online DPO with the colocated engine (online_dpo_single_vllm), the async one (online_dpo_vllm) and the async
one as a Ray actor (train.engine_backend=ray: the weights go through Ray's object store) on the `smollm2` profile
(data built once under .cache/bench/smollm2-data, see common.smollm2_data) and prints, per engine, the mean seconds
per generated batch of the step and of the weight sync on the learner's critical path (`timing/weight_sync`, the
loop's step 8: colocated = gather + reload into vLLM; async = the copy handed to the engine process; Ray = that copy
put into the object store), with the engine's own reload (`timing/weight_sync_engine`, overlapped with training).
Batch 0 is left out (start-up). Run it at two commits for before/after: it only uses the loop's public metrics.
Writes bench/metrics/weight_sync_<label>.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from common import (
    ROOT,
    cpu_flags,
    positive_int,
    run_main,
    scratch_data,
    smollm2_data,
    timed_train,
)  # bench/ is sys.path[0]

ENGINES = {
    "colocated": ("online_dpo_single_vllm", ()),
    "async": ("online_dpo_vllm", ()),
    "async_ray": ("online_dpo_vllm", ("train.engine_backend=ray",)),
}


def run(trainer: str, episodes: int, overrides: list[str]) -> dict:
    from accelerate.state import AcceleratorState

    from rlhf.config import load_config

    AcceleratorState._reset_state(reset_partial_state=True)  # one process, several runs: a fresh accelerate state
    data = scratch_data(ROOT / "bench" / "out" / f"weight-sync-{trainer}", source=smollm2_data())
    settings = [f"data_dir={data}", "tracking.wandb_mode=disabled", f"train.trainer={trainer}"]
    cfg = load_config(ROOT / "params.yaml", "smollm2", [*settings, f"train.total_episodes={episodes}", *overrides])
    _, rows = timed_train(cfg)
    rows = rows[1:]
    mean = lambda key: statistics.mean(float(r.get(key) or 0) for r in rows)  # noqa: E731
    step, sync = mean("timing/step"), mean("timing/weight_sync")
    return {
        "step_seconds": step,
        "weight_sync_seconds": sync,
        "weight_sync_share": sync / step,
        "weight_sync_max_seconds": max(float(r["timing/weight_sync"]) for r in rows),
        "engine_reload_seconds": mean("timing/weight_sync_engine"),
        "batches": len(rows),
    }


def main() -> None:
    from rlhf import runtime
    from rlhf.io import write_json

    runtime.configure()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=positive_int, default=48, help="6 generated batches of 8 prompts")
    ap.add_argument("--label", default="after", help="names the metrics file (e.g. before / after)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    chosen = args.engines.split(",")
    if unknown := sorted(set(chosen) - set(ENGINES)):
        ap.error(f"--engines: unknown {unknown}; choose among {', '.join(ENGINES)}")
    results = {n: run(ENGINES[n][0], args.episodes, [*ENGINES[n][1], *args.overrides]) for n in chosen}
    print(f"\nsmollm2, online DPO, {args.episodes} episodes, commit {commit.stdout.strip()} ({args.label}, work tree")
    print(f"as checked out); one torch thread per process; CPU flags: {cpu_flags()}; batch 0 left out")
    print(f"{'engine':<11}{'step s':>8}{'sync s':>8}{'share':>8}{'max sync s':>12}{'engine reload s':>17}")
    for name, r in results.items():
        print(
            f"{name:<11}{r['step_seconds']:>8.2f}{r['weight_sync_seconds']:>8.2f}{r['weight_sync_share']:>8.1%}"
            f"{r['weight_sync_max_seconds']:>12.2f}{r['engine_reload_seconds']:>17.2f}"
        )
    metrics = {f"{e}/{k}": v for e, r in results.items() for k, v in r.items()}
    metrics.update({"cpu_flags": cpu_flags(), "episodes": args.episodes, "commit": commit.stdout.strip()})
    write_json(ROOT / "bench" / "metrics" / f"weight_sync_{args.label}.json", metrics)


if __name__ == "__main__":
    sys.exit(run_main(main))
