"""The one online RLHF loop: every trainer is this loop x an objective x a generation engine.

One iteration (numbered as in shared/design/architecture.md):
  1. next prompt batch  2. completions from the engine  3. truncate at EOS  4. score (+ missing-EOS penalty)
  5. behaviour/reference log-probs (+ values)  6. objective.prepare  7. M mini-batches x E epochs of updates
  8. weight sync to the engine (versioned)  9. metrics, checkpoint
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs, set_seed
from tqdm import tqdm
from transformers import get_scheduler

from rlhf.algorithms.common import apply_missing_eos_penalty
from rlhf.config import Config, TrainConfig, fingerprint
from rlhf.runtime import crash_point
from rlhf.generation.base import SamplingParams
from rlhf.rewards.proxy import GoldReward, RewardSpec
from rlhf.trainers import checkpoint
from rlhf.trainers.forward import PolicyAndValueWrapper, assemble, response_logprobs, response_logprobs_and_values
from rlhf.trainers.objectives import OBJECTIVES, Rollout
from rlhf.trainers.presets import resolve
from rlhf.tracking import Tracker

ROWS_FILE = "metric_rows.json"  # in each checkpoint: the rows logged so far, so a resume keeps the run's history


def exact_div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


@dataclass(frozen=True)
class Sizes:
    """Batch arithmetic, in prompts, computed once. W = training processes."""

    world: int
    local_batch: int  # P*G*M prompts per rank per generated batch
    batch: int  # local_batch * W
    num_batches: int  # total_episodes / batch
    num_updates: int  # optimizer steps over the run: num_batches * M * E

    @classmethod
    def derive(cls, c: TrainConfig, world: int) -> Sizes:
        local = c.per_device_train_batch_size * c.gradient_accumulation_steps * c.num_mini_batches
        num_batches = exact_div(c.total_episodes, local * world, "train.total_episodes / (P*G*M*processes)")
        return cls(world, local, local * world, num_batches, num_batches * c.num_mini_batches * c.num_ppo_epochs)


def _setup_accelerator(c: TrainConfig) -> Accelerator:
    # On CPU, accelerate needs gloo spelled out or it believes there is one process (platform.md).
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    acc = Accelerator(gradient_accumulation_steps=c.gradient_accumulation_steps, kwargs_handlers=kwargs)
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = c.per_device_train_batch_size
        ds["gradient_accumulation_steps"] = c.gradient_accumulation_steps
        ds["gradient_clipping"] = c.max_grad_norm
        ds["zero_allow_untested_optimizer"] = True  # a torch AdamW: no DeepSpeed Adam build needed
        ds["train_batch_size"] = c.per_device_train_batch_size * c.gradient_accumulation_steps * acc.num_processes
    return acc


def _setup_models(cfg: Config, needs_values: bool):
    from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer

    tokenizer = load_tokenizer(cfg.path("sft"))
    policy = load_causal_lm(cfg.path("sft"))
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    value = load_reward_model(cfg.path("reward", "model")) if needs_values else None
    return tokenizer, policy, ref, value


def _reward_spec(cfg: Config) -> RewardSpec:
    if cfg.train.reward == "gold":
        return RewardSpec("gold", str(cfg.path("gold")))
    return RewardSpec("proxy", str(cfg.path("reward", "model")))


def _gold_judge(cfg: Config, required: bool = False):
    if not required and not cfg.path("gold").exists():
        return None  # before the import: scikit-learn is ~100 MB of RSS a run without a judge doesn't need
    from rlhf.rewards.gold import GoldJudge

    return GoldJudge.load(cfg.path("gold"))


def _setup_engine(name: str, cfg: Config, model, tokenizer, max_model_len: int, reward, score: str):
    if name == "hf":
        from rlhf.generation.hf import HFEngine

        return HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    from rlhf.generation.vllm import make_vllm_engine

    # The engine starts from the SFT weights (version 0); a resumed run syncs its own weights right after.
    return make_vllm_engine(name, cfg.path("sft"), tokenizer, cfg.train.max_staleness, cfg.seed, max_model_len, cfg.path("train", "engine"), reward, score, cfg.train.engine_dtype)


def load_rl_prompts(cfg: Config, tokenizer) -> list[list[int]]:
    """The RL prompts as token ids, those that don't fit the context dropped (batch_prompts draws from them)."""
    from rlhf.data.schemas import Prompts
    from rlhf.data.splits import load_split

    df = load_split(cfg.path("prepared"), "rl_prompts", Prompts)
    ids = tokenizer(list(df["prompt"]), add_special_tokens=True)["input_ids"]
    room = cfg.model.max_position_embeddings - cfg.train.response_length if cfg.model.source == "tiny" else None
    kept = [p for p in ids if 0 < len(p) and (room is None or len(p) <= room)]
    if not kept:
        raise ValueError(f"rl_prompts: no prompt fits the context ({room} tokens left after train.response_length)")
    if len(kept) < len(ids):
        print(f"train: skipped {len(ids) - len(kept)} of {len(ids)} rl_prompts that are empty or longer than the context "
              f"({room} tokens left after train.response_length)", file=sys.stderr)
    return kept


