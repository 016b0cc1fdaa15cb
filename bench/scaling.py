"""How one training iteration's time grows with batch size and response length, and where it goes.

Usage:
    .venv/bin/python -m rlhf.runtime python bench/scaling.py [--profile tiny] [--trainer online_dpo]
        [--batches 8,16,32,64] [--lengths 16,32,64] [--iterations 4] [key=value ...]
Needs the pipeline's prepare/gold/sft/reward outputs. For each (prompts per batch, response length) it trains
`--iterations` batches and averages the timing/* rows of all but the first (warm-up): generation, scoring,
reference (+ behaviour) forwards, update, weight sync. Prints the table and writes bench/metrics/scaling.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from common import positive_int, positive_ints, run_main, scratch_data  # bench/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("generation", "scoring", "reference", "update", "weight_sync")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--trainer", default="online_dpo")
    ap.add_argument(
        "--batches", type=positive_ints, default="8,16,32,64", help="prompts per generated batch (P, with G=M=1)"
    )
    ap.add_argument("--lengths", type=positive_ints, default="16,32,64", help="train.response_length values")
    ap.add_argument("--iterations", type=positive_int, default=4, help="batches per setting; the first is a warm-up")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from rlhf.config import load_config

    load_config(ROOT / "params.yaml", args.profile, args.overrides)  # a bad profile or setting: refused first
    from rlhf import runtime

    runtime.configure()
    from rlhf.io import write_json
    from rlhf.tracking import logged_rows
    from rlhf.trainers.loop import train

    table, metrics = [], {}
    for length in args.lengths:
        for batch in args.batches:
            data = scratch_data(ROOT / "bench" / "out" / "scaling" / "data")
            cfg = load_config(
                ROOT / "params.yaml",
                args.profile,
                [
                    f"data_dir={data}",
                    f"train.trainer={args.trainer}",
                    "tracking.wandb_mode=disabled",
                    "tracking.log_every=1",
                    f"train.response_length={length}",
                    f"train.per_device_train_batch_size={batch}",
                    "train.gradient_accumulation_steps=1",
                    "train.num_mini_batches=1",
                    f"train.total_episodes={batch * args.iterations}",
                    *args.overrides,
                ],
            )
            train(cfg)
            rows = logged_rows(cfg.data_dir)[1:]
            means = {key: statistics.mean(float(r.get(f"timing/{key}") or 0) for r in rows) for key in ("step", *PARTS)}
            row = {"batch": batch, "length": length, **means}
            row["episodes_per_second"] = batch / row["step"]
            table.append(row)
            metrics.update({f"b{batch}_t{length}/{k}": v for k, v in row.items() if k not in ("batch", "length")})
            print(f"batch {batch} x length {length}: {row['step']:.2f} s/iteration", flush=True)
    print(
        f"\n{args.trainer} on {args.profile}, k={cfg.train.k}, seconds per iteration (mean of {args.iterations - 1} "
        f"after a warm-up)"
    )
    print(f"{'prompts':>8}{'length':>8}{'step':>8}" + "".join(f"{p:>13}" for p in PARTS) + f"{'episodes/s':>12}")
    for r in table:
        print(
            f"{r['batch']:>8}{r['length']:>8}{r['step']:>8.2f}"
            + "".join(f"{r[p]:>13.2f}" for p in PARTS)
            + f"{r['episodes_per_second']:>12.1f}"
        )
    write_json(ROOT / "bench" / "metrics" / "scaling.json", metrics)


if __name__ == "__main__":
    sys.exit(run_main(main))
