"""How much `make run`'s results move with the seed: the whole `tiny` pipeline (data split, gold judge, SFT, reward
model, online DPO, evaluation) for top-level seeds 1234 (params.yaml's) to 1238, as DVC experiments through the queue
(bench/dvc_points.py). Every stage is rebuilt for each seed; seed 1234 is the committed run itself.

Why: a run on another CPU kind does not repeat the committed results to the last digit (other kernels round
differently), and over a whole pipeline a rounding difference grows like a change of seed. The README's "healthy run"
should give the range a user will see, and a difference between two boxes is read against it.

  python bench/pipeline_seeds.py queue [--jobs J]   run the missing seeds
  python bench/pipeline_seeds.py report [--other-rev REV]
      bench/metrics/pipeline_seeds.{json,md}: per headline metric the seeds' mean, sd, min and max; with
      --other-rev (a commit whose data/metrics hold a seed-1234 run made on another box), that box's value against
      this box's seed 1234, and whether the difference lies within the seeds' range (max - min): the test, fixed
      here before the seeds ran, of "another box is like another seed".
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from common import cpu_flags, run_main
from dvc_points import OUT, committed, experiments, point_parser, run_points

from rlhf.io import write_text

SEEDS = (1234, 1235, 1236, 1237, 1238)
METRICS = {  # name -> (file, key)
    "gold win-rate vs SFT": ("data/metrics/eval.json", "gold/win_rate_vs_sft"),
    "gold win-rate vs reference": ("data/metrics/eval.json", "gold/win_rate_vs_reference"),
    "SFT's gold win-rate vs reference": ("data/metrics/eval.json", "gold/sft_win_rate_vs_reference"),
    "KL to SFT, nats": ("data/metrics/eval.json", "kl/policy_sft_mean"),
    "proxy reward, policy": ("data/metrics/eval.json", "proxy/policy"),
    "proxy reward, SFT": ("data/metrics/eval.json", "proxy/sft"),
    "RM agreement with gold, held out": ("data/metrics/reward.json", "agreement_heldout"),
    "SFT held-out loss": ("data/metrics/sft.json", "heldout_loss"),
}


def points() -> dict[str, list[str]]:
    """name -> `-S` settings: the top-level seed only."""
    return {f"seed-{seed}": [f"seed={seed}"] for seed in SEEDS}


def table(values: dict[str, np.ndarray]) -> tuple[dict, list[str]]:
    """Per metric: mean, sd (ddof 1), min, max over the seeds; the metrics dict and the markdown rows."""
    stats, rows = {}, ["| metric | mean | sd | min | max | per seed |", "|---|---|---|---|---|---|"]
    for metric, v in values.items():
        stats[metric] = dict(mean=v.mean(), sd=v.std(ddof=1), min=v.min(), max=v.max())
        cells = " | ".join(f"{x:.3f}" for x in stats[metric].values())
        rows.append(f"| {metric} | {cells} | {', '.join(f'{x:.3f}' for x in v)} |")
    return stats, rows


def against_other(values: dict[str, np.ndarray], other: dict[str, float], rev: str) -> list[str]:
    """Another box's seed-1234 result (metric -> value) against this box's seed 1234 and the seeds' range."""
    rows = [f"| metric | other box ({rev}) | this box, seed 1234 | difference | seeds' range | within? |"]
    rows.append("|---|---|---|---|---|---|")
    for metric, theirs in other.items():
        here, spread = values[metric][0], values[metric].max() - values[metric].min()
        diff = theirs - here
        rows.append(
            f"| {metric} | {theirs:.3f} | {here:.3f} | {diff:+.3f} | {spread:.3f} | "
            f"{'yes' if abs(diff) <= spread else 'no'} |"
        )
    return rows


def read(rev: str) -> dict[str, float]:
    """Every metric as commit `rev` holds it."""
    return {metric: json.loads(committed(rev, path))[key] for metric, (path, key) in METRICS.items()}


def report(other_rev: str | None) -> int:
    exps, pts = experiments(), points()
    if missing := [n for n in pts if n not in exps]:
        sys.exit(f"pipeline_seeds: not run yet: {missing}; `python bench/pipeline_seeds.py queue` runs them")
    runs = [read(exps[name]) for name in pts]
    values = {metric: np.array([run[metric] for run in runs]) for metric in METRICS}
    stats, rows = table(values)
    text = f"# `tiny`, the whole pipeline, seeds {SEEDS[0]}-{SEEDS[-1]} (CPU: {cpu_flags()})\n\n" + "\n".join(rows)
    if other_rev is not None:
        try:
            other = read(other_rev)
        except (subprocess.CalledProcessError, json.JSONDecodeError, KeyError) as e:
            failed = isinstance(e, subprocess.CalledProcessError) and (e.stderr or "").strip()
            detail = e.stderr.strip().splitlines()[-1] if failed else repr(e)
            sys.exit(f"pipeline_seeds: --other-rev {other_rev}: no seed-1234 run's metrics there ({detail})")
        text += "\n\n" + "\n".join(against_other(values, other, other_rev))
    OUT.mkdir(parents=True, exist_ok=True)
    write_text(OUT / "pipeline_seeds.md", text + "\n")
    flat = {f"{metric}/{k}": float(v) for metric, s in stats.items() for k, v in s.items()}
    write_text(OUT / "pipeline_seeds.json", json.dumps(flat, indent=2) + "\n")
    print(text + f"\npipeline_seeds: -> {OUT}/pipeline_seeds.{{json,md}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = point_parser(__doc__)
    ap.add_argument("--other-rev", help="`report`: a commit holding another box's seed-1234 run in data/metrics")
    args = ap.parse_args(argv)
    # each seed builds every stage itself: no stage's outputs are shared
    return run_points(args.command, points(), args.jobs, lambda: report(args.other_rev), shared=())


if __name__ == "__main__":
    sys.exit(run_main(main))
