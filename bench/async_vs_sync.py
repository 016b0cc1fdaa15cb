"""Online DPO on the same episodes: sync HF generate and vLLM colocated (each with 1 and with 2 torch threads: a sync
run has the cores to itself; every sync run runs with the first seed, and the fastest of them by the wall clock is
the baseline, the one sync run of the other seeds), vLLM asynchronous (N=1; the learner and the engine process one
thread each) in an engine process,
the same as E = 1 and E = 2 Ray actors (train.engine_backend: ray; the Ray overhead is E = 1 against the engine
process, in the same invocation), and async with 2 training processes sharing the engine (accelerate launch, ZeRO-2;
on a 2-core CPU box 3 processes share 2 cores, so it is slower than 1 rank: the row shows that the paper's layout runs
and where its time goes).

Needs the pipeline's prepare/gold/sft/reward outputs (`make run` or `dvc repro reward`; --profile smollm2: its own,
built once under .cache/bench/smollm2-data, see common.smollm2_data). Usage:
    .venv/bin/python -m rlhf.runtime python bench/async_vs_sync.py [--profile tiny] [--seeds 3] [--runs a,b]
        [--label L] [seed=S (the first seed)] [key=value ...]
Each run is `rlhf train` in a process of its own, as the train stage runs: "wall" is its wall clock (imports,
model loading, engine start-up and saving included), "loop" its iterations, "1st wait" the learner waiting for the
first batch (the async engine starting up) and "steady" the loop without that wait. Prints these, episodes/s, the
per-step time breakdown and final gold score for each, the speedups (loop, steady, wall) and the ideal overlap of
the sync run, and writes them to bench/metrics/async_vs_sync[_<profile>][_<label>].json (a DVC metrics file), per
seed too. Gold is the trained policy's samples on the eval prompts, drawn by the profile's `eval.engine`. Gold
differences between two runs of 1,024 episodes are a few points from sampling alone, so sync and async run with
several seeds (the colocated run with the first) and the gold gap is a mean over seeds, with its standard error.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import column_sum, positive_int, run_main, scratch_data, smollm2_data  # bench/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
RAY = ("train.engine_backend=ray",)
# run name -> (train.trainer, settings); a sync run alone on the box may use every core: each runs with one torch
# thread and with two (`_2t`), all with the first seed; the fastest by the wall clock is the baseline ("best sync")
RUNS = {
    "sync_hf": ("online_dpo", ()),
    "sync_hf_2t": ("online_dpo", ()),
    "vllm_colocated": ("online_dpo_single_vllm", ()),
    "vllm_colocated_2t": ("online_dpo_single_vllm", ()),
    "vllm_async": ("online_dpo_vllm", ()),
    "vllm_async_first": ("online_dpo_vllm", ()),  # + train.learner_first_batches (learner_first_batches below)
    "vllm_async_ray1": ("online_dpo_vllm", (*RAY, "train.num_engines=1")),
    "vllm_async_ray2": ("online_dpo_vllm", (*RAY, "train.num_engines=2")),
}
SYNC = ("sync_hf", "sync_hf_2t", "vllm_colocated", "vllm_colocated_2t")
TWO_RANKS = {"vllm_async_2ranks": ("online_dpo_vllm", ())}  # under accelerate launch --num_processes 2
# the logged timing/* columns (data/timing/train.csv) summed over the run; wait: the learner waiting for the engine
# (async only); scoring_engine: scores and reference log-probs computed in the engine process (overlapped)
BREAKDOWN = ("scoring", "reference", "update", "weight_sync", "wait", "scoring_engine", "engine_idle")


def eval_gold(cfg) -> float:
    """Mean gold score of the trained policy's samples (train temperature) on the eval prompts (all of them)."""
    from rlhf import runtime
    from rlhf.data.schemas import EvalPrompts
    from rlhf.data.splits import load_split
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.sampling import sample, stage_engine
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.gold import GoldJudge

    torch.manual_seed(cfg.seed)
    prompts = list(load_split(cfg.path("prepared"), "eval_prompts", EvalPrompts)["prompt"])
    folder, length = cfg.path("train", "policy"), cfg.train.response_length
    params = SamplingParams(k=1, max_new_tokens=length, temperature=cfg.train.temperature)
    device, tokenizer = runtime.device(), load_tokenizer(folder)
    with stage_engine(cfg.eval.engine, folder, tokenizer, prompts, length, device, cfg.seed) as engine:
        policy = load_causal_lm(folder).to(device) if engine is None else None
        texts = [t for s in sample(policy, tokenizer, prompts, params, 64, device, engine=engine) for t in s.texts]
    return float(GoldJudge.load(cfg.path("gold")).score(prompts, texts).mean())  # k=1: one response a prompt


