"""AReaL's naive-vs-decoupled table at small scale: RLOO and PPO on `tiny`, the asynchronous engine S = 4 batches ahead.

AReaL (Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning") trains
on batches sampled by weights several versions old and reports that standard PPO degrades with that staleness while
its decoupled objective (train.decoupled_cap: per-token behaviour weights pi_prox / pi_engine, tokens past the cap
masked, the ratio clipped around pi_prox; rlhf/algorithms/decoupled.py) does not. Here, per algorithm, three variants
at S = 4 (`train.engine=vllm_async`, `train.max_staleness=4`):
  naive      no correction: the ratio's denominator is the learner's weights when the batch's update starts (the
             loop's step 5 forward), the engine's staleness ignored
  tis        per-sequence truncated importance sampling, min(pi / pi_engine, TIS_CAP) on each advantage (train.tis_cap,
             bench/offpolicy.py's S = 4 correction)
  decoupled  AReaL's objective, cap DECOUPLED_CAP (their example configs' `behav_imp_weight_cap: 5.0`)
each with M = 4 mini-batches per generated batch (`train.num_mini_batches=4`), so that pi_prox and pi_theta differ
within a batch's update (the clipping around pi_prox is what the decoupled objective adds beside the weights), and
everything else `tiny`'s: 1,024 prompts, here in 16 generated batches of 64, the same 64 updates, the same data, SFT
policy and reward model; RL seeds 1, 2, 3 (`train.seed`). Each point is a DVC experiment queued by
bench/dvc_points.py (dc-<algorithm>-<variant>-s<seed>).
RLOO's decoupled loss is token-level (rlhf/algorithms/rloo.py, `token_policy_loss`, says why) where its naive and tis
losses clip one ratio per sequence: its comparison measures the decoupled objective as a run switches it on, form and
weights together. PPO's three losses are all token-level: its comparison isolates the correction.

  python bench/decoupled.py list               every point's name and settings (runs nothing)
  python bench/decoupled.py queue [--jobs J]   queue the missing points and wait for them
  python bench/decoupled.py report             bench/metrics/decoupled.{csv,md}

The rule, fixed in the commit that added this file, before any point ran. Win-rate = gold win-rate vs SFT of a kept
policy (data/plots/frontier.csv), KL = KL(policy || SFT); read at the half-way policy (50% of the episodes: `tiny`'s
judge flattens early, bench/offpolicy.py's second rule) and at the final policy; for each algorithm apart:
- per seed s, d_s = win-rate(decoupled, s) - win-rate(naive, s) (a seed's variants start from the same weights and
  see the same prompts in the same order); d = the mean of d_s over the seeds; the seeds' spread = the half-range
  (max - min) / 2 of d_s; the threshold = the larger of MARGIN and that spread.
- "decoupled beats naive at S = 4" holds if d > threshold at both kept policies; "naive beats decoupled" if
  d < -threshold at both; otherwise no difference is resolved.
- The same reading of decoupled against tis (d_s = win-rate(decoupled, s) - win-rate(tis, s)): "decoupled beats
  per-sequence truncation".
- KL beside it: a win-rate gained at a larger KL may be progress along the same frontier (staleness slows progress
  rather than moving the frontier, bench/offpolicy.py found). So the report also reads decoupled's frontier (the SFT
  policy at (0, 0.5), then its kept policies, seeds' means, win-rate linear in KL between them) at naive's final KL:
  "ahead at equal KL" if above naive's final win-rate by more than MARGIN, "not ahead" otherwise, "not testable"
  where naive's final KL lies beyond decoupled's largest. This qualifies the verdict; it does not decide it.
The report also gives each variant's mean policy/behav_masked, policy/behav_kl and policy/is_weight over the run
(data/plots/train.csv): how much the corrections had to correct.
"""

from __future__ import annotations

import io
import itertools
import sys

import dvc_points
import numpy as np
import offpolicy
import pandas as pd
from common import run_main  # bench/ is sys.path[0]

from rlhf.io import write_text