def batch_prompts(prompts: list[list[int]], t: int, sizes: Sizes, rank: int, seed: int) -> list[list[int]]:
    """This rank's prompts of generated batch t: a pure function of t, so resume needs no dataloader state."""
    out = []
    for i in range(t * sizes.batch + rank * sizes.local_batch, t * sizes.batch + (rank + 1) * sizes.local_batch):
        epoch, j = divmod(i, len(prompts))
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + epoch))
        out.append(prompts[order[j]])
    return out


@torch.no_grad()
def _forward_batch(model, ref, batch, temperature, behaviour: bool, needs_values: bool, chunk=64):
    """Reference log-probs, and when asked behaviour log-probs (with the same forward as training, so the
    on-policy ratio is exactly 1) and, for PPO, values. Shapes (N, T); None for what was not asked."""
    logps, refs, values = [], [], []
    for i in range(0, len(batch.sequences), chunk):
        inputs = (batch.sequences[i : i + chunk], batch.attn[i : i + chunk], batch.positions[i : i + chunk], batch.context)
        if needs_values:
            logp, v = response_logprobs_and_values(model, *inputs, temperature)
            logps.append(logp)
            values.append(v)
        elif behaviour:
            logps.append(response_logprobs(model, *inputs, temperature)[0])
        refs.append(response_logprobs(ref, *inputs, temperature)[0])
    cat = lambda parts: torch.cat(parts) if parts else None  # noqa: E731
    return cat(logps), torch.cat(refs), cat(values)


def _mean_stats(rows: list[dict]) -> dict[str, float]:
    keys = {k for r in rows for k in r}
    return {k: sum(r[k] for r in rows if k in r) / sum(1 for r in rows if k in r) for k in keys}


