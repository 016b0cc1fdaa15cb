"""The paper's Fig. 7 on `tiny`: online DPO taking E = 2 and E = 4 passes over each generated batch against E = 1.

The paper, for generation-bound RLHF (sampling the bottleneck, the trainer idle): train more on each generated batch.
Several updates per batch ("PPO epochs", `train.num_ppo_epochs`) make learning more data-efficient, but move the
win-rate vs KL frontier: the same win-rate at a higher KL. Each point is a DVC experiment queued by
bench/dvc_points.py; E = 1 is the off-policy grid's N = 1 point (op-online_dpo-n1-s<seed>, also
bench/k_samples.py's K = 2 point), so one already run is not run again. Everything else is the `tiny` default: 1,024
prompts in 64 generated batches, the same data, SFT policy and reward model; E = 2 and 4 take 128 and 256 updates.

  python bench/ppo_epochs.py list               every point's name and settings
  python bench/ppo_epochs.py queue [--jobs J]   queue the missing points and wait for them
  python bench/ppo_epochs.py report             bench/metrics/ppo_epochs.{csv,md}

The rules, fixed in the commit that added this file, before any E > 1 point ran; win-rate = gold win-rate vs SFT,
KL = KL(policy || SFT), read at the kept policies (25%, 50%, 75% and 100% of the episodes), means over the seeds;
each rule applied to E = 2 and to E = 4 against E = 1:
- "more data-efficient": at a kept policy f, E's win-rate is above E = 1's by more than MARGIN. A kept policy tests
  the claim only where E = 1 itself still gained more than MARGIN from f to 2f; where it did not, `tiny`'s judge had
  stopped rising and no E can pass it by much: "not testable". The claim holds if it holds at every testable f (at
  least one).
- "moves the frontier": E's frontier (the SFT policy at KL 0, then its kept policies; win-rate linear in KL between
  them) is read at the KL of each of E = 1's kept policies that lies within E's range of KL. The claim holds if
  E = 1's win-rate is above E's there by more than MARGIN on average over those points; with fewer than two such
  points it is not testable.

The first run (seeds 3-6, 2026-11-28) left "more data-efficient" not testable: E = 1 gained only +0.022 from its 25%
to its 50% policy, `tiny`'s judge already flat at the first kept policy. So a second run, `--early`, keeps the
policy after 1/16, 1/8, 1/4, 1/2 and all of the episodes (`train.eval_checkpoints`), every E (E = 1 included) as new
points (pe-early-...), the same seeds, and applies the same two rules, fixed in the commit that added `--early`,
before any of its points ran. Kept policies change nothing in training: its E = 1 final policies must equal the first
run's (the report says whether they do).
"""

from __future__ import annotations

import sys

import dvc_points
import numpy as np
import offpolicy
import pandas as pd
from common import run_main  # bench/ is sys.path[0]

SEEDS = (3, 4, 5, 6)
EPOCHS = (1, 2, 4)
EARLY = (0.0625, 0.125, 0.25, 0.5, 1.0)  # `--early`'s kept policies
MARGIN = 0.03  # win-rate; one eval's standard error on 512 prompts is ~0.018, a mean over 4 seeds' about half that


def name(epochs: int, seed: int) -> str:
    """E = 1 is the off-policy grid's N = 1 point; E > 1 gets its own name."""
    return offpolicy.dpo_variant("num_ppo_epochs", epochs, 1, "pe-online_dpo-e", seed)[0]


def points(seeds: tuple[int, ...] = SEEDS, early: bool = False) -> dict[str, list[str]]:
    """Every point: its name and its `-S` settings (E = 1 leaves the profile's num_ppo_epochs, which is 1). early:
    the `--early` points, the policy kept at EARLY, each E a point of its own."""
    if not early:
        return dict(offpolicy.dpo_variant("num_ppo_epochs", e, 1, "pe-online_dpo-e", s) for e in EPOCHS for s in seeds)
    kept = f"train.eval_checkpoints=[{','.join(f'{f:g}' for f in EARLY)}]"
    return {
        f"pe-early-online_dpo-e{e}-s{seed}": [*offpolicy.dpo_variant("num_ppo_epochs", e, None, "", seed)[1], kept]
        for e in EPOCHS
        for seed in seeds
    }