ALGORITHMS = ("rloo", "ppo")
SEEDS = (1, 2, 3)
STALENESS = 4  # S
MINI_BATCHES = 4  # M: pi_prox != pi_theta after each batch's first update
DECOUPLED_CAP = 5.0  # AReaL's example configs' behav_imp_weight_cap
VARIANTS = {
    "naive": [],
    "tis": [f"train.tis_cap={offpolicy.TIS_CAP}"],
    "decoupled": [f"train.decoupled_cap={DECOUPLED_CAP}"],
}
KEPT = (0.5, 1.0)  # the kept policies the rule reads
MARGIN = 0.03  # win-rate; one eval's standard error on 512 prompts is ~0.018, a mean over 3 seeds' about 0.01
PREFIX = "dc"
DIAGNOSTICS = ("async/staleness", "policy/behav_masked", "policy/behav_kl", "policy/is_weight")


def points(seeds: tuple[int, ...] = SEEDS) -> dict[str, list[str]]:
    """Every point: dc-<algorithm>-<variant>-s<seed> and its `-S` settings; a seed's variants differ in their
    correction only."""
    stale = ["train.engine=vllm_async", f"train.max_staleness={STALENESS}", f"train.num_mini_batches={MINI_BATCHES}"]
    return {
        f"{PREFIX}-{algorithm}-{variant}-s{seed}": [
            f"train.trainer={algorithm}",
            *stale,
            *VARIANTS[variant],
            f"train.seed={seed}",
        ]
        for algorithm, variant, seed in itertools.product(ALGORITHMS, VARIANTS, seeds)
    }


def variant_of(name: str) -> str:
    """dc-rloo-decoupled-s1 -> decoupled."""
    return name.split("-")[2]


def kept_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """frontier rows (dvc_points.frontier_rows) of the kept policies, with each point's variant."""
    kept = frame[frame["fraction"] > 0]
    kept = kept.assign(variant=kept["point"].map(variant_of))
    return kept[["algorithm", "variant", "seed", "fraction", "episode", "win_rate_vs_sft", "kl"]]


def difference(kept: pd.DataFrame, algorithm: str, variant: str, against: str, fraction: float) -> tuple | None:
    """(d, spread, per-seed d_s) of `variant` minus `against` at one kept policy, over the seeds both ran; None
    where no seed ran both."""
    rows = kept[(kept["algorithm"] == algorithm) & (kept["fraction"] == fraction)]
    wide = rows.pivot_table(index="seed", columns="variant", values="win_rate_vs_sft")
    if variant not in wide or against not in wide:
        return None
    d = (wide[variant] - wide[against]).dropna()
    if d.empty:
        return None
    return float(d.mean()), float((d.max() - d.min()) / 2), d


def rule(kept: pd.DataFrame, algorithm: str, variant: str, against: str) -> list[str]:
    """The docstring's rule for `variant` against `against`: a line per kept policy, then the verdict."""
    lines, signs = [], []
    for f in KEPT:
        found = difference(kept, algorithm, variant, against, f)
        if found is None:
            lines.append(f"  - at {f:.0%}: not run")
            continue
        d, spread, per_seed = found
        threshold = max(MARGIN, spread)
        signs.append(1 if d > threshold else -1 if d < -threshold else 0)
        seeds = ", ".join(f"{x:+.3f}" for x in per_seed)
        lines.append(f"  - at {f:.0%}: d = {d:+.3f} (per seed {seeds}; spread {spread:.3f}, threshold {threshold:.3f})")
    if len(signs) < len(KEPT):
        verdict = "not decided (a kept policy not run)"
    elif all(s == 1 for s in signs):
        verdict = f"{variant} beats {against}"
    elif all(s == -1 for s in signs):
        verdict = f"{against} beats {variant}"
    else:
        verdict = "no difference resolved"
    return [f"- {algorithm}, {variant} vs {against} at S = {STALENESS}: {verdict}", *lines]


def frontier(kept: pd.DataFrame, algorithm: str, variant: str) -> tuple[np.ndarray, np.ndarray]:
    """A variant's mean frontier, KL ascending: (kl, win-rate), the SFT policy (0, 0.5) first."""
    rows = kept[(kept["algorithm"] == algorithm) & (kept["variant"] == variant)]
    mean = rows.groupby("fraction")[["kl", "win_rate_vs_sft"]].mean().sort_values("kl")
    return np.r_[0.0, mean["kl"].to_numpy()], np.r_[0.5, mean["win_rate_vs_sft"].to_numpy()]


