"""The one online RLHF loop: every trainer is this loop x an objective x a generation engine.

One iteration (numbered as in shared/design/architecture.md), each step group one call:
  1. next prompt batch  2. completions from the engine  3. truncate at EOS  4. score (+ missing-EOS penalty)
  5. behaviour/reference log-probs (+ values)  6. the objective's view of the batch      -> collect
  7. M mini-batches x E epochs of updates                                               -> update
  8. the batch's metrics and checks, read from the device once                          -> read_batch
  9. weight sync to the engine (versioned)                                              -> sync
 10. metrics logged, checkpoint                                                         -> log, save
 11. the garbage collector, every train.gc_every batches (off inside steps)             -> collect_garbage
Setup (models, optimizer, engine, prompts) is rlhf.trainers.setup; checkpoint files rlhf.trainers.checkpoint.

Nothing between steps 3 and 8 reads a tensor back from the device: on a GPU the host queues the whole batch's
work ahead of the device (rlhf.trainers.readback). Bookkeeping (prompt order, micro-batch shapes) stays on the host.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from rlhf.algorithms import decoupled
from rlhf.algorithms.common import apply_missing_eos_penalty
from rlhf.config import Config, config_yaml
from rlhf.generation.base import Generated
from rlhf.generation.weights import full_weights
from rlhf.io import after_publishing, atomic_dir, read_json, write_text
from rlhf.models.batch import (
    ModelInput,
    assemble,
    host_list,
    micro_batch_columns,
    row_chunks,
    to_device,
    trim_padding,
)
from rlhf.models.forward import cat_rows, reference_logprobs, response_logprobs, response_logprobs_and_values
from rlhf.models.loading import save_policy
from rlhf.runtime import collect_garbage, crash_point, scheduled_gc, seconds_since_start
from rlhf.tracking import Tracker
from rlhf.trainers import checkpoint, frontier
from rlhf.trainers.early import EarlyStart
from rlhf.trainers.objectives import Rollout
from rlhf.trainers.readback import LOSS, Readback, read_batch, texts_of
from rlhf.trainers.setup import Run, setup
from rlhf.trainers.summary import empty_updates_warning, final_metrics, start_up_hint

ROWS_FILE = "metric_rows.json"  # in each checkpoint: the rows logged so far, so a resume keeps the run's history
CONFIG_FILE = "config.yaml"  # the resolved configuration, next to the trained policy and in every checkpoint


def train(cfg: Config, started: EarlyStart | None = None) -> dict:
    """Train with the preset cfg.train.trainer; the final metrics (on the main process; {} on the others).
    started: the engine as the stage placed it, and its process if it started one (rlhf.trainers.early)."""
    run = setup(cfg, started)
    # an error must not leave an engine process behind; the garbage collector runs between batches only
    with contextlib.closing(run.engine), scheduled_gc(cfg.train.gc_every):
        state, rows = start(run)
        tracker = Tracker(cfg, "train", enabled=run.acc.is_main_process, rows=rows, run_id=state.wandb_run_id)
        num_batches = run.sizes.num_batches
        kept = frontier.frontier_batches(cfg.train.eval_checkpoints, num_batches)
        bar = tqdm(
            range(state.batch, num_batches),
            desc=f"train {cfg.train.trainer}",
            initial=state.batch,
            total=num_batches,
            disable=not run.acc.is_main_process,
        )
        for t in bar:
            row = iterate(run, tracker, state, t)
            bar.set_postfix(score=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.2f}")
            if cfg.train.save_every and state.batch % cfg.train.save_every == 0 and state.batch < num_batches:
                save(run, tracker, state)
            if state.batch in kept:
                frontier.keep(run, state.episode)
        final = finish(run, tracker, state)
        if hint := start_up_hint(cfg.train, tracker.rows):
            run.acc.print(hint)
        if (warning := empty_updates_warning(cfg.train, tracker.rows)) and run.acc.is_main_process:
            print(f"rlhf train: {warning}", file=sys.stderr)
    # Every rank, on success only (a failed rank's peers may still be in a collective): gloo's worker threads
    # must stop while the interpreter is alive, else a rank can abort at exit (SIGABRT) after a good run.
    run.acc.end_training()
    if run.acc.is_main_process:  # once the run's outputs are in place, its resume points are no longer needed
        after_publishing(lambda: shutil.rmtree(run.ckpt_dir, ignore_errors=True))
    return final


def iterate(run: Run, tracker: Tracker, state: checkpoint.LoopState, t: int) -> dict:
    """Steps 1-10 for generated batch t (checkpoints and the frontier aside): its logged row."""
    clock = Clock(run.acc.device)
    # 1-6. prompts, completions, post-processing, scores, reference log-probs, the objective's view
    collected = collect(run, t, clock)
    # 7. M mini-batches x E epochs of updates
    step_stats = update(run, collected, t, state)
    crash_point("after_update", t)
    # 8. the batch's one read: its metrics; a run whose numbers went bad stops here (on a GPU, the update ends here)
    readback = read_batch(run, t, collected, step_stats)
    clock.mark("update")
    # 9. the engine samples from the new weights from now on
    sync(run, state, t)
    clock.mark("weight_sync")
    # 10. metrics (a checkpoint on schedule, the policy at the frontier's points: the caller's)
    row = log(run, tracker, state, t, collected, readback, clock)
    # 11. the garbage collector's turn on its schedule (train.gc_every), between batches
    collect_garbage(run.cfg.train.gc_every, t)
    return row


class Clock:
    """Seconds between marks within one iteration: mark("x") records the time since the previous mark as x.

    On a GPU kernels run asynchronously: the host's clock would put a phase's GPU time in whichever later phase next
    waits for the device. Each mark there records a CUDA event in the stream instead, and a phase's seconds are the
    device's between two events, read once (`seconds`, at log time, after the batch's one read): waiting for the
    device at every mark would drain its queue five times an iteration."""

    def __init__(self, device: torch.device | None = None):
        self._cuda = device is not None and device.type == "cuda"
        self._events: list[tuple[str, torch.cuda.Event]] = []
        self._first = self._record() if self._cuda else None
        self.start = self.last = time.perf_counter()
        self._host: dict[str, float] = {}
        self._device: dict[str, float] | None = None  # the device's phases, once read

    @staticmethod
    def _record() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self._host[name], self.last = now - self.last, now
        if self._cuda:
            self._events.append((name, self._record()))

    @property
    def seconds(self) -> dict[str, float]:
        """Each phase's seconds: the host's on the CPU, the device's on a GPU (waits for the last mark's event)."""
        if not self._cuda or not self._events:
            return self._host
        if self._device is None or len(self._device) != len(self._events):
            self._events[-1][1].synchronize()
            self._device, previous = {}, self._first
            for name, event in self._events:
                self._device[name], previous = previous.elapsed_time(event) / 1000, event
        return self._device

    def total(self) -> float:
        return sum(self.seconds.values()) if self._cuda else self.last - self.start


@dataclass
class Collected:
    """Generated batch t after steps 1-6."""

    gen: Generated  # what the engine returned: responses, the weight version, its timing and log-probs
    host: ModelInput  # prompts + responses cut after their first EOS (B*K rows, prompt-major), on the host
    inputs: ModelInput  # the same on the learner's device
    texts: list[str] | None  # the responses as text, once something read them (rlhf.trainers.readback.texts_of)
    rollout: Rollout  # the scored batch the objective saw, on the learner's device
    groups: dict[str, torch.Tensor]  # the objective's per-prompt tensors (B, K, ...): micro-batches index them
    stats: dict[str, torch.Tensor]  # the objective's metrics of the batch (and the behaviour weights'), on the device


def start(run: Run) -> tuple[checkpoint.LoopState, list[dict]]:
    """A fresh run's state, or the newest checkpoint's (weights, optimizer, RNGs, logged rows); then the engine
    gets the batches it samples ahead of training (none for a synchronous engine)."""
    state, rows = checkpoint.LoopState(), []
    last, passed_over = checkpoint.latest(run.ckpt_dir)
    for line in passed_over:
        run.acc.print(line)
    if passed_over and last is None:
        run.acc.print(f"no intact checkpoint in {run.ckpt_dir}: training starts from the beginning")
    if last is not None:
        state, mine = checkpoint.load(run.acc, last, trainable_only=run.lora)
        run.acc.print(f"resumed from {last} (batch {state.batch})")
        run.shuffle.set_state(torch.tensor(mine["shuffle_rng"], dtype=torch.uint8))
        rows = read_json(last / ROWS_FILE) if run.acc.is_main_process else []
    run.engine.seek(state.batch)
    for b in range(state.batch, min(state.batch + run.engine.lookahead, run.sizes.num_batches)):
        # a resumed async engine samples these with the versions the interrupted run used (kept in the
        # checkpoint), so the resumed run matches an uninterrupted one
        if last is not None and (version := b - run.engine.lookahead) >= 1:
            run.engine.load_snapshot(last / "engine" / f"v{version:06d}", version)
        run.engine.submit(run.prompts_of(b), run.params)
    if last is not None:
        run.engine.load_weights(run.policy, state.batch)
    return state, rows


def collect(run: Run, t: int, clock: Clock) -> Collected:
    """Steps 1-6 for generated batch t."""
    c, engine, tok = run.cfg.train, run.engine, run.tokenizer
    # 1-2. batch t went to the engine `lookahead` batches ago; hand it the batch that many ahead
    if t + engine.lookahead < run.sizes.num_batches:
        engine.submit(run.prompts_of(t + engine.lookahead), run.params)
    gen = engine.receive()
    clock.mark("wait")
    prompts = run.prompts_of(t)
    if gen.prompts is not None and gen.prompts != prompts:  # one engine serves several ranks: never mix them up
        raise RuntimeError(
            f"batch {t}: the engine returned completions of other prompts than rank {run.acc.process_index}'s"
        )
    # 3. post-process on the host, where every engine returns its tokens: keep tokens up to the first EOS; the batch
    # moves to the training device once, here
    host = assemble(prompts, gen.responses, c.k, tok.pad_token_id, tok.eos_token_id)
    inputs = host.to(run.acc.device)
    # the proxy RM reads tokens; a reward that reads text decodes here, the gold after the update is queued
    texts = host.texts(tok) if _reward_reads_text(run, gen) else None
    # 4. score (the async engine may have scored the batch already, overlapped with training)
    scores = _scores(run, gen, host, inputs, texts)
    clock.mark("scoring")
    # 5. reference log-probs; behaviour log-probs (+ values) from the same forward as training
    logp, ref_logp, values = _logprobs(run, inputs, gen)
    behav_weight, behav_stats = _behaviour_weights(run, logp, gen, inputs)
    # 6. the objective's view of the batch
    rollout = Rollout(
        sequences=inputs.sequences,
        attn=inputs.attn,
        positions=inputs.positions,
        response_mask=inputs.response_mask,
        scores=scores,
        logp=logp,
        ref_logp=ref_logp,
        values=values,
        context=inputs.context,
        k=c.k,
        is_weight=_importance_weights(run, logp, gen, inputs),
        behav_weight=behav_weight,
    )
    groups, stats = run.objective.prepare(rollout)
    stats.update(behav_stats)
    clock.mark("reference")
    return Collected(gen, host, inputs, texts, rollout, groups, stats)


def _reward_reads_text(run: Run, gen: Generated) -> bool:
    """Whether this batch's reward reads its responses as text (the gold as reward, the verifier), here."""
    return gen.scores is None and run.reward_fn is not None and run.reward_fn.needs_texts


