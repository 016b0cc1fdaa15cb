"""In-flight weight updates against batch-level async and the best sync run (issue 58 item 4): online DPO on `tiny`.

Runs, each `rlhf train` in a process of its own (async_vs_sync.stage_train: one torch thread a process, the engine
process pinned to a core of its own), 2 seeds (the pipeline's data, SFT and reward model; `seed=S` for the run):
  sync_hf, sync_hf_2t       HF generate with 1 and 2 torch threads; the faster by the wall clock is "best sync"
                            (first seed; the other seed runs that one only)
  batch_n1, batch_n2        train.engine vllm_async, max_staleness 1 / 2, weights between batches
  in_flight_n1, _n2         the same with train.weight_updates in_flight, at decode step K
in two regimes:
  tiny        as `make run` trains it (k = 2: the learner is the longer side on 2 cores)
  k8          train.k=8: eight samples a prompt, still one pair trained on each, so the engine's share grows
  gen         k8 with train.score_in_engine=always: the engine also scores its samples and computes their reference
              log-probs, the learner only trains: the engine is clearly the longer side (added after k8's runs, below)
K per regime, by a rule fixed before the runs: round(T x L / G), clipped to [1, T], with T = train.response_length
and L, G the learner's and the engine's seconds a batch (timing/step minus timing/wait, and timing/generation) in
that regime's batch_n1 run of the first seed: the step at which the engine, started with the learner, reaches the
swap as the learner's new weights arrive.

Per run: wall seconds, loop seconds, steady loop seconds (the engine's start-up wait left out), the learner's wait
for the engine after the first batch, the engine's idle seconds, mean token staleness (async/token_staleness_mean,
averaged over the batches after the first N), final gold of the policy's samples on the eval prompts, and time to
quality (async_vs_sync's rule, against the regime's best sync).

Rules, fixed before any point ran (the commit that adds this file):
  R1 (k8): in_flight_n1's mean token staleness is below batch_n1's (1.0), and its steady loop seconds, mean over the
      two seeds, are at most 1.05 x batch_n1's: fresher tokens at no worse wall clock where the engine is the longer
      side.
  R2 (each regime): in_flight_n2's mean token staleness is below batch_n2's (2.0), with steady loop seconds at most
      1.05 x batch_n2's.
  R3 (gen; fixed in the commit that adds the regime, before any of its runs, after tiny's and k8's): R1's test on
      `gen`: in_flight_n1's mean token staleness below batch_n1's and its steady loop seconds, mean over the two
      seeds, at most 1.05 x batch_n1's. (R2 applies to `gen` too.)
  Expected, not a rule: in `tiny`, in_flight_n1 is slower than batch_n1 (the learner waits for the steps after the
  swap, which only the longer side can hide), unless K = T (no swap: batch_n1 itself).
Writes bench/metrics/inflight.json (`<regime>/<run>/seed<i>/<metric>`, the summary and the rules' outcomes; a DVC
metrics file) and prints a table per regime.

    .venv/bin/python -m rlhf.runtime python bench/inflight.py [--regimes tiny,k8] [--seeds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from async_vs_sync import eval_gold, gold_curve, quality_level, seconds_to, stage_train  # bench/ is sys.path[0]
from common import column_sum, cpu_flags, positive_int, run_main, scratch_data

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "metrics" / "inflight.json"
REGIMES = {"tiny": (), "k8": ("train.k=8",), "gen": ("train.k=8", "train.score_in_engine=always")}
ASYNC = ("train.engine=vllm_async",)
IN_FLIGHT = "train.weight_updates=in_flight"
RUNS = {  # name -> (settings, torch threads)
    "sync_hf": ((), 1),
    "sync_hf_2t": ((), 2),
    "batch_n1": ((*ASYNC, "train.max_staleness=1"), 1),
    "batch_n2": ((*ASYNC, "train.max_staleness=2"), 1),
    "in_flight_n1": ((*ASYNC, "train.max_staleness=1", IN_FLIGHT), 1),
    "in_flight_n2": ((*ASYNC, "train.max_staleness=2", IN_FLIGHT), 1),
}
SYNC = ("sync_hf", "sync_hf_2t")
SLACK = 1.05  # the wall-clock tolerance of the rules


def swap_step(batch_n1: dict, response_length: int) -> int:
    """K: round(T x L / G) in [1, T] from batch_n1's learner and engine seconds a batch (the module's rule)."""
    return min(response_length, max(1, round(response_length * batch_n1["learner_s"] / batch_n1["generation_s"])))


def run_one(regime: str, name: str, seed: int, step: int | None) -> dict:
    """One `rlhf train` run and its figures (module docstring)."""
    from rlhf.config import load_config

    settings, threads = RUNS[name]
    data = scratch_data(ROOT / "bench" / "out" / "inflight" / regime / name / "data")
    overrides = [f"data_dir={data}", "train.trainer=online_dpo", "tracking.wandb_mode=disabled", f"seed={seed}"]
    overrides += [*REGIMES[regime], *settings] + ([f"train.in_flight_step={step}"] if IN_FLIGHT in settings else [])
    cfg = load_config(ROOT / "params.yaml", "tiny", overrides)
    wall, cpu, rows = stage_train(cfg, overrides, "tiny", threads=threads)
    n = cfg.train.max_staleness if ASYNC[0] in settings else 0  # the first N batches: sampled by version 0
    first_wait = float(rows[0].get("timing/wait") or 0)
    loop = column_sum(rows, "timing/step")
    wait = column_sum(rows, "timing/wait")
    stale = [float(r["async/token_staleness_mean"]) for r in rows[n:] if r.get("async/token_staleness_mean")]
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "loop_s": loop,
        "steady_loop_s": loop - first_wait,
        "learner_wait_s": wait - first_wait,
        "engine_idle_s": column_sum(rows, "timing/engine_idle"),
        "generation_s": column_sum(rows, "timing/generation") / len(rows),
        "learner_s": (loop - wait) / len(rows),
        "token_staleness_mean": statistics.mean(stale) if stale else 0.0,
        "final_gold": eval_gold(cfg),
        "curve": gold_curve(rows),
    }
    print(
        f"{regime} seed {seed} {name}: steady loop {result['steady_loop_s']:.1f} s, staleness "
        f"{result['token_staleness_mean']:.3f}, gold {result['final_gold']:.3f}",
        flush=True,
    )
    return result


def run_regime(regime: str, seeds: list[int]) -> dict:
    """Every run of one regime: the first seed's all, then the other seeds' best sync and async runs."""
    from rlhf.config import load_config

    T = load_config(ROOT / "params.yaml", "tiny", list(REGIMES[regime])).train.response_length
    results: dict[str, list[dict]] = {}
    for i, seed in enumerate(seeds):
        names = list(RUNS) if i == 0 else [best_sync(results), *[n for n in RUNS if n not in SYNC]]
        for name in names:
            step = swap_step(results["batch_n1"][0], T) if "in_flight" in name else None
            results.setdefault(name, []).append(run_one(regime, name, seed, step))
    best = best_sync(results)
    level = quality_level(results[best][0])
    for runs in results.values():
        for r in runs:
            reached = seconds_to(level, r.pop("curve"))
            r["seconds_to_quality"] = reached if reached != float("inf") else -1.0  # -1: never (JSON)
    return {"swap_step": swap_step(results["batch_n1"][0], T), "best_sync": best, "runs": results}


def best_sync(results: dict[str, list[dict]]) -> str:
    return min((n for n in SYNC if n in results), key=lambda n: results[n][0]["wall_s"])


def mean(results: dict, name: str, key: str) -> float:
    return statistics.mean(r[key] for r in results["runs"][name])


def verdict(results: dict, fresh: str, batch: str) -> dict:
    """A rule: `fresh` (in flight) staler-less than `batch` and its steady loop within SLACK of it, means over seeds."""
    staleness = mean(results, fresh, "token_staleness_mean"), mean(results, batch, "token_staleness_mean")
    loops = mean(results, fresh, "steady_loop_s"), mean(results, batch, "steady_loop_s")
    return {
        "token_staleness": staleness,
        "steady_loop_s": loops,
        "loop_ratio": loops[0] / loops[1],
        "passes": staleness[0] < staleness[1] and loops[0] <= SLACK * loops[1],
    }


def table(regime: str, results: dict) -> str:
    keys = ("wall_s", "steady_loop_s", "learner_wait_s", "engine_idle_s", "token_staleness_mean", "final_gold")
    lines = [f"{regime}: K = {results['swap_step']}, best sync {results['best_sync']} (means over seeds)"]
    lines.append(f"{'run':<14}" + "".join(f"{k:>22}" for k in keys))
    for name in results["runs"]:
        lines.append(f"{name:<14}" + "".join(f"{mean(results, name, k):>22.3f}" for k in keys))
    return "\n".join(lines)


def main() -> int:
    from rlhf.io import write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--regimes", default=",".join(REGIMES), help=f"comma-separated, of {', '.join(REGIMES)}")
    ap.add_argument("--seeds", type=positive_int, default=2, help="seeds per run (1234, 1235, ...)")
    args = ap.parse_args()
    regimes = [r for r in args.regimes.split(",") if r]
    if unknown := sorted(set(regimes) - set(REGIMES)):
        ap.error(f"--regimes: unknown {unknown}; choose among {list(REGIMES)}")
    seeds = [1234 + i for i in range(args.seeds)]
    # the regimes run now replace theirs in the file; the others' stay (run at other times: their own cpu_flags)
    previous = json.loads(OUT.read_text()) if OUT.exists() else {}
    out = {k: v for k, v in previous.items() if k.split("/")[0] not in regimes}
    out.update({"cpu_flags": cpu_flags(), "seeds": seeds})
    for regime in regimes:
        results = {**run_regime(regime, seeds), "cpu_flags": cpu_flags()}
        print(table(regime, results))
        out[regime] = results
        out[f"{regime}/R2_in_flight_n2_vs_batch_n2"] = verdict(results, "in_flight_n2", "batch_n2")
        if regime in ("k8", "gen"):
            rule = "R1" if regime == "k8" else "R3"
            out[f"{regime}/{rule}_in_flight_n1_vs_batch_n1"] = verdict(results, "in_flight_n1", "batch_n1")
    for key, value in out.items():
        if key.endswith(("_n1", "_n2")):
            print(f"{key}: {'PASSES' if value['passes'] else 'FAILS'} {value}")
    write_json(OUT, out)
    print(f"inflight.py: wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