def at_equal_kl(kept: pd.DataFrame, algorithm: str) -> str:
    """The KL reading of the docstring: decoupled's frontier at naive's final KL against naive's final win-rate."""
    final = kept[(kept["algorithm"] == algorithm) & (kept["fraction"] == 1.0)]
    naive = final[final["variant"] == "naive"]
    if naive.empty or final[final["variant"] == "decoupled"].empty:
        return f"- {algorithm}, decoupled at naive's final KL: not run"
    kl, win = frontier(kept, algorithm, "decoupled")
    naive_kl, naive_win = float(naive["kl"].mean()), float(naive["win_rate_vs_sft"].mean())
    head = f"- {algorithm}, decoupled at naive's final KL ({naive_kl:.2f} nats, naive {naive_win:.3f})"
    if naive_kl > kl[-1]:
        return f"{head}: not testable (decoupled's largest KL {kl[-1]:.2f})"
    gap = float(np.interp(naive_kl, kl, win)) - naive_win
    return f"{head}: {'ahead' if gap > MARGIN else 'not ahead'} at equal KL ({gap:+.3f})"


def table(kept: pd.DataFrame) -> str:
    """Markdown: per algorithm, variant and kept policy, the seeds' mean win-rate, each seed's, the mean KL."""
    lines = ["| algorithm | variant | kept policy | win-rate vs SFT (mean) | per seed | KL (mean) |", "|---" * 6 + "|"]
    for (algorithm, variant, f), g in kept.groupby(["algorithm", "variant", "fraction"], sort=False):
        seeds = ", ".join(f"{w:.3f}" for w in g.sort_values("seed")["win_rate_vs_sft"])
        mean, kl = g["win_rate_vs_sft"].mean(), g["kl"].mean()
        lines.append(f"| {algorithm} | {variant} | {f:.0%} | {mean:.3f} | {seeds} | {kl:.2f} |")
    return "\n".join(lines)


def diagnostics(exps: dict[str, str], pts: dict[str, list[str]]) -> pd.DataFrame:
    """Per algorithm and variant, the mean over its points' batches of DIAGNOSTICS (data/plots/train.csv as each
    experiment committed it; NaN where a variant does not log one)."""
    rows = []
    for name in (n for n in pts if n in exps):
        train = pd.read_csv(io.StringIO(dvc_points.committed(exps[name], "data/plots/train.csv")))
        means = {k: float(train[k].mean()) if k in train else float("nan") for k in DIAGNOSTICS}
        rows.append(dict(algorithm=name.split("-")[1], variant=variant_of(name), **means))
    return pd.DataFrame(rows).groupby(["algorithm", "variant"], sort=False).mean().reset_index()


def verdicts(kept: pd.DataFrame) -> list[str]:
    """Every rule of the docstring, per algorithm that ran."""
    lines = []
    for algorithm in dict.fromkeys(kept["algorithm"]):
        lines += rule(kept, algorithm, "decoupled", "naive")
        lines += rule(kept, algorithm, "decoupled", "tis")
        lines.append(at_equal_kl(kept, algorithm))
    return lines


def report(pts: dict[str, list[str]]) -> int:
    """bench/metrics/decoupled.csv (every kept policy of every point) and decoupled.md (the table, the verdicts and
    the corrections' diagnostics)."""
    exps = dvc_points.experiments()
    if missing := [n for n in pts if n not in exps]:
        sys.exit(f"decoupled: not run yet: {missing}; `python bench/decoupled.py queue` runs them")
    kept = kept_rows(dvc_points.frontier_rows(exps, pts))
    seeds = ", ".join(map(str, sorted(kept["seed"].unique())))
    text = f"# Naive vs decoupled (AReaL) at S = {STALENESS}, M = {MINI_BATCHES}, `tiny` (seeds {seeds})\n\n"
    text += table(kept) + "\n\n" + "\n".join(verdicts(kept)) + "\n\n"
    text += diagnostics(exps, pts).to_markdown(index=False, floatfmt=".4f") + "\n"
    offpolicy.OUT.mkdir(parents=True, exist_ok=True)
    write_text(offpolicy.OUT / "decoupled.csv", kept.to_csv(index=False))
    write_text(offpolicy.OUT / "decoupled.md", text)
    print(text + f"decoupled: -> {offpolicy.OUT}/decoupled.{{csv,md}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = dvc_points.point_parser(__doc__)
    args = ap.parse_args(argv)
    pts = points()
    return dvc_points.run_points(args.command, pts, args.jobs, lambda: report(pts))


if __name__ == "__main__":
    sys.exit(run_main(main))