def frontier(kept: pd.DataFrame, epochs: int) -> tuple[np.ndarray, np.ndarray]:
    """E's mean frontier, KL ascending: (kl, win-rate), the SFT policy (0, 0.5) first."""
    mean = kept[kept["E"] == epochs].groupby("fraction")[["kl", "win_rate_vs_sft"]].mean().sort_values("kl")
    return np.r_[0.0, mean["kl"].to_numpy()], np.r_[0.5, mean["win_rate_vs_sft"].to_numpy()]


def efficiency(win: pd.Series, epochs: int) -> str:
    """The first rule of the docstring for one E: a line per kept policy and the verdict."""
    lines, held = [], []
    for f in sorted(win[1].index):
        if 2 * f not in win[1].index:
            continue
        head = f"E = {epochs} at {f:.0%}: {win[epochs][f]:.3f}; E = 1: {win[1][f]:.3f}"
        if win[1][2 * f] - win[1][f] <= MARGIN:
            gained = win[1][2 * f] - win[1][f]
            lines.append(
                f"  - {head}: not testable (E = 1 gained {gained:+.3f} to {2 * f:.0%}, not more than {MARGIN})"
            )
            continue
        held.append(win[epochs][f] - win[1][f] > MARGIN)
        lines.append(f"  - {head}: {'ahead' if held[-1] else 'not ahead'} by more than {MARGIN}")
    verdict = "not testable" if not held else "holds" if all(held) else "does not hold"
    return "\n".join([f"- E = {epochs}, more data-efficient: {verdict}", *lines])


def frontier_shift(kept: pd.DataFrame, epochs: int) -> str:
    """The second rule of the docstring for one E: E = 1's win-rate minus E's at E = 1's KLs, and the verdict."""
    kl, win = frontier(kept, epochs)
    base_kl, base_win = frontier(kept, 1)
    inside = [(k, w) for k, w in zip(base_kl[1:], base_win[1:]) if kl[0] <= k <= kl[-1]]
    gaps = [w - float(np.interp(k, kl, win)) for k, w in inside]
    where = ", ".join(f"{g:+.3f} at {k:.1f} nats" for g, (k, _) in zip(gaps, inside)) or "none"
    if len(gaps) < 2:
        verdict = f"not testable ({len(gaps)} of E = 1's kept policies within E = {epochs}'s KL)"
    else:
        mean = float(np.mean(gaps))
        verdict = f"{'holds' if mean > MARGIN else 'does not hold'} (E = 1 ahead by {mean:+.3f} on average)"
    return f"- E = {epochs}, the frontier moved (E = 1's win-rate minus E = {epochs}'s at equal KL: {where}): {verdict}"


def verdicts(kept: pd.DataFrame) -> list[str]:
    """Both rules for every E > 1."""
    win = kept.groupby(["E", "fraction"])["win_rate_vs_sft"].mean()
    return [line for e in EPOCHS[1:] for line in (efficiency(win, e), frontier_shift(kept, e))]


def same_final_policies(early: dict[str, list[str]]) -> list[str]:
    """`--early`'s E = 1 final policies against the first run's, seed by seed: the same win-rate and KL, or not."""
    first = {name(1, seed) for seed in SEEDS}  # the first run's E = 1: the grid's points, no epochs setting
    ones = {n: v for pts in (points(), early) for n, v in pts.items() if n in first or "train.num_ppo_epochs=1" in v}
    rows = dvc_points.frontier_rows(dvc_points.experiments(), ones)
    final = rows[rows["fraction"] == 1.0].groupby("seed")
    same = bool((final.size() == 2).all() and (final[["win_rate_vs_sft", "kl"]].nunique() == 1).all(axis=None))
    return [
        f"- E = 1's final policies, this run against the first, seed by seed: {'the same' if same else 'NOT the same'}"
    ]


def report(pts: dict[str, list[str]], early: bool) -> int:
    title = f"Online DPO, E = {', '.join(map(str, EPOCHS))} passes over each generated batch"
    if early:
        rules, stem = (lambda kept: verdicts(kept) + same_final_policies(pts)), "ppo_epochs_early"
    else:
        rules, stem = verdicts, "ppo_epochs"
    return offpolicy.variant_report(stem, pts, ("E", "train.num_ppo_epochs", 1), title, rules)


def main(argv: list[str] | None = None) -> int:
    ap = dvc_points.point_parser(__doc__)
    ap.add_argument("--early", action="store_true", help="the second run: policies kept from 1/16 of the episodes")
    args = ap.parse_args(argv)
    pts = points(early=args.early)
    return dvc_points.run_points(args.command, pts, args.jobs, lambda: report(pts, args.early))


if __name__ == "__main__":
    sys.exit(run_main(main))