def main() -> None:
    from rlhf import runtime
    from rlhf.config import load_config

    runtime.configure()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--seeds", type=positive_int, default=3, help="sync and async runs per seed (seed, seed+1, ...)")
    ap.add_argument(
        "--runs",
        default=",".join({**RUNS, **TWO_RANKS}),
        help="which runs, comma-separated (default: all); the sync baseline is sync_hf if chosen, else vllm_colocated",
    )
    ap.add_argument(
        "--first-batches",
        type=positive_int,
        dest="first_batches",
        help="vllm_async_first's train.learner_first_batches, fixed by hand (default: by the rule of "
        "learner_first_batches, from this invocation's sync_hf and vllm_async runs)",
    )
    ap.add_argument(
        "--label",
        default="",
        help="a run under other conditions or of part of the runs writes async_vs_sync[_<profile>]_<label>.json, "
        "leaving the full run's file as it was",
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    chosen = args.runs.split(",")
    unknown = sorted(set(chosen) - {*RUNS, *TWO_RANKS})
    if unknown or "vllm_async" not in chosen or not set(SYNC) & set(chosen):
        ap.error(f"--runs: {args.runs!r}: needs vllm_async and a sync run among {[*RUNS, *TWO_RANKS]}")
    if "vllm_async_first" in chosen and not args.first_batches and "sync_hf" not in chosen:
        ap.error(f"--runs: {args.runs!r}: vllm_async_first needs sync_hf, or --first-batches")
    first, args.overrides = split_seed(args.overrides)
    base = first if first is not None else load_config(ROOT / "params.yaml", args.profile, args.overrides).seed
    runs = {k: v for k, v in {**RUNS, **TWO_RANKS}.items() if k in chosen}
    per_seed = [run_all(args, base, runs)]
    # the other seeds: the first seed's fastest sync run by the wall clock (the baseline) and async
    best = min((n for n in per_seed[0] if n in SYNC), key=lambda n: per_seed[0][n]["wall_seconds"])
    later = {k: v for k, v in runs.items() if k in (best, "vllm_async", "vllm_async_first")}
    per_seed += [run_all(args, base + i, later) for i in range(1, args.seeds)]
    summarise(args, per_seed)


def split_seed(overrides: list[str]) -> tuple[int | None, list[str]]:
    """(the first seed, if a `seed=S` override asks for one; the other overrides). Every run sets its own seed, and
    the overrides come after it: passed on, a seed override made every seed the same run (seen: seeds "1236" and
    "1237" gave identical results). train.seed, which training reads before seed, is refused for the same reason."""
    seeds = [o for o in overrides if o.split("=", 1)[0] in ("seed", "train.seed")]
    if any(o.startswith("train.seed=") for o in seeds):
        raise SystemExit(
            "train.seed: each run sets its own seed; choose the first with seed=S and how many with --seeds"
        )
    first = int(seeds[-1].split("=", 1)[1]) if seeds else None
    return first, [o for o in overrides if o not in seeds]


def run_all(args, seed: int, runs: dict[str, str]) -> dict[str, dict]:
    from rlhf.config import load_config

    results = {}
    source = smollm2_data() if args.profile == "smollm2" else None  # else the pipeline's data/ (make run)
    for name, (trainer, extra) in runs.items():
        if name == "vllm_async_first":  # the first seed's rule, kept for the others
            args.first_batches = args.first_batches or learner_first_batches(results)
            extra = (*extra, f"train.learner_first_batches={args.first_batches}")
        data = scratch_data(ROOT / "bench" / "out" / name / "data", source=source)
        settings = [f"data_dir={data}", f"train.trainer={trainer}", "tracking.wandb_mode=disabled", f"seed={seed}"]
        settings += extra
        cfg = load_config(ROOT / "params.yaml", args.profile, [*settings, *args.overrides])
        settings += args.overrides
        threads = 2 if name.endswith("_2t") else 1
        processes = 2 if name in TWO_RANKS else 1
        wall, cpu, rows = stage_train(cfg, settings, args.profile, processes=processes, threads=threads)
        loop = column_sum(rows, "timing/step")
        first_wait = float(rows[cfg.train.learner_first_batches].get("timing/wait") or 0)  # the engine's first
        results[name] = {
            "wall_seconds": wall,  # `rlhf train` by the wall clock: imports, model loading, engine start-up, saving
            "cpu_seconds": cpu,  # CPU time of the run's processes: the cores cannot do it in less than cpu / cores
            "loop_seconds": loop,  # the iterations only
            "first_wait_seconds": first_wait,  # the learner waiting for the engine to start (async)
            "steady_loop_seconds": loop - first_wait,  # the iterations, engine start-up left out
            "episodes_per_second": cfg.train.total_episodes / loop,
            "generation_seconds": column_sum(rows, "timing/generation"),
            "learner_seconds": loop
            - (column_sum(rows, "timing/wait") if "async" in name else column_sum(rows, "timing/generation")),
            **{f"{part}_seconds": column_sum(rows, f"timing/{part}") for part in BREAKDOWN},
            "final_gold": eval_gold(cfg),
            "max_staleness_seen": max(float(r["async/staleness"]) for r in rows),
            "batches": len(rows),
            "curve": gold_curve(rows),  # (rolling gold of the samples, seconds from process start) per batch
        }
        print(
            f"seed {seed} {name}: loop {results[name]['loop_seconds']:.1f} s, gold {results[name]['final_gold']:.3f}",
            flush=True,
        )
    return results


def learner_first_batches(results: dict[str, dict]) -> int:
    """train.learner_first_batches of vllm_async_first, by a rule fixed before its run: the plain async run's first
    wait (the engine's start-up) over a synchronous step on one thread (sync_hf: what the learner does a batch while
    the engine starts), rounded."""
    step = results["sync_hf"]["loop_seconds"] / results["sync_hf"]["batches"]
    return max(1, round(results["vllm_async"]["first_wait_seconds"] / step))


def gold_curve(rows: list[dict]) -> list[tuple[float, float]]:
    """Per batch from the window's end on: (mean gold score of the samples of the last `window` batches, seconds from
    the process's start to that batch's end); window = an eighth of the run, at least 2 batches."""
    window = max(2, len(rows) // 8)
    gold = [float(r["objective/gold"]) for r in rows]
    return [
        (sum(gold[t + 1 - window : t + 1]) / window, float(rows[t]["timing/elapsed"]))
        for t in range(window - 1, len(rows))
    ]


def quality_level(sync: dict) -> float:
    """The quality level of time to quality, by a rule fixed before the runs: two thirds of the way from the
    baseline's first window of gold to its last quarter's (so the baseline reaches it; another run may not)."""
    curve = [g for g, _ in sync["curve"]]
    last = curve[-max(1, len(curve) // 4) :]
    return curve[0] + 2 / 3 * (sum(last) / len(last) - curve[0])


def seconds_to(level: float, curve: list[tuple[float, float]]) -> float:
    """Seconds from the process's start until the rolling gold first reaches `level` (inf: never)."""
    return next((seconds for gold, seconds in curve if gold >= level), math.inf)


def stage_train(cfg, settings: list[str], profile: str, processes: int = 1, threads: int = 1):
    """`rlhf train` as the train stage runs it, a process of its own (under accelerate launch, ZeRO-2, for several
    training processes) with `threads` torch threads per process: its wall-clock seconds from the process's start,
    and its logged rows (rlhf.tracking.logged_rows)."""
    from rlhf.tracking import logged_rows

    cli = ["rlhf", "--params", str(ROOT / "params.yaml"), "--profile", profile, "train", *settings]
    if processes > 1:
        launch = ["accelerate", "launch", "--config_file", str(ROOT / "configs" / "zero2.yaml")]
        cli = [*launch, "--num_processes", str(processes), "-m", "rlhf.cli", *cli[1:]]
    env = {**os.environ, "RLHF_TORCH_THREADS": str(threads)}
    before, start = _children_cpu_seconds(), time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlhf.runtime", *cli], check=True, env=env)
    wall, cpu = time.perf_counter() - start, _children_cpu_seconds() - before
    return wall, cpu, logged_rows(cfg.data_dir)


def _children_cpu_seconds() -> float:
    """User + system CPU seconds of every process this one has waited for, their own waited-for children included
    (the engine process, which `rlhf train` joins)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def versus_best_sync(per_seed: list[dict[str, dict]], best: list[str], run: str) -> tuple[list[float], ...]:
    """Per seed, the best sync against `run`: speedups by loop, steady loop, wall clock and time to quality (0: `run`
    never reached the level), and `run`'s gold minus the best sync's (points)."""
    pairs = [(r[b], r[run]) for r, b in zip(per_seed, best)]

    def ratio(key: str) -> list[float]:
        return [s[key] / a[key] for s, a in pairs]

    to_quality = [s["seconds_to_quality"] / a.get("seconds_to_quality", math.inf) for s, a in pairs]
    gaps = [100 * (a["final_gold"] - s["final_gold"]) for s, a in pairs]
    return ratio("loop_seconds"), ratio("steady_loop_seconds"), ratio("wall_seconds"), to_quality, gaps


def summarise(args, per_seed: list[dict[str, dict]]) -> None:
    """Print the first seed's table, the speedups against the sync baseline, the gold gap over seeds (mean, SE);
    write them all, every seed's runs too, as a DVC metrics file."""
    from common import cpu_flags

    from rlhf.io import write_json

    # the best sync of each seed: the fastest sync run by the wall clock, whatever its engine and thread count
    best = [min((n for n in r if n in SYNC), key=lambda n, r=r: r[n]["wall_seconds"]) for r in per_seed]
    results, sync_name = per_seed[0], best[0]
    for r, b in zip(per_seed, best):
        level = quality_level(r[b])
        for run in r.values():
            curve = run.pop("curve")
            run["quality_level"], reached = level, seconds_to(level, curve)
            if reached < math.inf:  # never reached: no entry (JSON has no infinity)
                run["seconds_to_quality"] = reached
    speedups, steadies, walls, to_quality, gaps = versus_best_sync(per_seed, best, "vllm_async")
    sync = results[sync_name]
    ideal = (sync["generation_seconds"] + sync["learner_seconds"]) / max(
        sync["generation_seconds"], sync["learner_seconds"]
    )
    summary = {
        "ideal_overlap_of_sync": ideal,
        "speedup_async_vs_sync": speedups[0],
        "gold_async_minus_sync_points": statistics.mean(gaps),
        "speedup_async_vs_sync_mean_over_seeds": statistics.mean(speedups),
        "speedup_steady_async_vs_sync_mean_over_seeds": statistics.mean(steadies),
        "speedup_wall_async_vs_sync_mean_over_seeds": statistics.mean(walls),
        "speedup_time_to_quality_mean_over_seeds": statistics.mean(to_quality),
        "seeds": len(gaps),
    }
    if len(gaps) > 1:  # one seed has no standard error; NaN would be a `dvc metrics diff` row forever (NaN != NaN)
        summary["gold_async_minus_sync_points_stderr"] = statistics.stdev(gaps) / len(gaps) ** 0.5
    if all("vllm_async_first" in r for r in per_seed):  # the learner sampling while the engine starts
        first = versus_best_sync(per_seed, best, "vllm_async_first")
        summary["learner_first_batches"] = args.first_batches
        for key, values in zip(("loop", "steady", "wall", "time_to_quality", "gold_minus_sync_points"), first):
            summary[f"async_first_{key}_mean_over_seeds"] = statistics.mean(values)
        print("vllm_async_first per seed: loop, steady, wall, to quality, gold - sync:", [list(v) for v in first])
    for name in SYNC:  # every sync run of the first seed against async, by the wall clock
        if name in results:
            summary[f"wall_{name}_vs_async"] = results[name]["wall_seconds"] / results["vllm_async"]["wall_seconds"]
    for e in (1, 2):  # Ray actors against the engine process; E = 2 against E = 1
        if f"vllm_async_ray{e}" in results:
            ray = results[f"vllm_async_ray{e}"]
            summary[f"ray{e}_loop_vs_process"] = ray["loop_seconds"] / results["vllm_async"]["loop_seconds"]
            summary[f"ray{e}_wall_vs_process"] = ray["wall_seconds"] / results["vllm_async"]["wall_seconds"]
    if {"vllm_async_ray1", "vllm_async_ray2"} <= set(results):
        summary["speedup_ray2_vs_ray1"] = (
            results["vllm_async_ray1"]["loop_seconds"] / results["vllm_async_ray2"]["loop_seconds"]
        )
    if "vllm_async_2ranks" in results:
        two = results["vllm_async_2ranks"]["loop_seconds"]
        summary["speedup_async_2ranks_vs_1rank"] = results["vllm_async"]["loop_seconds"] / two
    summary["async_speedup_fraction_of_ideal"] = summary["speedup_async_vs_sync"] / ideal
    summary["async_steady_speedup_fraction_of_ideal"] = statistics.mean(steadies) / ideal
    print(
        f"\nonline DPO, profile {args.profile}, best sync per seed (by the wall clock): {', '.join(best)}; "
        f"{args.seeds} seed(s) (table: the first; _2t: two torch threads, else one per process; CPU: {cpu_flags()})"
    )
    keys = ("wall", "cpu", "loop", "first_wait", "steady_loop", "episodes_per_second", "generation", "learner")
    keys += BREAKDOWN
    keys += ("to_quality", "final_gold")
    labels = ("wall s", "cpu s", "loop s", "1st wait s", "steady s", "eps/s", "gen s", "learner s", "score s", "ref s")
    labels += ("update s", "sync s", "wait s")
    labels += ("eng scr s", "eng idle s", "quality s", "gold")
    print(
        f"time to quality: seconds from process start until the samples' gold (rolling) reaches "
        f"{results[sync_name]['quality_level']:.3f}, 2/3 of the way from the baseline's first window to its end"
    )
    print(f"{'run':<18}" + "".join(f"{label:>11}" for label in labels))
    for name, r in results.items():
        r = {**r, "to_quality_seconds": r.get("seconds_to_quality", math.inf)}
        cells = (r[k if k in ("episodes_per_second", "final_gold") else f"{k}_seconds"] for k in keys)
        print(
            f"{name:<18}" + "".join(f"{c:>11.3f}" if k == "final_gold" else f"{c:>11.1f}" for k, c in zip(keys, cells))
        )
    for key, value in summary.items():
        print(f"{key:<38}{value:8.3f}")
    print(
        "per seed: async/sync speedup "
        + ", ".join(f"{x:.2f}" for x in speedups)
        + "; steady "
        + ", ".join(f"{x:.2f}" for x in steadies)
        + "; wall clock "
        + ", ".join(f"{x:.2f}" for x in walls)
        + "; time to quality "
        + ", ".join(f"{x:.2f}" for x in to_quality)
        + "; gold async - sync (points) "
        + ", ".join(f"{g:+.1f}" for g in gaps)
    )
    name = "async_vs_sync" + ("" if args.profile == "tiny" else f"_{args.profile}")
    name += (f"_{args.label}" if args.label else "") + ".json"
    first = {f"{n}/{k}": v for n, r in results.items() for k, v in r.items()}
    later = {f"seed{i}/{n}/{k}": v for i, rs in enumerate(per_seed[1:], 1) for n, r in rs.items() for k, v in r.items()}
    write_json(ROOT / "bench" / "metrics" / name, {**summary, "cpu_flags": cpu_flags(), **first, **later})


if __name__ == "__main__":
    sys.exit(run_main(main))
