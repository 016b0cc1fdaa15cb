"""The paper's Fig. 8 on `tiny`: online DPO with K = 4 samples per prompt (best vs worst) against K = 2.

The paper: sampling K = 4 completions per prompt reaches the same win-rate in half the steps, at the cost of more KL
drift (a training-bound optimisation: more generation per step, fewer steps). Each point is a DVC experiment queued
by bench/dvc_points.py; K = 2 with N = 1 is the off-policy grid's own point (op-online_dpo-n1-s<seed>), so
one already run is not run again. Everything else is the `tiny` default: 1,024 prompts, 64 updates, the same data,
SFT policy and reward model.

  python bench/k_samples.py queue [--jobs J]   queue the missing points and wait for them
  python bench/k_samples.py report             bench/metrics/k_samples.{csv,md}

The rules, fixed in the commit that added this file, before any K = 4 point ran; win-rate = gold win-rate vs SFT, KL =
KL(policy || SFT), each read at the kept policies (25%, 50%, 75% and 100% of the updates), means over the seeds:
- "the same win-rate in half the steps": for each pair of kept fractions (f, 2f), K = 4 at f reaches K = 2 at 2f
  within MARGIN. A pair tests the claim only where K = 2 itself gained more than MARGIN from f to 2f; where it did
  not, `tiny`'s judge had stopped rising, and any K reaches it: "not testable".
- "more KL drift": K = 4's KL at the final policy is higher than K = 2's in every seed.

  python bench/k_samples.py time [--rounds R]   the same two runs, alone and in turn, timed by one clock

The queue's points ran two at a time on two cores beside whatever else ran, so their seconds are not comparable.
`time` runs `rlhf train` for K = 2 and K = 4 (seed 3) one after the other, each alone with 2 torch threads in a fresh
process over a scratch copy of data/, R rounds in alternating order, and reads the loop's own `timing/elapsed` at
the kept policies. The rule, fixed before it ran: K = 4 is faster to K = 2's half-way win-rate by the wall clock if,
in every round, its elapsed seconds at the 25% policy are fewer than K = 2's at the 50% policy.
"""

from __future__ import annotations

import os
import sys

import dvc_points
import offpolicy
import pandas as pd
from common import ROOT, cpu_flags, positive_int, run_main, run_process_tree, scratch_data

from rlhf.io import write_text

SEEDS = (3, 4, 5, 6)
KS = (2, 4)
MARGIN = 0.03  # win-rate; one eval's standard error on 512 prompts is ~0.018, a mean over 4 seeds' about half that


def name(k: int, seed: int) -> str:
    """K = 2 is the off-policy grid's N = 1 point; K = 4 gets its own name."""
    return offpolicy.dpo_variant("k", k, 2, "ks-online_dpo-k", seed)[0]


def points(seeds: tuple[int, ...] = SEEDS) -> dict[str, list[str]]:
    """Every point: its name and its `-S` settings (K = 2 leaves the profile's k, which is 2)."""
    return dict(offpolicy.dpo_variant("k", k, 2, "ks-online_dpo-k", seed) for k in KS for seed in seeds)


def verdicts(kept: pd.DataFrame) -> list[str]:
    """The two rules of the docstring applied to the kept policies, one line per tested pair and one for KL."""
    win = kept.groupby(["K", "fraction"])["win_rate_vs_sft"].mean()
    lines = []
    for f in sorted(kept["fraction"].unique()):
        if (2, 2 * f) not in win.index:
            continue
        k4, k2_here, k2_double = win[(4, f)], win[(2, f)], win[(2, 2 * f)]
        head = f"K = 4 at {f:.0%}: {k4:.3f}; K = 2 at {2 * f:.0%}: {k2_double:.3f} (at {f:.0%}: {k2_here:.3f})"
        if k2_double - k2_here <= MARGIN:
            lines.append(f"- {head}: not testable (K = 2 gained {k2_double - k2_here:+.3f}, not more than {MARGIN})")
        else:
            held = k4 >= k2_double - MARGIN
            lines.append(f"- {head}: {'holds' if held else 'does not hold'} (margin {MARGIN})")
    final = kept[kept["fraction"] == 1.0].pivot_table(index="seed", columns="K", values="kl")
    higher = (final[4] > final[2]).all()
    pairs = ", ".join(f"seed {s}: {r[4]:.2f} vs {r[2]:.2f}" for s, r in final.iterrows())
    drift = "in every seed" if higher else "NOT in every seed"
    lines.append(f"- final KL, K = 4 vs K = 2 ({pairs}): more KL drift {drift}")
    return lines