def train(cfg: Config) -> dict:
    c = cfg.train
    algorithm, engine_name = resolve(c.trainer, c.engine)
    objective = OBJECTIVES[algorithm](c)
    # Checked before anything loads (WORLD_SIZE is set by accelerate/torchrun launchers), so the refusal is instant.
    if engine_name != "hf" and (world := int(os.environ.get("WORLD_SIZE", "1"))) > 1:
        raise ValueError(f"train.engine={engine_name}: the vLLM engines run with one training process (got {world}); use train.engine=hf with several processes")
    # Models load before the Accelerator exists: under ZeRO-3 an active DeepSpeed config would make
    # transformers partition them at load time, and the reference/reward models are not DeepSpeed engines.
    tokenizer, policy, ref, value = _setup_models(cfg, objective.needs_values)
    reward = _reward_spec(cfg)
    score_in_engine = "never" if engine_name != "vllm_async" else c.score_in_engine
    reward_fn = None if score_in_engine == "always" else reward.build()
    # The learner always loads the judge (gold metrics) before the engine starts: a bad judge folder fails
    # here, naming it. With train.reward=gold the reward already holds it.
    gold = reward_fn.judge if isinstance(reward_fn, GoldReward) else _gold_judge(cfg, required=c.reward == "gold")
    acc = _setup_accelerator(c)
    sizes = Sizes.derive(c, acc.num_processes)
    set_seed(cfg.seed + acc.process_index)
    model = PolicyAndValueWrapper(policy, value) if objective.needs_values else policy
    optimizer = torch.optim.AdamW(model.parameters(), lr=c.learning_rate, eps=1e-8, weight_decay=0.0)
    scheduler = get_scheduler(c.lr_scheduler, optimizer, num_warmup_steps=int(c.warmup_ratio * sizes.num_updates), num_training_steps=sizes.num_updates)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    unwrapped_policy = lambda: acc.unwrap_model(model).policy if objective.needs_values else acc.unwrap_model(model)  # noqa: E731
    prompts = load_rl_prompts(cfg, tokenizer)
    engine = _setup_engine(engine_name, cfg, unwrapped_policy(), tokenizer, max(map(len, prompts)) + c.response_length, reward if score_in_engine != "never" else None, score_in_engine)
    with contextlib.closing(engine):  # an error must not leave an engine process behind
        return _loop(cfg, acc, sizes, objective, model, optimizer, scheduler, unwrapped_policy, engine, prompts, tokenizer, ref, reward_fn, gold)


def _replay_in_flight(last, batch: int, engine, prompts_of, params: SamplingParams, num_batches: int) -> int:
    """Put an async engine back where the checkpointed run had it: it was sampling batches b .. b+N-1 ahead with
    versions b-N .. b-1, so submit them again with those versions (kept in the checkpoint) and the resumed run
    matches an uninterrupted one. Returns the next batch to submit. A sync engine (lookahead 0) has none."""
    engine.seek(batch)
    end = min(batch + engine.lookahead, num_batches)
    for b in range(batch, end):
        if (version := b - engine.lookahead) >= 1:
            engine.load_snapshot(last / "engine" / f"v{version:06d}", version)
        engine.submit(prompts_of(b), params)
    return end


