"""Online DPO on the same episodes: sync HF generate, vLLM colocated, vLLM asynchronous (N=1), and async with 2
training processes sharing the engine (accelerate launch, ZeRO-2; on a 2-core CPU box 3 processes share 2 cores,
so it is slower than 1 rank: the row shows that the paper's layout runs and where its time goes).

Needs the pipeline's prepare/gold/sft/reward outputs (`make run` or `dvc repro reward`). Usage:
    .venv/bin/python -m rlhf.runtime python bench/async_vs_sync.py [--profile tiny] [--seeds 3] [key=value ...]
Prints wall-clock time, episodes/s and final gold score for each, the speedups and the ideal overlap of the
sync run, and writes them to bench/metrics/async_vs_sync.json (a DVC metrics file). Gold differences between
two runs of 1,024 episodes are a few points from sampling alone, so sync and async run with several seeds
(the colocated run with the first) and the gold gap is a mean over seeds, with its standard error.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import column_sum, scratch_data, timed_train  # bench/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"sync_hf": "online_dpo", "vllm_colocated": "online_dpo_single_vllm", "vllm_async": "online_dpo_vllm"}
FIRST_SEED_ONLY = {"vllm_colocated", "vllm_async_2ranks"}
TWO_RANKS = {"vllm_async_2ranks": "online_dpo_vllm"}  # under accelerate launch --num_processes 2


def eval_gold(cfg, n_prompts: int = 512) -> float:
    """Mean gold score of the trained policy's samples (train temperature) on the eval prompts."""
    from rlhf import runtime
    from rlhf.data.schemas import EvalPrompts
    from rlhf.data.splits import load_split
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.sampling import sample
    from rlhf.models.loading import load_causal_lm, load_tokenizer
    from rlhf.rewards.gold import GoldJudge

    torch.manual_seed(cfg.seed)
    prompts = list(load_split(cfg.path("prepared"), "eval_prompts", EvalPrompts)["prompt"])[:n_prompts]
    folder = cfg.path("train", "policy")
    params = SamplingParams(k=1, max_new_tokens=cfg.train.response_length, temperature=cfg.train.temperature)
    device = runtime.device()
    policy, tokenizer = load_causal_lm(folder).to(device), load_tokenizer(folder)
    texts = [t for s in sample(policy, tokenizer, prompts, params, 64, device) for t in s.texts]
    return float(GoldJudge.load(cfg.path("gold")).score(texts).mean())


def main() -> None:
    from rlhf import runtime
    from rlhf.config import load_config

    runtime.configure()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--seeds", type=int, default=3, help="sync and async runs per seed (seed, seed+1, ...)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    base = load_config(ROOT / "params.yaml", args.profile, args.overrides).seed
    per_seed = [
        run_all(
            args,
            base + i,
            {**RUNS, **TWO_RANKS} if i == 0 else {k: v for k, v in RUNS.items() if k not in FIRST_SEED_ONLY},
        )
        for i in range(args.seeds)
    ]
    results = per_seed[0]
    gaps = [100 * (r["vllm_async"]["final_gold"] - r["sync_hf"]["final_gold"]) for r in per_seed]
    speedups = [r["sync_hf"]["loop_seconds"] / r["vllm_async"]["loop_seconds"] for r in per_seed]
    summarise(args, results, gaps, speedups)


def run_all(args, seed: int, runs: dict[str, str]) -> dict[str, dict]:
    from rlhf.config import load_config

    results = {}
    for name, trainer in runs.items():
        data = scratch_data(ROOT / "bench" / "out" / name / "data")
        settings = [f"data_dir={data}", f"train.trainer={trainer}", "tracking.wandb_mode=disabled", f"seed={seed}"]
        cfg = load_config(ROOT / "params.yaml", args.profile, [*settings, *args.overrides])
        settings += args.overrides
        wall, rows = launched_train(cfg, settings, args.profile) if name in TWO_RANKS else timed_train(cfg)
        loop = column_sum(rows, "timing/step")
        results[name] = {
            "wall_seconds": wall,  # includes model loading and engine start-up
            "loop_seconds": loop,  # the iterations only
            "episodes_per_second": cfg.train.total_episodes / loop,
            "generation_seconds": column_sum(rows, "timing/generation"),
            "learner_seconds": loop
            - (column_sum(rows, "timing/wait") if "async" in name else column_sum(rows, "timing/generation")),
            "update_seconds": column_sum(rows, "timing/update"),
            "wait_seconds": column_sum(rows, "timing/wait"),  # the learner waiting for the engine (async only)
            "final_gold": eval_gold(cfg),
            "max_staleness_seen": max(float(r["async/staleness"]) for r in rows),
        }
        print(
            f"seed {seed} {name}: loop {results[name]['loop_seconds']:.1f} s, gold {results[name]['final_gold']:.3f}",
            flush=True,
        )
    return results


