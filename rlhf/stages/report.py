"""Stage `report`: the pipeline's results for a person to look at.

The last dvc.yaml stage, so `dvc exp run` redraws the page with the experiment's results and `dvc exp apply` / `dvc
checkout` bring back the page of the results in the workspace. Prints the headline metrics as a table (what `make
run` ends with) and writes data/report/index.html: one static page, the charts inlined as PNGs (matplotlib),
nothing to serve and nothing fetched. Its sections:
  1. the headline metrics (data/metrics/*.json)
  2. the frontier: gold win-rate vs SFT against KL(policy || SFT) at the policies kept through training
  3. proxy reward, gold score and KL over episodes (data/plots/train.csv)
  4. a training step's time by phase, per batch (stacked bars)
  5. async runs: the engine's and the learner's time per batch side by side, and the share of the engine's work
     the learner never waited for
  6. the off-policy grid (`make offpolicy`, bench/metrics/offpolicy.csv): win-rate vs KL per algorithm, a colour per N
A section whose data is missing (a stage not run yet, a synchronous run) says so instead of a chart.
"""

from __future__ import annotations

import base64
import html
import io
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from rlhf.config import DEFAULT_PARAMS, Config, changed_settings, profile_note
from rlhf.io import atomic_dir, read_csv, read_json, write_text
from rlhf.tracking import log_results, row_files, same_run

# The headline metrics per stage, in the order shown: key -> (readable name, unit, what it means).
WIN = "share of eval prompts"
HEADLINES: dict[str, dict[str, tuple[str, str, str]]] = {
    "gold": {
        "accuracy": (
            "gold judge accuracy",
            "share of pairs",
            "the gold judge agrees with human labels on held-out pairs",
        ),
        "verifier_reads_worked_answers": ("verifier reads answers", "share", "the math rule verifier parses answers"),
    },
    "reward": {
        "agreement_heldout": ("reward model agreement", "share of pairs", "the proxy RM prefers what gold prefers"),
        "n_pairs": ("preference pairs", "pairs", "pairs the proxy reward model was trained on"),
    },
    "train": {
        "first/objective/scores": ("proxy reward, first batch", "RM score", "the reward model's score at the start"),
        "final/objective/scores": ("proxy reward, end", "RM score", "the same over the last quarter of training"),
        "first/objective/gold": ("gold score, first batch", "gold score", "the gold judge's score at the start"),
        "final/objective/gold": ("gold score, end", "gold score", "the same over the last quarter of training"),
        "final/objective/kl": ("KL to SFT, end", "nats/sequence", "how far the samples moved from SFT, late"),
    },
    "eval": {
        "gold/win_rate_vs_sft": ("gold win-rate vs SFT", WIN, "gold prefers the policy's answer to SFT's (0.5: even)"),
        "gold/win_rate_vs_reference": ("gold win-rate vs reference", WIN, "the same against the real continuations"),
        "gold/sft_win_rate_vs_reference": ("SFT win-rate vs reference", WIN, "SFT's against the real continuations"),
        "gold/policy": ("gold score, policy", "gold score", "the gold judge's mean score: the true objective"),
        "gold/sft": ("gold score, SFT", "gold score", "the same for the SFT policy (the start)"),
        "accuracy/policy": ("accuracy, policy", "share of problems", "exact-match answers (math task)"),
        "accuracy/sft": ("accuracy, SFT", "share of problems", "the same for the SFT policy"),
        "accuracy/gain": ("accuracy gain", "share of problems", "policy minus SFT"),
        "kl/policy_sft_mean": ("KL to SFT", "nats/sequence", "how far the policy moved from SFT: the price paid"),
        "proxy/policy": ("proxy reward, policy", "RM score", "the learned reward model's score: what was optimised"),
        "proxy/sft": ("proxy reward, SFT", "RM score", "the same for the SFT policy"),
        "diversity/policy_distinct_2": ("distinct bigrams, policy", "share", "bigrams not repeated across prompts"),
        "diversity/sft_distinct_2": ("distinct bigrams, SFT", "share", "the same for the SFT policy"),
        "diversity/policy_repeated": ("repeated responses, policy", "share", "the same text for several prompts"),
        "n_prompts": ("eval prompts", "prompts", "held-out prompts the numbers above are over"),
    },
}

