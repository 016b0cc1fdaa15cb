"""`make offpolicy`: the paper's off-policy experiment (its Fig. 3/4) as a grid of DVC experiments.

Each point is one `dvc exp run --queue` of the pipeline with `-S` settings, named for what it varies:
  grid:       PPO, RLOO, online DPO and best-of-2 x N in {1, 4, 16} (train.num_mini_batches: N mini-batches sampled
              with one policy, then N updates, each more off-policy; the same episodes and updates for every N)
              x 2 RL seeds (train.seed: the data, SFT and reward model are shared, not rebuilt);
  staleness:  the asynchronous engine generating up to S = 1, 2, 4 batches ahead (train.max_staleness) for online
              DPO and RLOO, and at S = 4 RLOO with truncated importance weights (train.tis_cap) against without.
Points already run (an experiment of that name exists) are not queued again, so adding a value to a list below and
running `make offpolicy` again runs only the new points; `dvc exp show` lists them all.

  python bench/offpolicy.py list               every point's name and settings
  python bench/offpolicy.py queue [--jobs J]   queue the missing points, start J queue workers, wait for them
  python bench/offpolicy.py report             the tables and the figure (bench/metrics/offpolicy.{csv,md,png});
                                               the figure is also `rlhf report`'s section 6 and a DVC plot

"Robust" is decided by a rule fixed before the grid ran: an algorithm's retention is its gain over SFT at N = 16
over its gain at N = 1, (win-rate - 0.5) / (win-rate - 0.5), on the final policies, seeds averaged. The paper's
claim holds here if online DPO's retention is the highest of the four by more than the seeds' spread (the largest
half-range of any one algorithm's retention over its seeds).

A second rule, fixed on 2026-11-28 before seeds 3 and 4 ran (`--seeds 3,4`): seeds 1 and 2 showed the final policies
past the point where the `tiny` judge's win-rate stops rising (a quarter of the budget), with N = 1 runs then
over-optimising, so a final-policy retention measures that rather than robustness. The same retention is taken at
the first kept policy (25% of the budget) and at the half (50%); the paper's claim holds on the new seeds if online
DPO's retention is the highest at both, each by more than that fraction's seeds' spread. Seeds 1 and 2 suggested it;
only seeds 3 and 4 test it.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import dvc_points
import pandas as pd
from common import run_main  # bench/ is sys.path[0]
from dvc_points import OUT

from rlhf.io import write_text

ALGORITHMS = ("ppo", "rloo", "online_dpo", "bok")  # bok: best-of-2 SFT, the paper's control for DPO's two samples
MINI_BATCHES = (1, 4, 16)  # N
SEEDS = (1, 2)
STALENESS = (1, 2, 4)  # S, the asynchronous engine's lookahead
ASYNC_ALGORITHMS = ("online_dpo", "rloo")
TIS_CAP = 2.0  # truncation of the per-sequence importance weight pi_learner / pi_engine (rlhf/trainers/loop.py)
EARLY = (0.25, 0.5)  # the second rule's kept policies (fractions of the budget)
MIN_GAIN = 0.02  # a win-rate vs SFT at N = 1 within this of 0.5 is no gain: its retention is undefined
PREFIX = "op"  # experiment names: op-<algorithm>-n<N>-s<seed>, op-async-<algorithm>-S<S>[-tis]-s<seed>


def points(seeds: tuple[int, ...] = SEEDS) -> dict[str, list[str]]:
    """Every point of the experiment: its name and its `-S` settings (the staleness points with the first seed)."""
    out = {}
    for algorithm, n, seed in itertools.product(ALGORITHMS, MINI_BATCHES, seeds):
        settings = [f"train.trainer={algorithm}", f"train.num_mini_batches={n}", f"train.seed={seed}"]
        out[f"{PREFIX}-{algorithm}-n{n}-s{seed}"] = settings
    for algorithm, s in itertools.product(ASYNC_ALGORITHMS, STALENESS):
        settings = [f"train.trainer={algorithm}", "train.engine=vllm_async", f"train.max_staleness={s}"]
        out[f"{PREFIX}-async-{algorithm}-S{s}-s{seeds[0]}"] = [*settings, f"train.seed={seeds[0]}"]
    stalest = ["train.trainer=rloo", "train.engine=vllm_async", f"train.max_staleness={max(STALENESS)}"]
    stalest += [f"train.tis_cap={TIS_CAP}", f"train.seed={seeds[0]}"]
    out[f"{PREFIX}-async-rloo-S{max(STALENESS)}-tis-s{seeds[0]}"] = stalest
    return out


def dpo_variant(key: str, value: int, default: int | None, label: str, seed: int) -> tuple[str, list[str]]:
    """Online DPO's N = 1 point with one `train.<key>` set to `value`: its name and `-S` settings. At the profile's
    own value (`default`) it is the off-policy grid's point (op-online_dpo-n1-s<seed>, not run twice); else
    <label><value>-s<seed> (label "ks-online_dpo-k": ks-online_dpo-k4-s3)."""
    settings = ["train.trainer=online_dpo", "train.num_mini_batches=1", f"train.seed={seed}"]
    if value == default:
        return f"{PREFIX}-online_dpo-n1-s{seed}", settings
    return f"{label}{value}-s{seed}", [*settings, f"train.{key}={value}"]


def kept_table(kept: pd.DataFrame, column: str) -> str:
    """Markdown: per `column` value and kept policy, the seeds' mean episode, win-rate and KL, and the win-rate's
    half-range over the seeds."""
    table = kept.groupby([column, "fraction"])[["episode", "win_rate_vs_sft", "kl"]].mean().round(3).reset_index()
    spread = kept.groupby([column, "fraction"])["win_rate_vs_sft"].agg(lambda s: (s.max() - s.min()) / 2).round(3)
    table["win_rate_half_range"] = spread.values
    return table.to_markdown(index=False, floatfmt=("g", "g", ".0f", ".3f", ".2f", ".3f"))


def variant_report(stem: str, pts: dict[str, list[str]], setting: tuple[str, str, int], title: str, verdicts) -> int:
    """bench/metrics/<stem>.{csv,md} of a bench of dpo_variant points (bench/<stem>.py): every kept policy, the
    seeds' table and `verdicts(kept)` (lines). setting: (column, `-S` key, the profile's value) of what varies."""
    exps = dvc_points.experiments()
    if missing := [n for n in pts if n not in exps]:
        sys.exit(f"{stem}: not run yet: {missing}; `python bench/{stem}.py queue` runs them")
    column = setting[0]
    kept = kept_with(dvc_points.frontier_rows(exps, pts), pts, *setting)
    seeds = ", ".join(map(str, sorted(kept["seed"].unique())))
    text = f"# {title}, `tiny` (seeds {seeds})\n\n{kept_table(kept, column)}\n\n" + "\n".join(verdicts(kept)) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    write_text(OUT / f"{stem}.csv", kept.to_csv(index=False))
    write_text(OUT / f"{stem}.md", text)
    print(text + f"{stem}: -> {OUT}/{stem}.{{csv,md}}")
    return 0


def kept_with(frame: pd.DataFrame, pts: dict[str, list[str]], column: str, key: str, default: int) -> pd.DataFrame:
    """frontier rows with one more setting as `column` (its `-S` value, else the profile's `default`): one row per
    point and kept policy (fraction > 0)."""
    value = {n: int(dict(s.split("=", 1) for s in pts[n]).get(key, default)) for n in pts}
    frame = frame.assign(**{column: frame["point"].map(value)})
    return frame[frame["fraction"] > 0][[column, "seed", "fraction", "episode", "win_rate_vs_sft", "kl"]]


def retention(final: pd.DataFrame) -> pd.DataFrame:
    """Per algorithm and seed: (win-rate at the largest N - 0.5) / (win-rate at N = 1 - 0.5); NaN where N = 1 gained
    no more than MIN_GAIN over SFT."""
    grid = final[final["S"] == 0].pivot_table(index=["algorithm", "seed"], columns="N", values="win_rate_vs_sft")
    if 1 not in grid or len(grid.columns) < 2:  # nothing to compare yet
        return pd.DataFrame(columns=["algorithm", "seed", "retention"])
    gain = (grid[1] - 0.5).where(grid[1] - 0.5 > MIN_GAIN)  # no gain at N = 1: nothing to retain (NaN)
    return ((grid[grid.columns.max()] - 0.5) / gain).rename("retention").reset_index()


def tables(frame: pd.DataFrame) -> str:
    """The markdown tables: final win-rate (seeds' mean and each seed) and KL per algorithm and N; retention and
    the verdict; the staleness points."""
    final = frame[frame["fraction"] == 1.0]
    sync = final[final["S"] == 0]
    first = frame[(frame["S"] == 0) & (frame["fraction"] > 0)].groupby("point")["fraction"].transform("min")
    early = frame[(frame["S"] == 0) & (frame["fraction"] > 0)][lambda f: f["fraction"] == first]  # first kept policy
    head = "| algorithm | N | win-rate vs SFT (mean) | per seed | KL (mean) | first kept policy: win-rate, KL |"
    lines = [head, "|---|---|---|---|---|---|"]
    for (algorithm, n), g in sync.groupby(["algorithm", "N"], sort=False):
        seeds = ", ".join(f"{w:.3f}" for w in g.sort_values("seed")["win_rate_vs_sft"])
        e = early[(early["algorithm"] == algorithm) & (early["N"] == n)]
        start = f"{e['win_rate_vs_sft'].mean():.3f}, {e['kl'].mean():.2f} ({e['fraction'].min():.0%})"
        lines.append(
            f"| {algorithm} | {n} | {g['win_rate_vs_sft'].mean():.3f} | {seeds} | {g['kl'].mean():.2f} | {start} |"
        )
    kept = retention(final).dropna()
    mean, spread = retained(kept)
    largest = sync["N"].max()
    lines += ["", f"| algorithm | retention N=1 -> N={largest} (mean) | per seed |", "|---|---|---|"]
    for algorithm, r in mean.sort_values(ascending=False).items():
        seeds = ", ".join(f"{x:.2f}" for x in kept[kept["algorithm"] == algorithm]["retention"])
        lines.append(f"| {algorithm} | {r:.2f} | {seeds} |")
    lines += ["", verdict(mean, spread), "", *early_tables(frame)]
    stale = final[final["S"] > 0]
    if len(stale):
        lines += ["", "| asynchronous point | S | TIS cap | win-rate vs SFT | KL |", "|---|---|---|---|---|"]
        for _, r in stale.iterrows():
            cap = "-" if pd.isna(r["tis_cap"]) else f"{r['tis_cap']:g}"
            lines.append(f"| {r['point']} | {r['S']} | {cap} | {r['win_rate_vs_sft']:.3f} | {r['kl']:.2f} |")
    return "\n".join(lines) + "\n"


def retained(kept: pd.DataFrame) -> tuple[pd.Series, float]:
    """Each algorithm's retention, seeds averaged, and the seeds' spread: the largest half-range of one algorithm's."""
    by_algorithm = kept.groupby("algorithm")["retention"]
    return by_algorithm.mean(), float((by_algorithm.max() - by_algorithm.min()).max() / 2)


def lead(mean: pd.Series) -> tuple[str, str, float]:
    """The algorithm retaining the most, the next one, and the margin between them (two or more algorithms)."""
    best, runner_up = mean.sort_values(ascending=False).index[:2]
    return best, runner_up, float(mean[best] - mean[runner_up])


def early_tables(frame: pd.DataFrame) -> list[str]:
    """The retention at every kept policy, and the second rule (module docstring) read at EARLY."""
    sync = frame[(frame["S"] == 0) & (frame["fraction"] > 0)]
    algorithms = list(dict.fromkeys(sync["algorithm"]))
    lines = [f"| kept policy | {' | '.join(algorithms)} | most retained: margin, seeds' spread |"]
    lines.append("|---" * (len(algorithms) + 2) + "|")
    held = {}
    for fraction in sorted(sync["fraction"].unique()):
        mean, spread = retained(retention(sync[sync["fraction"] == fraction]).dropna())
        if len(mean) < 2:
            continue
        best, runner_up, margin = lead(mean)
        held[fraction] = best == "online_dpo" and margin > spread
        cells = " | ".join(f"{mean[a]:.2f}" if a in mean else "-" for a in algorithms)
        lines.append(f"| {fraction:.0%} | {cells} | {best}: {margin:.2f}, {spread:.2f} |")
    if not all(f in held for f in EARLY):
        return [*lines, "", "No verdict by the second rule: it needs the 25% and 50% kept policies."]
    holds = all(held[f] for f in EARLY)
    seeds = sorted(sync["seed"].unique())
    tested = "" if set(seeds).isdisjoint(SEEDS) else " (seeds 1 and 2 suggested the rule: this is no test of it)"
    return [
        *lines,
        "",
        f"By the second rule (retention at 25% and 50%, fixed before seeds 3 and 4 ran) the paper's claim "
        f"{'holds' if holds else 'does not hold'} on seeds {', '.join(map(str, seeds))}{tested}.",
    ]


def verdict(mean: pd.Series, spread: float) -> str:
    """The rule fixed in advance (module docstring), applied to each algorithm's mean retention."""
    if len(mean) < 2:
        return "No verdict: it needs two or more algorithms run at N = 1 and at the largest N."
    best, runner_up, margin = lead(mean)
    holds = best == "online_dpo" and margin > spread
    return (
        f"Most robust here: {best} (ahead of {runner_up} by {margin:.2f}; the seeds' spread {spread:.2f}). "
        f"The paper's claim (online DPO the most robust) {'holds' if holds else 'does not hold'} by the rule."
    )


def report(exps: dict[str, str], pts: dict[str, list[str]], seeds: tuple[int, ...] = SEEDS, replace=False) -> int:
    """bench/metrics/offpolicy.csv (every kept policy), offpolicy.md (the tables), offpolicy.png (the figure); other
    seeds than the default grid's write offpolicy_seeds<a>-<b>.* beside them. Tables that hold points this project
    has not run (committed from another machine) are kept unless `replace`."""
    from rlhf.stages.report import offpolicy_png

    frame = dvc_points.frontier_rows(exps, pts)
    if frame.empty:
        sys.exit("offpolicy: no finished point yet: run `make offpolicy` (or `python bench/offpolicy.py queue`)")
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "offpolicy" if seeds == SEEDS else f"offpolicy_seeds{'-'.join(map(str, seeds))}"
    before = OUT / f"{stem}.csv"
    dropped = sorted(set(pd.read_csv(before)["point"]) - set(frame["point"])) if before.is_file() else []
    if dropped and not replace:
        sys.exit(
            f"offpolicy: {before} holds {len(dropped)} point(s) not among this project's finished experiments (e.g. "
            f"{dropped[0]}): a report now would drop them; `queue` runs them here, `report --replace` writes without"
        )
    write_text(OUT / f"{stem}.csv", frame.to_csv(index=False))
    text = tables(frame)
    write_text(OUT / f"{stem}.md", text)
    (OUT / f"{stem}.png").write_bytes(offpolicy_png(frame))
    print(text + f"offpolicy: {frame['point'].nunique()} of {len(pts)} points -> {OUT}/{stem}.{{csv,md,png}}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="every point: its name and its -S settings")
    q = sub.add_parser("queue", help="queue the missing points and run them")
    dvc_points.add_jobs(q)
    r = sub.add_parser("report", help="the table and the figures")
    r.add_argument("--replace", action="store_true", help="write the tables even where they drop points they hold")
    for p in (listing, q, r):
        p.add_argument("--only", help="comma-separated point names (default: every point)")
        p.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="RL seeds of the grid (default: 1,2)")
    args = ap.parse_args(argv)
    try:
        seeds = tuple(int(x) for x in args.seeds.split(","))
    except ValueError:
        sys.exit(f"offpolicy: --seeds: comma-separated integers, got {args.seeds!r}")
    pts = points(seeds)
    if args.only:
        chosen = [n.strip() for n in args.only.split(",")]
        if unknown := [n for n in chosen if n not in pts]:
            sys.exit(f"offpolicy: --only: unknown point(s) {unknown}; `python bench/offpolicy.py list` names them")
        pts = {n: pts[n] for n in chosen}
    if args.command == "list":
        print(dvc_points.point_lines(pts))
        return 0
    if args.command == "queue":
        return dvc_points.queue(pts, args.jobs)
    dvc_points.keep(exps := dvc_points.experiments(), pts)
    return report(exps, pts, seeds, args.replace)


if __name__ == "__main__":
    sys.exit(run_main(main))
