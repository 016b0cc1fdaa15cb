"""A generated batch's one device-to-host read, after its update (rlhf.trainers.loop, step 9).

Everything the loop wants to know about a batch (its metrics, whether its numbers stayed finite, this rank's scores
for the completions table) stays on the device until the batch's update is queued, then comes back in one read.
A read inside a micro-step (an `.item()`, a tensor's truth value) makes the host wait for every kernel queued before
it: on a GPU the device then idles while the host prepares the next kernels, at every read.

Checks come after the update, before the engine gets the new weights and before anything is saved: a run whose
numbers went bad stops at the batch where they did, and its last good checkpoint stays as it was. (Checked inside
the micro-step, as before, the optimizer step was skipped too; the weights it spoils now are never used.)
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from rlhf.models.batch import host_list, to_device
from rlhf.trainers import checkpoint

LOSS = "check/loss"  # each micro-step's total loss, in its stats: read with the rest, never logged
BAD_SCORES = "check/nonfinite_scores"
TRAIL = (("loss", LOSS), ("the gradient norm", "policy/grad_norm"))  # what a micro-step can spoil, in order


@dataclass
class Readback:
    row: dict[str, float]  # the batch's metrics, each averaged over the training processes
    scores: list[float]  # this rank's scores (N,), after the missing-EOS penalty
    gold: list[float] | None  # this rank's gold scores (N,), when the task has a gold


def read_batch(run, t: int, col, step_stats: list[dict[str, torch.Tensor]]) -> Readback:
    """Batch t's metrics (the objective's, its micro-steps' means, the rollout's) in one read; stops the run when its
    scores, loss or gradient norm are not finite. col: the loop's Collected batch."""
    r = col.rollout
    step_keys, step_means = _means(step_stats)
    stats = {k: v for k, v in col.stats.items() if k not in step_keys}  # a micro-step metric of that name wins
    stats.update(
        {
            "objective/scores": r.scores.mean(),
            "objective/entropy": (-r.logp).sum(1).mean(),
            "completions/mean_length": r.response_mask.sum(1).float().mean(),
            "completions/eos_rate": col.inputs.has_eos.float().mean(),
            BAD_SCORES: (~torch.isfinite(r.scores)).sum(),
        }
    )
    if r.is_weight is not None:
        stats["policy/is_weight"] = r.is_weight.mean()
    # the host decodes and scores the gold (scikit-learn, or the verifier) while the device runs the update queued
    gold = gold_scores(run, col) if run.gold is not None else None
    device = run.acc.device
    if gold is not None:
        stats["objective/gold"] = to_device(gold.mean(), device)  # the judge scores on the host
    batch_keys = sorted(stats)
    keys = batch_keys + step_keys  # every rank reduces in the same order
    # one stack and one cat (promoted to the widest dtype: exact), one cast, not a conversion a metric; metrics are
    # tensors on the device already (rlhf.trainers.objectives), so none is converted: even a no-op conversion is an op
    local = torch.cat([torch.stack([stats[k] for k in batch_keys]), step_means]).float()
    reduced = run.acc.reduce(local, reduction="mean")
    trail = [(name, s[key]) for s in step_stats for name, key in TRAIL if key in s]  # micro-step order
    this_rank = [r.scores, torch.stack([v for _, v in trail])]  # on the device, float (cat promotes: exact)
    values = torch.cat([reduced, *this_rank]).tolist()  # the read
    row, scores = dict(zip(keys, values[: len(keys)])), values[len(keys) : len(keys) + len(r.scores)]
    _check_finite(run, t, row, len(scores), zip([name for name, _ in trail], values[len(keys) + len(scores) :]))
    return Readback(row, scores, None if gold is None else host_list(gold))


def gold_scores(run, col) -> torch.Tensor:
    """The gold of the batch's samples (N,), on the host: the judge reads the responses as text."""
    return run.gold(col.host, texts_of(run, col))


def texts_of(run, col) -> list[str]:
    """The batch's responses as text, decoded by whichever reads them first (a reward that reads text, the gold, the
    completions table), then kept: a run whose reward reads tokens and that logs no gold decodes nothing."""
    if col.texts is None:
        col.texts = col.host.texts(run.tokenizer)
    return col.texts


def _means(step_stats: list[dict[str, torch.Tensor]]) -> tuple[list[str], torch.Tensor]:
    """Each metric's name and its mean over the micro-steps that have it (M,), summed in float64 in micro-step order
    (as the Python floats it replaces), kept as one tensor: the read-back stacks it whole. When every micro-step has
    the same metrics (the usual case), one stack and one mean over the steps (3 ops); else one stack and one
    index_add for all (8; a stack and a mean a metric were ~4 ops each)."""
    if not step_stats:
        return [], torch.zeros(0, dtype=torch.float64)
    values = torch.stack([v for s in step_stats for v in s.values()]).double()
    first = list(step_stats[0])
    if all(list(s) == first for s in step_stats):  # the steps' sum runs over dim 0 in order: the same bits
        return first, values.view(len(step_stats), len(first)).mean(0)
    keys = sorted({k for s in step_stats for k in s})
    slot = {k: i for i, k in enumerate(keys)}
    where = [slot[k] for s in step_stats for k in s]
    index = to_device(torch.tensor(where), values.device)
    sums = torch.zeros(len(keys), dtype=torch.float64, device=values.device).index_add_(0, index, values)
    times = Counter(where)
    counts = to_device(torch.tensor([times[i] for i in range(len(keys))], dtype=torch.float64), values.device)
    return keys, sums / counts


def _check_finite(run, t: int, row: dict[str, float], n: int, trail) -> None:
    """Stop at batch t when its scores, a loss or a gradient norm is not finite on any rank (the reduced means say
    so on every rank alike), naming the first that went bad here: the scores, then each micro-step's loss and
    gradient norm in order (trail: (name, value) pairs)."""
    c = run.cfg.train
    bad = round(row.pop(BAD_SCORES) * run.acc.num_processes)
    loss, norm = row.pop(LOSS), row.get("policy/grad_norm", 0.0)
    if bad:
        what = f"the reward ({c.reward}) returned NaN/inf for {bad} of {n * run.acc.num_processes} samples"
        raise stopped(run, t, what)
    if math.isfinite(loss) and math.isfinite(norm):
        return
    for name, value in trail:
        if not math.isfinite(value):  # a finite loss can still overflow in its backward
            raise stopped(run, t, f"{name} became {value}")
    raise stopped(run, t, f"loss became {loss} on another training process")


def stopped(run, t: int, what: str) -> RuntimeError:
    """The error that stops a run whose numbers went bad at batch t, saying what a re-run resumes from."""
    c, last = run.cfg.train, checkpoint.latest(run.ckpt_dir)[0]
    if last is not None:
        where = f"the last good checkpoint, {last}, is intact: fix the cause and run the stage again to resume from it"
    else:
        where = "no checkpoint was saved yet" + (" (train.save_every=0)" if not c.save_every else "")
    return RuntimeError(f"{what} at batch {t} (trainer {c.trainer}); {where}")