# The learner's side of a step (timing/* in train.csv, docs/metrics.md): a synchronous run generates inside it.
LEARNER_PHASES = ("scoring", "reference", "update", "weight_sync")
TIMELINE_BATCHES = 8  # the timeline shows batches 2-9: enough to see the overlap, few enough to read it
ENGINE_PHASES = ("engine_idle", "weight_sync_engine", "generation", "scoring_engine")
SECTIONS = (
    "Headline metrics",
    "Frontier",
    "Over episodes",
    "Step time by phase",
    "Engine and learner timeline",
    "Off-policy grid (make offpolicy)",
)
OFFPOLICY_CSV = Path("bench", "metrics", "offpolicy.csv")  # `make offpolicy`'s, in the project the report runs in
STYLE = (
    "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}td,th{padding:2px 12px;text-align:left}"
    "img{max-width:100%}</style>"
)


def headline_rows(cfg: Config) -> list[tuple[str, str, str, str, str]]:
    """(stage, name, value, unit, meaning) per headline metric; (stage, "(not run)", "", "", "") for a stage without
    metrics."""
    rows = []
    for stage in HEADLINES:
        path = cfg.path("metrics", f"{stage}.json")
        if not path.exists():
            rows.append((stage, "(not run)", "", "", ""))
            continue
        rows += [(stage, *row) for row in named_metrics(stage, read_json(path))]
    return rows


def named_metrics(stage: str, metrics: dict) -> list[tuple[str, str, str, str]]:
    """(readable name, value to 3 significant digits, unit, meaning) of `stage`'s headline metrics present."""
    return [
        (name, _format(metrics[k]), unit, meaning)
        for k, (name, unit, meaning) in HEADLINES[stage].items()
        if k in metrics
    ]