def _scores(run: Run, gen: Generated, host: ModelInput, inputs: ModelInput, texts: list[str] | None) -> torch.Tensor:
    """Step 4: one reward per sample (N,) on the learner's device, after the missing-EOS penalty. A reward that
    reads text (the gold judge, the verifier) computes on the host, from the host batch; the proxy RM on the
    device. Whether they are finite is checked with the batch's metrics (rlhf.trainers.readback)."""
    c, reward = run.cfg.train, run.reward_fn
    if gen.scores is not None:
        scores = gen.scores
    else:
        scores = reward(host, texts) if reward.needs_texts else reward(inputs, texts)
    scores = to_device(scores, run.acc.device)
    if c.non_eos_penalty:
        scores = apply_missing_eos_penalty(scores, inputs.has_eos, c.penalty_reward_value)
    return scores


@torch.no_grad()
def _logprobs(run: Run, inputs: ModelInput, gen: Generated, chunk: int = 64):
    """Step 5: behaviour log-probs, reference log-probs (N, T), 0 on padding, and values (N, T) or None.

    Behaviour log-probs come from the training forward (so the on-policy ratio is exactly 1), unless the
    objective only reports them and the engine returned its own sampling log-probs: DPO, best-of-k, and GRPO and
    RLOO with one optimizer step per batch (objectives.one_step_per_batch: their losses use their own forward's).
    Reference log-probs come from the engine when it computed them (train.score_in_engine), else from the learner's
    reference.
    """
    objective, temperature = run.objective, run.cfg.train.temperature
    behaviour = objective.needs_behaviour_logprobs or gen.logprobs is None
    logps, values = [], []
    needed = behaviour or objective.needs_values
    for rows in row_chunks(chunk, inputs.sequences, inputs.attn, inputs.positions) if needed else []:
        if objective.needs_values:
            logp, v = response_logprobs_and_values(run.model, *rows, inputs.context, temperature)
            logps.append(logp)
            values.append(v)
        else:
            logps.append(response_logprobs(run.model, *rows, inputs.context, temperature))
    mask = inputs.response_mask
    if gen.ref_logprobs is not None:
        ref_logp = to_device(gen.ref_logprobs, run.acc.device) * mask
    else:
        with run.acc.autocast():  # the reference computes as the policy does (bf16 under mixed precision)
            ref_logp = reference_logprobs(run.ref, inputs, temperature, chunk)  # 0 on padding already
    logp = cat_rows(logps) if logps else to_device(gen.logprobs, run.acc.device)
    return logp * mask, ref_logp, cat_rows(values) if values else None