def launched_train(cfg, settings: list[str], profile: str, processes: int = 2) -> tuple[float, list[dict]]:
    """`rlhf train` under accelerate launch (ZeRO-2) with `processes` training processes: wall seconds, rows."""
    launch = ["accelerate", "launch", "--config_file", str(ROOT / "configs" / "zero2.yaml")]
    cli = ["-m", "rlhf.cli", "--params", str(ROOT / "params.yaml"), "--profile", profile, "train", *settings]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "rlhf.runtime", *launch, "--num_processes", str(processes), *cli], check=True)
    wall = time.perf_counter() - start
    with open(cfg.path("plots", "train.csv")) as f:
        return wall, list(csv.DictReader(f))


def summarise(args, results: dict[str, dict], gaps: list[float], speedups: list[float]) -> None:
    from rlhf.io import write_json

    sync = results["sync_hf"]
    ideal = (sync["generation_seconds"] + sync["learner_seconds"]) / max(
        sync["generation_seconds"], sync["learner_seconds"]
    )
    summary = {
        "ideal_overlap_of_sync": ideal,
        "speedup_async_vs_sync": sync["loop_seconds"] / results["vllm_async"]["loop_seconds"],
        "speedup_colocated_vs_sync": sync["loop_seconds"] / results["vllm_colocated"]["loop_seconds"],
        "speedup_async_vs_colocated": results["vllm_colocated"]["loop_seconds"] / results["vllm_async"]["loop_seconds"],
        "speedup_async_2ranks_vs_1rank": results["vllm_async"]["loop_seconds"]
        / results["vllm_async_2ranks"]["loop_seconds"],
        "gold_async_minus_sync_points": statistics.mean(gaps),
        "gold_async_minus_sync_points_stderr": statistics.stdev(gaps) / len(gaps) ** 0.5
        if len(gaps) > 1
        else float("nan"),
        "speedup_async_vs_sync_mean_over_seeds": statistics.mean(speedups),
        "seeds": len(gaps),
    }
    summary["async_speedup_fraction_of_ideal"] = summary["speedup_async_vs_sync"] / ideal
    print(
        f"\nonline DPO, profile {args.profile}, {args.seeds} seed(s) (table: the first) (torch threads: "
        f"{torch.get_num_threads()})"
    )
    header = ("run", "wall s", "loop s", "eps", "gen s", "learner s", "update s", "wait s", "gold", "stale")
    print(f"{header[0]:<18}" + "".join(f"{h:>10}" for h in header[1:]))
    for name, r in results.items():
        keys = ("wall_seconds", "loop_seconds", "episodes_per_second", "generation_seconds", "learner_seconds")
        keys += ("update_seconds", "wait_seconds", "final_gold", "max_staleness_seen")
        print(f"{name:<18}" + "".join(f"{r[k]:>10.3f}" if k == "final_gold" else f"{r[k]:>10.1f}" for k in keys))
    for key, value in summary.items():
        print(f"{key:<34}{value:8.3f}")
    print(
        "per seed: async/sync speedup "
        + ", ".join(f"{x:.2f}" for x in speedups)
        + "; gold async - sync (points) "
        + ", ".join(f"{g:+.1f}" for g in gaps)
    )
    write_json(
        ROOT / "bench" / "metrics" / "async_vs_sync.json",
        {**summary, **{f"{n}/{k}": v for n, r in results.items() for k, v in r.items()}},
    )


if __name__ == "__main__":
    main()
