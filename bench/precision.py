"""Learner precision on this CPU: float32 against bf16 mixed precision (train.mixed_precision), same episodes.

Usage:
    .venv/bin/python -m rlhf.runtime python bench/precision.py [--profile tiny|smollm2] [--episodes N] [key=value ...]
`tiny` reads the pipeline's data/ (`make run` first); `smollm2` builds its own small prepare/gold/sft/reward
outputs once under .cache/bench/smollm2-data (the profile with 128 reward prompts). Prints, per precision, the
training loop's seconds, episodes/s and update seconds, and what the run learned (gold and proxy score of the
last quarter of its batches, KL), with the box's CPU flags; writes bench/metrics/precision_<profile>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import (
    ROOT,
    column_sum,
    cpu_flags,
    positive_int,
    run_main,
    scratch_data,
    smollm2_data,
    timed_train,
)  # bench/ is sys.path[0]

PRECISIONS = ("fp32", "bf16")


def run(profile: str, precision: str, episodes: int, data: Path, overrides: list[str]) -> dict:
    from accelerate.state import AcceleratorState

    from rlhf.config import load_config

    AcceleratorState._reset_state(reset_partial_state=True)  # one process, two precisions: a fresh accelerate state

    settings = [f"data_dir={data}", "tracking.wandb_mode=disabled", f"train.mixed_precision={precision}"]
    cfg = load_config(ROOT / "params.yaml", profile, [*settings, f"train.total_episodes={episodes}", *overrides])
    wall, rows = timed_train(cfg)
    last = rows[-max(1, len(rows) // 4) :]
    mean = lambda key: statistics.mean(float(r[key]) for r in last)  # noqa: E731
    loop = column_sum(rows, "timing/step")
    return {
        "wall_seconds": wall,
        "loop_seconds": loop,
        "episodes_per_second": cfg.train.total_episodes / loop,
        "update_seconds": column_sum(rows, "timing/update"),
        "generation_seconds": column_sum(rows, "timing/generation"),
        "final_gold": mean("objective/gold"),
        "final_scores": mean("objective/scores"),
        "final_kl": mean("objective/kl"),
    }


def main() -> None:
    from rlhf import runtime
    from rlhf.io import write_json

    runtime.configure()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", choices=["tiny", "smollm2"])
    ap.add_argument("--episodes", type=positive_int, default=None, help="default: 1024 on tiny, 64 on smollm2")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    episodes = args.episodes or (1024 if args.profile == "tiny" else 64)
    source = smollm2_data() if args.profile == "smollm2" else None
    results = {}
    for precision in PRECISIONS:
        out = ROOT / "bench" / "out" / f"precision-{args.profile}-{precision}"
        data = scratch_data(out, source=source)
        print(f"precision {precision} ...", flush=True)
        results[precision] = run(args.profile, precision, episodes, data, args.overrides)
    print(f"\n{args.profile}, online DPO, {episodes} episodes, one torch thread; CPU flags: {cpu_flags()}")
    print(f"{'learner':<10}{'loop s':>9}{'eps':>8}{'update s':>10}{'gen s':>8}{'gold':>8}{'score':>8}{'KL':>7}")
    for name, r in results.items():
        print(
            f"{name:<10}{r['loop_seconds']:>9.1f}{r['episodes_per_second']:>8.2f}{r['update_seconds']:>10.1f}"
            f"{r['generation_seconds']:>8.1f}{r['final_gold']:>8.3f}{r['final_scores']:>8.3f}{r['final_kl']:>7.2f}"
        )
    speedup = results["fp32"]["loop_seconds"] / results["bf16"]["loop_seconds"]
    gap = results["bf16"]["final_gold"] - results["fp32"]["final_gold"]
    print(f"bf16 / fp32 speed: {speedup:.2f}x; gold bf16 - fp32: {gap:+.3f}")
    metrics = {f"{p}/{k}": v for p, r in results.items() for k, v in r.items()}
    metrics.update({"bf16_speedup": speedup, "cpu_flags": cpu_flags(), "episodes": episodes})
    write_json(ROOT / "bench" / "metrics" / f"precision_{args.profile}.json", metrics)


if __name__ == "__main__":
    sys.exit(run_main(main))
