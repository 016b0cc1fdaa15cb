"""Does sampling with vLLM train worse than sampling with HF generate? RLOO on `tiny`, 5 RL seeds x {HF generate,
colocated vLLM}, as DVC experiments through the queue (bench/dvc_points.py; the HF seeds 1-2 are the
off-policy grid's N = 1 RLOO points, reused).

The rule, fixed before the runs: per metric, the 90% confidence interval of the mean difference (HF - vLLM, Welch)
over the seeds. A gap exists if it excludes 0; the engines are equivalent on the training reward if it lies within
+-0.1 (the proxy RM's scale: it moves ~2.5 from SFT to the end of a run).
Metrics: the proxy reward over the last quarter of training (train.json, 256 samples a seed), and the final policy's
gold win-rate vs SFT and proxy reward on the 512 eval prompts (eval.json).

  python bench/engine_gap.py queue [--jobs J]    run the missing points
  python bench/engine_gap.py report              the table (bench/metrics/engine_gap.md)
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from common import run_main  # bench/ is sys.path[0]
from dvc_points import OUT, add_jobs, committed, experiments, queue
from scipy import stats

from rlhf.io import write_text

SEEDS = (1, 2, 3, 4, 5)
MARGIN = 0.1
METRICS = {  # name -> (file, key)
    "proxy reward, last quarter of training": ("data/metrics/train.json", "final/objective/scores"),
    "gold win-rate vs SFT, final policy": ("data/metrics/eval.json", "gold/win_rate_vs_sft"),
    "proxy reward, final policy": ("data/metrics/eval.json", "proxy/policy"),
}


def points() -> dict[str, list[str]]:
    """name -> settings; HF seeds 1 and 2 are the off-policy grid's points of the same settings."""
    out = {}
    for seed in SEEDS:
        hf = f"op-rloo-n1-s{seed}" if seed <= 2 else f"gap-rloo-hf-s{seed}"
        out[hf] = ["train.trainer=rloo", "train.num_mini_batches=1", f"train.seed={seed}"]
        out[f"gap-rloo-vllm-s{seed}"] = ["train.trainer=rloo", "train.engine=vllm", f"train.seed={seed}"]
    return out


def values(exps: dict[str, str], names: list[str], file: str, key: str) -> np.ndarray:
    """One metric of each experiment, read from the metrics file its commit holds."""
    return np.array([json.loads(committed(exps[name], file))[key] for name in names], dtype=float)


def report() -> int:
    exps, pts = experiments(), points()
    missing = [n for n in pts if n not in exps]
    if missing:
        sys.exit(f"engine_gap: {len(missing)} point(s) not run yet {missing}: `python bench/engine_gap.py queue`")
    hf, vllm = [n for n in pts if "vllm" not in n], [n for n in pts if "vllm" in n]
    lines = [
        "| metric | HF (mean, sd) | vLLM (mean, sd) | HF - vLLM, 90% CI | gap? | within +-0.1? |",
        "|---" * 6 + "|",
    ]
    for metric, (file, key) in METRICS.items():
        a, b = values(exps, hf, file, key), values(exps, vllm, file, key)
        test = stats.ttest_ind(a, b, equal_var=False)
        low, high = test.confidence_interval(0.90)
        gap, equivalent = not low <= 0 <= high, -MARGIN < low and high < MARGIN
        lines.append(
            f"| {metric} | {a.mean():.3f}, {a.std(ddof=1):.3f} | {b.mean():.3f}, {b.std(ddof=1):.3f} "
            f"| {a.mean() - b.mean():+.3f} [{low:+.3f}, {high:+.3f}] | {'yes' if gap else 'no'} "
            f"| {'yes' if equivalent else 'no'} |"
        )
    text = "\n".join(lines) + f"\n\n{len(SEEDS)} seeds a side; Welch's t interval.\n"
    OUT.mkdir(parents=True, exist_ok=True)
    write_text(OUT / "engine_gap.md", text)
    print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queue", help="run the missing points through DVC's queue")
    add_jobs(q)
    sub.add_parser("report", help="the table")
    args = ap.parse_args(argv)
    return queue(points(), args.jobs) if args.command == "queue" else report()


if __name__ == "__main__":
    sys.exit(run_main(main))