def run_header(cfg: Config, changed: dict[str, tuple] | None = None) -> list[tuple[str, str]]:
    """(field, value) describing the run: date, commit, profile (and its note), trainer, changed parameters."""
    header = [
        ("date", datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")),
        ("commit", _commit()),
        ("profile", cfg.profile),
        ("trainer", cfg.train.trainer),
    ]
    if note := profile_note(cfg.profile):
        header.append(("note", note))
    if changed is not None:
        shown = ", ".join(f"{k}={new} (profile: {old})" for k, (old, new) in changed.items())
        header.append(("changed parameters", shown or "none (the profile's values)"))
    return header


def _commit() -> str:
    """`git rev-parse --short HEAD`, "+ changes" when tracked code differs from it (params.yaml, dvc.lock and the
    pipeline's outputs aside: those a run changes, and the parameters are listed on their own)."""
    git = ["git", "-C", os.getcwd()]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    changed = [line[3:] for line in status.stdout.splitlines()]
    ours = [f for f in changed if f not in ("params.yaml", "dvc.lock") and not f.startswith("data/")]
    return head.stdout.strip() + (" + changes" if ours else "")


def run(cfg: Config, params: Path | str = DEFAULT_PARAMS) -> dict:
    """Print the header and headline table, write the page, log its charts to W&B. `params`: the file whose profile
    the header's changed parameters are measured against."""
    changed = changed_settings(cfg, params)
    for field, value in run_header(cfg, changed):
        print(f"{field}: {value}")
    rows = headline_rows(cfg)
    width = max(len(r[1]) for r in rows)
    for stage, name, value, unit, _ in rows:
        print(f"  {stage:<7} {name:<{width}}  {value} {unit}".rstrip())
    page, charts = write_report(cfg, changed)
    log_results(cfg, "report", {}, images=charts)
    print(f"report: {page}")
    return {}


def write_report(cfg: Config, changed: dict[str, tuple] | None = None) -> tuple[Path, dict[str, bytes]]:
    """data/report/index.html; its path and its charts (section title -> PNG). `changed`: the parameters set on top
    of the profile (rlhf.config.changed_settings), listed in the header."""
    steps = _logged(cfg)
    frontier = _read_csv(cfg.path("plots", "frontier.csv"))
    charts = {
        SECTIONS[1]: _png(_frontier_chart, frontier),
        SECTIONS[2]: _png(_episodes_chart, steps, panels=3),
        SECTIONS[3]: _png(_phases_chart, steps),
        SECTIONS[4]: _png(_timeline_chart, _async_only(steps)),
        SECTIONS[5]: offpolicy_png(_read_csv(OFFPOLICY_CSV)),
    }
    notes = {
        SECTIONS[1]: "run the evaluate stage",
        SECTIONS[2]: "run the train stage",
        SECTIONS[3]: "run the train stage",
    }
    body = [f"<h1>asyncrlhf: profile {_e(cfg.profile)}, trainer {_e(cfg.train.trainer)}</h1>"]
    body.append("<table class='header'>" + "".join(_row(f, v, tag="th") for f, v in run_header(cfg, changed)))
    body.append("</table>")
    body.append(_section(SECTIONS[0], _table(["stage", "metric", "value", "unit", "meaning"], headline_rows(cfg))))
    for title in SECTIONS[1:4]:
        body.append(_section(title, _img(charts[title]) if charts[title] else f"<p>No data yet: {notes[title]}.</p>"))
    body.append(_section(SECTIONS[4], _timeline_text(steps) + _img(charts[SECTIONS[4]])))
    grid = "<p>Not run yet: `make offpolicy` (README: which algorithm survives off-policy data).</p>"
    body.append(_section(SECTIONS[5], _img(charts[SECTIONS[5]]) if charts[SECTIONS[5]] else grid))
    page = f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>asyncrlhf report</title>{STYLE}</head>"
    page += f"<body>{''.join(body)}</body></html>\n"
    with atomic_dir(cfg.path("report")) as tmp:
        write_text(tmp / "index.html", page)
    return cfg.path("report", "index.html"), {title: png for title, png in charts.items() if png}


def _frontier_chart(ax, frontier: pd.DataFrame) -> None:
    """The points joined in training order (episode), each named in a legend: labels beside the points overlapped."""
    ordered = frontier.sort_values("episode")
    ax.plot(ordered["kl"], ordered["win_rate_vs_sft"], color="grey", lw=1, zorder=1)
    for i, (_, r) in enumerate(ordered.iterrows()):
        label = f"episode {int(r['episode'])} ({r['fraction']:.0%} of the run)" if r["episode"] else "SFT (episode 0)"
        ax.scatter(r["kl"], r["win_rate_vs_sft"], color=f"C{i}", zorder=2, label=label)
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="KL(policy || SFT), nats per sequence", ylabel="gold win-rate vs SFT", title="in training order")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def offpolicy_png(grid: pd.DataFrame | None) -> bytes | None:
    """The paper's Fig. 4 layout: a panel per algorithm, gold win-rate vs SFT against KL at the kept policies of the
    synchronous grid points, a colour per N (mini-batches per generated batch), a line per seed in training order."""
    sync = grid[grid["S"] == 0] if grid is not None and "S" in grid else None
    if sync is None or sync.empty:
        return None
    algorithms = list(dict.fromkeys(sync["algorithm"]))
    colours = {n: f"C{i}" for i, n in enumerate(sorted(sync["N"].unique()))}

    def draw(axes, frame):
        for ax, algorithm in zip(axes if len(algorithms) > 1 else [axes], algorithms):
            for (n, _), run in frame[frame["algorithm"] == algorithm].groupby(["N", "seed"]):
                run = run.sort_values("episode")
                label = f"N = {n}"
                label = None if label in ax.get_legend_handles_labels()[1] else label  # one entry per N, not per seed
                ax.plot(run["kl"], run["win_rate_vs_sft"], "o-", color=colours[n], ms=3, lw=1, label=label)
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")
            ax.set(title=algorithm, xlabel="KL(policy || SFT)", ylabel="gold win-rate vs SFT")
            # one scale in every panel: the panels are compared with each other
            ax.set(xlim=(-0.5, frame["kl"].max() * 1.05 + 0.5), ylim=(0.45, frame["win_rate_vs_sft"].max() + 0.03))
        (axes[-1] if len(algorithms) > 1 else axes).legend(fontsize="small", loc="lower right")

    return _png(draw, sync, panels=len(algorithms))


def _episodes_chart(axes, steps: pd.DataFrame) -> None:
    for ax, (key, label) in zip(
        axes, [("objective/scores", "proxy reward"), ("objective/gold", "gold score"), ("objective/kl", "KL")]
    ):
        ax.plot(steps["train/episode"], steps[key])
        ax.set(xlabel="episode", title=label)