def _loop(cfg: Config, acc: Accelerator, sizes: Sizes, objective, model, optimizer, scheduler, unwrapped_policy, engine, prompts, tokenizer, ref, reward_fn, gold) -> dict:
    """Steps 1-9 for every generated batch, then the final export."""
    c = cfg.train
    # Outside data/train, which `dvc repro` deletes before running the stage; keyed by the settings, so a
    # changed run never resumes from another one's state.
    ckpt_dir = cfg.path("checkpoints", f"train-{fingerprint(cfg)}")
    params = SamplingParams(c.k, c.response_length, c.temperature)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    shuffle = torch.Generator().manual_seed(cfg.seed + 7919 * acc.process_index)
    state, rows, submitted = checkpoint.LoopState(), [], 0
    if (last := checkpoint.latest(ckpt_dir)) is not None:
        state, mine = checkpoint.load(acc, last)
        acc.print(f"resumed from {last} (batch {state.batch})")
        shuffle.set_state(torch.tensor(mine["shuffle_rng"], dtype=torch.uint8))
        rows = json.loads((last / ROWS_FILE).read_text(encoding="utf-8")) if acc.is_main_process else []
        submitted = _replay_in_flight(last, state.batch, engine, lambda b: batch_prompts(prompts, b, sizes, acc.process_index, cfg.seed), params, sizes.num_batches)
        engine.load_weights(unwrapped_policy(), state.batch)
    tracker = Tracker(cfg, "train", enabled=acc.is_main_process, rows=rows, run_id=state.wandb_run_id)
    bar = tqdm(range(state.batch, sizes.num_batches), desc=f"train {c.trainer}", disable=not acc.is_main_process, initial=state.batch, total=sizes.num_batches)
    for t in bar:
        t0 = time.perf_counter()
        # 1-2. prompts and completions (an async engine may already hold batches generated ahead)
        while submitted <= min(t + engine.lookahead, sizes.num_batches - 1):
            engine.submit(batch_prompts(prompts, submitted, sizes, acc.process_index, cfg.seed), params)
            submitted += 1
        local = batch_prompts(prompts, t, sizes, acc.process_index, cfg.seed)
        gen = engine.receive()
        t_gen = time.perf_counter()
        # 3. post-process: keep tokens up to the first EOS
        batch = assemble(local, gen.responses, c.k, pad, eos)
        texts = batch.texts(tokenizer)
        sequences, attn, positions, response_mask = (t.to(acc.device) for t in (batch.sequences, batch.attn, batch.positions, batch.response_mask))
        # 4. score (the async engine may have scored the batch already, overlapped with training)
        raw_scores = (gen.scores if gen.scores is not None else reward_fn(batch, texts)).to(acc.device)
        if not torch.isfinite(raw_scores).all():  # a NaN score would silently poison every later update
            bad = int((~torch.isfinite(raw_scores)).sum())
            raise RuntimeError(f"the reward ({c.reward}) returned NaN/inf for {bad} of {len(raw_scores)} samples at batch {t} (trainer {c.trainer}); the last good checkpoint in {ckpt_dir} is intact")
        scores = apply_missing_eos_penalty(raw_scores, batch.has_eos.to(acc.device), c.penalty_reward_value) if c.non_eos_penalty else raw_scores
        t_score = time.perf_counter()
        # 5. reference log-probs; behaviour log-probs (+ values) from the training forward, unless the objective
        # only reports them (DPO, best-of-k) and the engine already returned its sampling log-probs
        behaviour = objective.needs_behaviour_logprobs or gen.logprobs is None
        logp, ref_logp, values = _forward_batch(model, ref, batch, c.temperature, behaviour, objective.needs_values)
        if logp is None:
            logp = gen.logprobs
        logp, ref_logp = logp.to(acc.device) * response_mask, ref_logp * response_mask
        is_weight = None
        if c.tis_cap is not None and gen.logprobs is not None:
            # the batch was sampled by older weights: correct towards the learner's policy, truncated for variance
            is_weight = ((logp - gen.logprobs.to(acc.device) * response_mask).sum(1)).exp().clamp(max=c.tis_cap)
        rollout = Rollout(sequences, attn, positions, response_mask, scores, logp, ref_logp, values, batch.context, c.k, is_weight)
        # 6. the algorithm's view of the batch
        groups, stats = objective.prepare(rollout)
        t_ref = time.perf_counter()
        # 7. M mini-batches x E epochs, G micro-batches of P prompts each
        model.train()
        step_stats = []
        P, G = c.per_device_train_batch_size, c.gradient_accumulation_steps
        for _ in range(c.num_ppo_epochs):
            order = torch.randperm(sizes.local_batch, generator=shuffle)
            for m in range(c.num_mini_batches):
                for g in range(G):
                    idx = order[(m * G + g) * P : (m * G + g + 1) * P]
                    mb = {k: v[idx] for k, v in groups.items()}
                    with acc.accumulate(model):
                        loss, s = objective.loss(model, mb)
                        if not torch.isfinite(loss):
                            raise RuntimeError(f"loss became {loss.item()} at batch {t} (trainer {c.trainer}); the last good checkpoint in {ckpt_dir} is intact")
                        acc.backward(loss)
                        if acc.sync_gradients:
                            norm = acc.clip_grad_norm_(model.parameters(), c.max_grad_norm)
                            if norm is not None:
                                s["policy/grad_norm"] = float(norm)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad()
                    step_stats.append(s)
                state.global_step += 1
        t_update = time.perf_counter()
        crash_point("after_update", t)
        # 8. the engine samples from the new weights from now on
        state.batch, state.episode = t + 1, state.episode + sizes.batch
        engine.load_weights(unwrapped_policy(), state.batch)
        t_sync = time.perf_counter()
        # 9. metrics and checkpoints
        stats.update(_mean_stats(step_stats))
        stats.update({
            "objective/scores": scores.mean().item(),
            "objective/entropy": (-logp).sum(1).mean().item(),
            "completions/mean_length": response_mask.sum(1).float().mean().item(),
            "completions/eos_rate": batch.has_eos.float().mean().item(),
            "async/staleness": float(t - gen.version),
            "async/weight_version": float(gen.version),
            "lr": scheduler.get_last_lr()[0],
        })
        if is_weight is not None:
            stats["policy/is_weight"] = is_weight.mean().item()
        gold_scores = gold.score(texts) if gold is not None else None
        if gold_scores is not None:
            stats["objective/gold"] = float(gold_scores.mean())
        reduced = acc.reduce(torch.tensor(list(stats.values()), device=acc.device), reduction="mean").tolist()
        row = dict(zip(stats.keys(), reduced))
        row.update({
            "timing/generation": gen.seconds,
            "timing/scoring": t_score - t_gen, "timing/reference": t_ref - t_score, "timing/update": t_update - t_ref,
            "timing/weight_sync": t_sync - t_update, "timing/step": t_sync - t0,
            "eps": sizes.batch / (t_sync - t0), "train/episode": state.episode, "train/global_step": state.global_step,
        })
        row.update(getattr(engine, "stats", dict)())
        if engine.lookahead:  # time the learner spent waiting for the generator
            row["timing/wait"] = t_gen - t0
        if t % cfg.tracking.log_every == 0 or t == sizes.num_batches - 1:
            tracker.log(row)
            prompt_texts = [p for p in tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True) for _ in range(c.k)]
            tracker.completions(state.episode, prompt_texts, texts, scores.tolist(), None if gold_scores is None else gold_scores.tolist())
        bar.set_postfix(score=f"{row['objective/scores']:.3f}", kl=f"{row['objective/kl']:.2f}")
        if c.save_every and state.batch % c.save_every == 0 and state.batch < sizes.num_batches:
            state.wandb_run_id = tracker.run_id
            in_flight = engine.weights_in_flight(state.batch) if engine.lookahead else {}
            checkpoint.save(acc, ckpt_dir, state, {"shuffle_rng": shuffle.get_state().tolist()}, extra_files={ROWS_FILE: json.dumps(tracker.rows)},
                            extra_dirs={f"engine/v{v:06d}": folder for v, folder in in_flight.items()})
    final = _finish(cfg, acc, model, unwrapped_policy(), tokenizer, tracker, state)
    if acc.is_main_process:  # the run's result is saved: its resume points are no longer needed
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    return final


def _finish(cfg: Config, acc: Accelerator, model, policy, tokenizer, tracker: Tracker, state) -> dict:
    from rlhf.io import atomic_dir

    full_state = acc.get_state_dict(model)
    final = {}
    if acc.is_main_process:
        if isinstance(acc.unwrap_model(model), PolicyAndValueWrapper):
            full_state = {k.removeprefix("policy."): v for k, v in full_state.items() if k.startswith("policy.")}
        with atomic_dir(cfg.path("train", "policy")) as tmp:
            policy.save_pretrained(tmp, state_dict=full_state, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        last = tracker.rows[-max(1, len(tracker.rows) // 4) :]  # the last quarter of the run
        # Results only: wall-clock figures (timing/*, eps) differ between identical runs and live in train.csv.
        final = {f"final/{k}": v for k, v in _mean_stats(last).items() if not k.startswith(("timing/", "train/")) and k != "eps"}
        final.update({"episodes": state.episode, "optimizer_steps": state.global_step})
        first = tracker.rows[0] if tracker.rows else {}
        final.update({f"first/{k}": first[k] for k in ("objective/scores", "objective/gold") if k in first})
        tracker.finish(final)
    acc.wait_for_everyone()
    return final
