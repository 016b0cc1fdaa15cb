"""What a training run's logged rows add up to: its final metrics, and a hint its timings give."""

from __future__ import annotations

from rlhf.config import TrainConfig
from rlhf.tracking import is_wall_clock

HINT_SECONDS = 2.0  # a first wait for the engine worth filling with the learner's own batches
TIED_TEMPERATURE = 0.05  # sampling colder than this, a prompt's k samples are nearly always one text


def final_metrics(rows: list[dict], state) -> dict:
    """Results only: `final/<metric>` = the mean over the last quarter of the rows, the first batch's scores, gold
    and EOS rate, episodes and optimizer steps (state: the loop's checkpoint.LoopState). Wall-clock figures (timing/*,
    eps) differ between identical runs: they go to timing/train.csv (rlhf.tracking)."""
    last = rows[-max(1, len(rows) // 4) :]
    final = {f"final/{k}": v for k, v in mean_stats(last).items() if not (is_wall_clock(k) or k.startswith("train/"))}
    final.update({"episodes": state.episode, "optimizer_steps": state.global_step})
    first = rows[0] if rows else {}
    kept = ("objective/scores", "objective/gold", "completions/eos_rate")  # a policy that stops ending shows
    final.update({f"first/{k}": first[k] for k in kept if k in first})
    return final


def mean_stats(rows: list[dict]) -> dict[str, float]:
    """Mean of each key over the rows that have it."""
    keys = {k for r in rows for k in r}
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


def start_up_hint(c: TrainConfig, rows: list[dict]) -> str | None:
    """One line when an async run's learner waited long for the engine to start, and nothing filled the wait: the
    setting that would have had it sample its own first batches meanwhile, with a value for it; None otherwise.

    The value: the wait over a synchronous step's seconds, estimated from the later batches as the learner's own
    work (the step less its wait) plus the engine's generation and scoring of a batch (`tiny` on 2 cores: 4.1 s /
    0.44 s, 9; the benchmark's rule, over a measured one-thread sync step, gave 10)."""
    wait = rows[0].get("timing/wait", 0.0) if rows else 0.0
    if c.learner_first_batches or wait < HINT_SECONDS:
        return None
    later = rows[1:]
    keys = ("timing/step", "timing/wait", "timing/generation", "timing/scoring_engine")
    step, waits, generation, scoring = (sum(r.get(k, 0.0) for r in later) / max(1, len(later)) for k in keys)
    sync_step = step - waits + generation + scoring
    value = f"{max(1, round(wait / sync_step))}" if later and sync_step > 0 else "W"
    return (
        f"the learner waited {wait:.1f} s for the engine to start: train.learner_first_batches={value} would have "
        'had it sample its own first batches meanwhile (README.md, "Asynchronous generation")'
    )


def empty_updates_warning(c: TrainConfig, rows: list[dict]) -> str | None:
    """One line when no logged batch's update changed anything (a gradient norm of 0 in each, or no valid pair in
    any): the run ended, and learned nothing. It names the likely setting: a temperature so low that a prompt's k
    samples are one text, else the reward, which then scored them alike. None when any batch had a gradient."""
    norms = [r["policy/grad_norm"] for r in rows if "policy/grad_norm" in r]
    pairs = [r["objective/valid_pairs"] for r in rows if "objective/valid_pairs" in r]
    if not ((norms and max(norms) == 0) or (pairs and max(pairs) == 0)):
        return None
    if c.temperature < TIED_TEMPERATURE:
        cause = f"train.temperature={c.temperature:g}: a prompt's {c.k} samples come out as one text"
    else:
        cause = f"train.reward={c.reward}: it scored every sample of a prompt alike"
    return f"warning: every update of the {len(rows)} batches was empty (no gradient): nothing was learned; {cause}"
