"""`rlhf report`: the pipeline's results for a person to look at.

Prints the headline metrics as a table (what `make run` ends with) and writes data/report/index.html: one static
page, the charts inlined as PNGs (matplotlib), nothing to serve and nothing fetched. Its sections:
  1. the headline metrics (data/metrics/*.json)
  2. the frontier: gold win-rate vs SFT against KL(policy || SFT) at the policies kept through training
  3. proxy reward, gold score and KL over episodes (data/plots/train.csv)
  4. a training step's time by phase, per batch (stacked bars)
  5. async runs: the engine's and the learner's time per batch side by side, and the share of the engine's work
     the learner never waited for
A section whose data is missing (a stage not run yet, a synchronous run) says so instead of a chart.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import pandas as pd

from rlhf.config import Config
from rlhf.io import atomic_dir, read_json, write_text
from rlhf.tracking import log_results

HEADLINES = {
    "gold": ["accuracy", "verifier_reads_worked_answers"],  # the second: the math task's (rule verifier)
    "reward": ["agreement_heldout", "n_pairs"],
    "train": [
        "first/objective/scores",
        "final/objective/scores",
        "first/objective/gold",
        "final/objective/gold",
        "final/objective/kl",
    ],
    "eval": [
        "gold/win_rate_vs_sft",
        "gold/win_rate_vs_reference",
        "gold/sft_win_rate_vs_reference",
        "gold/policy",
        "gold/sft",
        "accuracy/policy",  # the math task's: exact match, near-greedy
        "accuracy/sft",
        "accuracy/gain",
        "kl/policy_sft_mean",
        "proxy/policy",
        "proxy/sft",
    ],
}
# The learner's side of a step (timing/* in train.csv, docs/metrics.md): a synchronous run generates inside it.
LEARNER_PHASES = ("scoring", "reference", "update", "weight_sync")
TIMELINE_BATCHES = 8  # the timeline shows batches 2-9: enough to see the overlap, few enough to read it
ENGINE_PHASES = ("engine_idle", "weight_sync_engine", "generation", "scoring_engine")
SECTIONS = ("Headline metrics", "Frontier", "Over episodes", "Step time by phase", "Engine and learner timeline")
STYLE = (
    "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}td{padding:2px 12px}img{max-width:100%}</style>"
)


def headline_rows(cfg: Config) -> list[tuple[str, str, str]]:
    """(stage, metric, value) for each headline metric; (stage, "(not run)", "") for a stage without metrics."""
    rows = []
    for stage, keys in HEADLINES.items():
        path = cfg.path("metrics", f"{stage}.json")
        if not path.exists():
            rows.append((stage, "(not run)", ""))
            continue
        metrics = read_json(path)
        rows += [(stage, key, _format(metrics[key])) for key in keys if key in metrics]
    return rows


def print_report(cfg: Config) -> int:
    rows = headline_rows(cfg)
    width = max(len(r[1]) for r in rows)
    print(f"profile {cfg.profile}, trainer {cfg.train.trainer}")
    for stage, key, value in rows:
        print(f"  {stage:<7} {key:<{width}}  {value}")
    page, charts = write_report(cfg)
    log_results(cfg, "report", {}, images=charts)
    print(f"report: {page}")
    return 0


def write_report(cfg: Config) -> tuple[Path, dict[str, bytes]]:
    """data/report/index.html; its path and its charts (section title -> PNG)."""
    steps = _read_csv(cfg.path("plots", "train.csv"))
    frontier = _read_csv(cfg.path("plots", "frontier.csv"))
    charts = {
        SECTIONS[1]: _png(_frontier_chart, frontier),
        SECTIONS[2]: _png(_episodes_chart, steps, panels=3),
        SECTIONS[3]: _png(_phases_chart, steps),
        SECTIONS[4]: _png(_timeline_chart, _async_only(steps)),
    }
    notes = {
        SECTIONS[1]: "run the evaluate stage",
        SECTIONS[2]: "run the train stage",
        SECTIONS[3]: "run the train stage",
    }
    body = [f"<h1>asyncrlhf: profile {_e(cfg.profile)}, trainer {_e(cfg.train.trainer)}</h1>"]
    body.append(_section(SECTIONS[0], _table(headline_rows(cfg))))
    for title in SECTIONS[1:4]:
        body.append(_section(title, _img(charts[title]) if charts[title] else f"<p>No data yet: {notes[title]}.</p>"))
    body.append(_section(SECTIONS[4], _timeline_text(steps) + _img(charts[SECTIONS[4]])))
    page = f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>asyncrlhf report</title>{STYLE}</head>"
    page += f"<body>{''.join(body)}</body></html>\n"
    with atomic_dir(cfg.path("report")) as tmp:
        write_text(tmp / "index.html", page)
    return cfg.path("report", "index.html"), {title: png for title, png in charts.items() if png}


def _frontier_chart(ax, frontier: pd.DataFrame) -> None:
    ax.plot(frontier["kl"], frontier["win_rate_vs_sft"], marker="o")
    for _, r in frontier.iterrows():
        ax.annotate(f"{r['fraction']:.0%}", (r["kl"], r["win_rate_vs_sft"]), textcoords="offset points", xytext=(4, 4))
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="KL(policy || SFT), nats per sequence", ylabel="gold win-rate vs SFT", title="labels: share of run")


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


def _table(rows: list[tuple[str, str, str]]) -> str:
    cells = "".join(f"<tr><td>{_e(s)}</td><td>{_e(k)}</td><td>{_e(v)}</td></tr>" for s, k, v in rows)
    return f"<table>{cells}</table>"


def _read_csv(path) -> pd.DataFrame | None:
    return pd.read_csv(path) if path.exists() else None


def _format(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _e(text: str) -> str:
    return html.escape(str(text))