def report(pts: dict[str, list[str]]) -> int:
    title = "Online DPO, K = 4 vs K = 2 samples per prompt"
    return offpolicy.variant_report("k_samples", pts, ("K", "train.k", 2), title, verdicts)


def timed_run(k: int, folder) -> pd.DataFrame:
    """`rlhf train` for one K on a fresh scratch data dir: its timing rows (batch, elapsed seconds since start)."""
    folder = scratch_data(folder)
    settings = points((3,))[name(k, 3)]
    cmd = [sys.executable, "-m", "rlhf.cli", "--profile", "tiny", "train", f"data_dir={folder}", *settings]
    env = {**os.environ, "RLHF_TORCH_THREADS": "2", "WANDB_MODE": "disabled"}
    run_process_tree(cmd, folder.parent / f"train_k{k}.log", env)  # a failure exits with the log's last lines
    timing = pd.read_csv(folder / "timing" / "train.csv")
    return timing[["train/global_step", "timing/elapsed", "timing/step", "timing/generation"]]


def time_verdict(frame: pd.DataFrame) -> str:
    """The time rule: K = 4's seconds to its 25% policy fewer than K = 2's to its 50% one, in every round."""
    wide = frame.pivot_table(index="round", columns="K", values=["s_at_25%", "s_at_50%"])
    faster = wide[("s_at_25%", 4)] < wide[("s_at_50%", 2)]
    return "yes, every round" if faster.all() else f"no (rounds {', '.join(map(str, faster.index[~faster]))} not)"


def time_to_kept(rounds: int) -> int:
    """Elapsed seconds at each kept policy, K = 2 and K = 4 alone and in turn; the rule of the docstring."""
    rows, folder = [], ROOT / ".cache" / "bench" / "k_samples"
    for r in range(rounds):
        for k in KS if r % 2 == 0 else KS[::-1]:
            timing = timed_run(k, folder)
            elapsed = timing.set_index("train/global_step")["timing/elapsed"]
            at = {f: float(elapsed[round(f * elapsed.index.max())]) for f in (0.25, 0.5, 1.0)}
            steady = timing.iloc[1:]  # the first batch carries the warm-up
            rows.append(
                dict(round=r + 1, K=k, **{f"s_at_{f:.0%}": v for f, v in at.items()},
                     step_s=steady["timing/step"].mean(), generation_s=steady["timing/generation"].mean())
            )  # fmt: skip
            print(f"k_samples: round {r + 1}, K = {k}: " + ", ".join(f"{f:.0%} at {v:.1f} s" for f, v in at.items()))
    frame = pd.DataFrame(rows)
    verdict = f"K = 4 faster to K = 2's half-way win-rate by the wall clock: {time_verdict(frame)}"
    text = f"# K = 4 vs K = 2, time to the kept policies (CPU: {cpu_flags()})\n\n"
    text += frame.round(2).to_markdown(index=False) + f"\n\n- {verdict}\n"
    write_text(offpolicy.OUT / "k_samples_time.md", text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = dvc_points.point_parser(__doc__, "time")
    ap.add_argument("--rounds", type=positive_int, default=2, help="`time`: rounds of K = 2 and K = 4 in turn")
    args = ap.parse_args(argv)
    if args.command == "time":
        return time_to_kept(args.rounds)
    pts = points()
    return dvc_points.run_points(args.command, pts, args.jobs, lambda: report(pts))


if __name__ == "__main__":
    sys.exit(run_main(main))