def _importance_weights(run: Run, logp: torch.Tensor, gen: Generated, inputs: ModelInput) -> torch.Tensor | None:
    """train.tis_cap: the batch was sampled by older weights, so correct towards the learner's policy with the
    sequence importance weight min(pi / pi_engine, cap) (N,), truncated for variance."""
    if run.cfg.train.tis_cap is None or gen.logprobs is None:
        return None
    return (logp - _engine_logprobs(run, gen, inputs)).sum(1).exp().clamp(max=run.cfg.train.tis_cap)


def _behaviour_weights(
    run: Run, logp: torch.Tensor, gen: Generated, inputs: ModelInput
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """train.decoupled_cap: AReaL's per-token behaviour weights pi_prox / pi_behav (N, T), 0 past the cap, and their
    policy/behav_* metrics (rlhf.algorithms.decoupled). pi_prox is the learner's log-probs of step 5 (its weights
    as the batch's update starts), pi_behav the engine's sampling log-probs. An engine that returns none sampled
    with the learner's own weights: pi_behav = pi_prox, every weight 1."""
    cap = run.cfg.train.decoupled_cap
    if cap is None:
        return None, {}
    behav_logp = logp if gen.logprobs is None else _engine_logprobs(run, gen, inputs)
    weights, stats = decoupled.behaviour_weights(logp, behav_logp, inputs.response_mask, cap)
    return weights, {f"policy/behav_{name}": value for name, value in stats.items()}


def _engine_logprobs(run: Run, gen: Generated, inputs: ModelInput) -> torch.Tensor:
    """The engine's own sampling log-probs (N, T) on the learner's device, 0 on padding: pi_behav of the
    off-policy corrections."""
    return to_device(gen.logprobs, run.acc.device) * inputs.response_mask


def update(run: Run, col: Collected, t: int, state: checkpoint.LoopState) -> list[dict[str, torch.Tensor]]:
    """Step 7: E epochs of M mini-batches over this rank's prompts, each G micro-batches of P prompts, each without
    the columns that are padding in all its rows (batch.trim_padding); on a GPU rounded up to a few widths
    (batch.micro_batch_columns: a shape per micro-batch would defeat CUDA graphs and the allocator's reuse)."""
    c, groups = run.cfg.train, col.groups
    P, G = c.per_device_train_batch_size, c.gradient_accumulation_steps
    context, T = col.inputs.context, col.inputs.response_mask.shape[1]
    bucketed = run.acc.device.type == "cuda"  # a few shapes for CUDA graphs and the allocator; exact on the CPU
    batch_spans = col.host.spans(c.k)  # per prompt, read from the host batch
    if not run.model.training:  # once: the HF engine restores the mode it found (each train() walks ~400 modules)
        run.model.train()
    stats = []
    for _ in range(c.num_ppo_epochs):
        order = torch.randperm(run.sizes.local_batch, generator=run.shuffle)
        # one gather and one split a tensor an epoch: each micro-batch is then a view, taken with no op of its own
        on_device = to_device(order, run.acc.device)
        micro_batches = {k: v[on_device].split(P) for k, v in groups.items()}
        spans = [batch_spans[i] for i in host_list(order)]
        for m in range(c.num_mini_batches):
            for g in range(G):
                i = m * G + g
                first, width = micro_batch_columns(spans, range(i * P, (i + 1) * P), context, T, bucketed)
                mb = trim_padding({k: v[i] for k, v in micro_batches.items()}, first, width)
                stats.append(_micro_step(run, mb))
            state.global_step += 1
    return stats


def _micro_step(run: Run, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Forward + backward of one micro-batch; the optimizer steps on the last of G (accelerate counts them). Reads
    nothing back: its metrics and loss stay on the device (rlhf.trainers.readback checks them)."""
    c, acc = run.cfg.train, run.acc
    with acc.accumulate(run.model):
        loss, stats = run.objective.loss(run.model, mb)
        acc.backward(loss)
        if acc.sync_gradients and (norm := _clip_gradients(run, c.max_grad_norm)) is not None:
            stats["policy/grad_norm"] = norm
        run.optimizer.step()
        run.scheduler.step()
        run.optimizer.zero_grad()
    return {**stats, LOSS: loss.detach()}


def _clip_gradients(run: Run, max_norm: float) -> torch.Tensor | None:
    """Clip the gradients to `max_norm`; their global norm before clipping (DeepSpeed clips inside its step, which
    accelerate runs in backward: the norm it computed; None if it has none)."""
    norm = run.acc.clip_grad_norm_(run.model.parameters(), max_norm)
    if norm is None and run.acc.state.deepspeed_plugin is not None:
        norm = run.model.get_global_grad_norm()
    return None if norm is None else torch.as_tensor(norm, dtype=torch.float32, device=run.acc.device)


def sync(run: Run, state: checkpoint.LoopState, t: int) -> None:
    """Step 8: batch t is trained; the policy is weight version t+1 and the engine samples from it from now on."""
    state.batch, state.episode = t + 1, state.episode + run.sizes.batch
    run.engine.load_weights(run.policy, state.batch)


def log(run: Run, tracker: Tracker, state, t: int, col: Collected, back: Readback, clock: Clock) -> dict:
    """Step 10: the batch's row (its metrics, averaged over ranks, read in step 8, and its timings) to W&B and
    train.csv; a few completions to W&B."""
    version = col.gen.version
    host = {"async/staleness": float(t - version), "async/weight_version": float(version)}
    if run.engine.lookahead:
        host.update(token_staleness(t, col.gen, col.host.response_mask))
    row = dict(sorted({**back.row, **host, "lr": run.scheduler.get_last_lr()[0]}.items()))
    row.update(_timings(run, state, col.gen, clock))
    if t % run.cfg.tracking.log_every == 0 or t == run.sizes.num_batches - 1:
        tracker.log(row)
        if tracker.logs_tables:
            tok, k = run.tokenizer, run.cfg.train.k
            prompts = [p for p in tok.batch_decode(col.host.prompt_ids, skip_special_tokens=True) for _ in range(k)]
            tracker.completions(state.episode, prompts, texts_of(run, col), back.scores, back.gold)
    return row


def token_staleness(t: int, gen: Generated, mask: torch.Tensor) -> dict[str, float]:
    """async/token_staleness_{mean,max}: how many updates old the weights that sampled batch t's response tokens
    (mask (N, T), on the host) are: one number per batch between batches, less under in-flight updates."""
    versions = gen.token_versions if gen.token_versions is not None else torch.full(mask.shape, gen.version)
    stale = host_list(t - versions[:, : mask.shape[1]][mask]) or [t - gen.version]
    return {"async/token_staleness_mean": sum(stale) / len(stale), "async/token_staleness_max": float(max(stale))}


def _timings(run: Run, state, gen: Generated, clock: Clock) -> dict[str, float]:
    """timing/* of this iteration (docs/metrics.md), throughput and the run's position."""
    s, step = clock.seconds, clock.total()
    row = {
        "timing/generation": gen.seconds,
        "timing/scoring": s["scoring"],
        "timing/reference": s["reference"],
        "timing/update": s["update"],
        "timing/weight_sync": s["weight_sync"],
        "timing/step": step,
        "timing/elapsed": seconds_since_start(),
        "eps": run.sizes.batch / step,
        "train/episode": state.episode,
        "train/global_step": state.global_step,
        **run.engine.stats(),
    }
    if run.engine.lookahead:  # time the learner spent waiting for the generator (none for a batch it sampled)
        row["timing/wait"] = 0.0 if gen.sampled_here else s["wait"]
    return row


def save(run: Run, tracker: Tracker, state: checkpoint.LoopState) -> None:
    """Step 9: a resume checkpoint, with the weights of the batches an async engine is sampling ahead."""
    state.wandb_run_id = tracker.run_id
    in_flight = run.engine.weights_in_flight(state.batch)
    checkpoint.save(
        run.acc,
        run.ckpt_dir,
        state,
        {"shuffle_rng": run.shuffle.get_state().tolist()},
        extra_files={ROWS_FILE: json.dumps(tracker.rows), CONFIG_FILE: config_yaml(run.cfg)},
        extra_dirs={f"engine/v{v:06d}": folder for v, folder in in_flight.items()},
        keep=run.cfg.train.keep_checkpoints,
        trainable_only=run.lora,
    )


def finish(run: Run, tracker: Tracker, state: checkpoint.LoopState) -> dict:
    """Export the policy to data/train/policy, its config to data/train/config.yaml and the policies kept for the
    frontier to data/train/frontier; the final metrics."""
    cfg, acc = run.cfg, run.acc
    final = {}
    with full_weights(run.policy) as weights:  # a collective under ZeRO-3: every rank enters it
        if acc.is_main_process:
            # The outputs go together (rlhf.io.published_together, which `rlhf train` opens): policy, config,
            # frontier, metrics and plots move in at the end, or none does.
            frontier.publish(run.ckpt_dir, cfg.path("train"))
            with atomic_dir(cfg.path("train", "policy")) as tmp:
                save_policy(run.policy, weights, run.tokenizer, tmp)
                write_text(cfg.path("train", CONFIG_FILE), config_yaml(cfg))
                final = final_metrics(tracker.rows, state)
                tracker.finish(final)
    acc.wait_for_everyone()
    return final