def _phases_chart(ax, steps: pd.DataFrame) -> None:
    first = "wait" if "timing/wait" in steps else "generation"  # what the learner spent on getting the batch
    phases = [p for p in (first, *LEARNER_PHASES) if f"timing/{p}" in steps]
    later = steps.iloc[1:] if len(steps) > 1 else steps  # batch 1 carries start-up and warm-up: off the scale
    bottom = pd.Series(0.0, index=later.index)
    for phase in phases:
        ax.bar(later.index + 1, later[f"timing/{phase}"], bottom=bottom, label=phase)
        bottom += later[f"timing/{phase}"]
    ax.bar(later.index + 1, (later["timing/step"] - bottom).clip(lower=0), bottom=bottom, label="other")
    title = f"a training step, by phase (learner); batch 1 ({steps['timing/step'].iloc[0]:.1f} s, start-up) left out"
    ax.set(xlabel="batch", ylabel="seconds", title=title if len(steps) > 1 else "a training step, by phase (learner)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def _async_only(steps: pd.DataFrame | None) -> pd.DataFrame | None:
    """Batches 2 to 1 + TIMELINE_BATCHES of an async run (timing/wait logged), for the timeline; None for other
    runs. The first batch is left out: its wait holds the engine's start-up, which the chart has no lane for."""
    return steps.iloc[1 : 1 + TIMELINE_BATCHES] if steps is not None and "timing/wait" in steps else None


def _timeline_text(steps: pd.DataFrame | None) -> str:
    """Section 5's text: the first batch's wait, then how much of the engine's work the learner never waited for."""
    if steps is None:
        return "<p>No data yet: run the train stage.</p>"
    if _async_only(steps) is None:
        return "<p>Not an asynchronous run: the learner generates each batch itself (section 4).</p>"
    first, rest = steps.iloc[0], steps.iloc[1:]
    busy = sum(rest[f"timing/{p}"].sum() for p in ENGINE_PHASES[1:] if f"timing/{p}" in rest)
    waited = rest["timing/wait"].sum()
    hidden = f"{1 - waited / busy:.0%}" if busy > 0 else "all"
    return (
        f"<p>The first batch waited {first['timing/wait']:.1f} s: the engine's start-up and its first generation, "
        f"which nothing overlaps. After it the engine worked {busy:.1f} s (reloading weights, generating, scoring) "
        f"while the learner waited {waited:.1f} s for batches: {hidden} of the engine's work overlapped the "
        f"learner's and cost no time. The chart lays each side's phases end to end from their durations, batches 2 "
        f"to {1 + TIMELINE_BATCHES}.</p>"
    )


def _timeline_chart(ax, steps: pd.DataFrame) -> None:
    sides = [("learner", ("wait", *LEARNER_PHASES)), ("engine", ENGINE_PHASES)]
    colors = {}
    for row, (_, phases) in enumerate(sides):
        start = 0.0
        for _, r in steps.iterrows():
            for phase in phases:
                length = float(r.get(f"timing/{phase}", 0.0) or 0.0)
                color = colors.setdefault(phase, f"C{len(colors)}")
                ax.broken_barh([(start, length)], (row - 0.4, 0.8), color=color, label=phase)
                start += length
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize="small", ncol=4, loc="upper left", bbox_to_anchor=(0, -0.2))
    ax.set(yticks=[0, 1], yticklabels=[s for s, _ in sides], xlabel="seconds", title="each side's time, end to end")


def _png(draw, data: pd.DataFrame | None, panels: int = 1) -> bytes | None:
    """draw(axes, data) as a PNG, or None without data."""
    if data is None or data.empty:
        return None
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    fig = Figure(figsize=(11, 3.2) if panels > 1 else (8, 4), layout="constrained")
    draw(fig.subplots(1, panels) if panels > 1 else fig.subplots(), data)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _img(png: bytes | None) -> str:
    return f"<img alt='chart' src='data:image/png;base64,{base64.b64encode(png).decode()}'>" if png else ""


def _section(title: str, content: str) -> str:
    return f"<h2>{_e(title)}</h2>{content}"


def _table(columns: list[str], rows: list[tuple]) -> str:
    head = "".join(f"<th>{_e(c)}</th>" for c in columns)
    return f"<table><tr>{head}</tr>{''.join(_row(*r) for r in rows)}</table>"


def _row(*cells: str, tag: str = "td") -> str:
    first, *rest = cells
    return f"<tr><{tag}>{_e(first)}</{tag}>" + "".join(f"<td>{_e(c)}</td>" for c in rest) + "</tr>"


def _logged(cfg: Config) -> pd.DataFrame | None:
    """The train stage's rows: the results (plots/train.csv) with their wall-clock columns beside them
    (timing/train.csv, rlhf.tracking)."""
    results, clock = row_files(cfg.data_dir)
    steps, timing = _read_csv(results), _read_csv(clock)
    if steps is None or timing is None:
        return steps
    same_run(clock, len(timing), results, len(steps))
    return steps.join(timing.drop(columns=[c for c in timing if c in steps]))


def _read_csv(path) -> pd.DataFrame | None:
    return read_csv(path) if path.exists() else None


def _format(value) -> str:
    """Three significant digits for a float, trailing zeros kept (1.999 reads 2.00 beside 2.01, not 2): what the
    metrics carry past that is noise."""
    return f"{value:#.3g}".rstrip(".") if isinstance(value, float) else str(value)


def _e(text: str) -> str:
    return html.escape(str(text))
