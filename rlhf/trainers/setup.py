"""Everything the online loop needs, set up once: `setup(cfg) -> Run`, in `_setup_*` steps.

The order matters and is kept on purpose: models load before the Accelerator exists (under ZeRO-3 an active
DeepSpeed config would make transformers partition them at load time, and the reference and reward models are
not DeepSpeed engines); the global RNGs are seeded before a colocated vLLM engine starts, last, from the SFT
folder, once everything that can fail on a bad input has been loaded. An engine in its own process starts first
instead (its process even before the trainer's imports, rlhf.trainers.early): its start-up is the longest.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed
from torch import nn
from transformers import get_scheduler

from rlhf.config import Config, TrainConfig, fingerprint
from rlhf.generation.base import Engine, EngineSpec, Placement, ReferenceSpec, SamplingParams
from rlhf.generation.factory import make_engine, token_ids
from rlhf.generation.hf import HFEngine
from rlhf.generation.learner_first import LearnerFirst
from rlhf.generation.shared import SharedEngine
from rlhf.models.batch import host_list
from rlhf.models.forward import PolicyAndValueWrapper, unwrap_policy
from rlhf.models.loading import encode_prompts, load_tokenizer
from rlhf.models.lora import AdaptersOff, add_adapters
from rlhf.presets import ENGINES, resolve
from rlhf.rewards.proxy import GoldReward, RewardSpec, RuleReward
from rlhf.runtime import adamw, env_int
from rlhf.trainers.early import EarlyStart, engine_placement, holds_own_process
from rlhf.trainers.objectives import OBJECTIVES, Objective


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
        num_batches = c.num_batches(world)  # the one divisibility check, naming the settings
        return cls(world, local, local * world, num_batches, num_batches * c.num_mini_batches * c.num_ppo_epochs)


@dataclass
class Run:
    """The objects the loop uses, set up once by `setup`."""

    cfg: Config
    acc: Accelerator
    sizes: Sizes
    objective: Objective  # how a scored batch becomes a loss (rlhf.trainers.objectives)
    model: nn.Module  # what the optimizer steps: the policy, or policy + value (PPO); prepared by accelerate
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    ref: nn.Module | AdaptersOff | None  # the frozen SFT policy (LoRA: adapters off); None: the engine computes it
    engine: Engine  # who samples (rlhf.generation)
    tokenizer: object
    prompts: list[list[int]]  # the RL prompts as token ids; batch t takes its share by `prompts_of(t)`
    reward_fn: Callable | None  # (ModelInput, texts) -> scores (N,); None when the engine scores every batch
    gold: Callable | None  # the task's gold (the judge, or the math verifier), as reward_fn: the training samples' gold
    # derived from the above
    params: SamplingParams = field(init=False)
    shuffle: torch.Generator = field(init=False)  # mini-batch order; saved in checkpoints
    ckpt_dir: Path = field(init=False)  # resume checkpoints of this run's settings
    # the bare policy (no accelerate/DeepSpeed wrapper, no value head): what the engine and export see. Unwrapped once:
    # accelerate's unwrap_model took 1.8 ms a call, every batch (bench/host_overhead.py)
    policy: nn.Module = field(init=False)
    # the trainable parameters' gradient accumulators (their AccumulateGrad nodes), held for the run as DDP's reducer
    # and ZeRO hold theirs: else every forward made them anew and every micro-step's graph freed them with it (~200
    # a backbone, ~10% of the graph's teardown after each backward; bench/host_overhead.py). DeepSpeed holds its own.
    grad_accumulators: list = field(init=False)

    def __post_init__(self):
        c = self.cfg.train
        self.policy = unwrap_policy(self.acc.unwrap_model(self.model))
        held = self.acc.state.deepspeed_plugin is None
        self.grad_accumulators = grad_accumulators(self.model) if held else []
        self.params = SamplingParams(c.k, c.response_length, c.temperature)
        self.shuffle = torch.Generator().manual_seed(self.cfg.rl_seed + 7919 * self.acc.process_index)
        self.ckpt_dir = checkpoint_dir(self.cfg)

    @property
    def lora(self) -> bool:
        """The policy trains LoRA adapters: checkpoints hold only the weights that train."""
        return self.cfg.train.lora.rank > 0

    def prompts_of(self, t: int) -> list[list[int]]:
        """This rank's prompts of generated batch t."""
        return batch_prompts(self.prompts, t, self.sizes, self.acc.process_index, self.cfg.rl_seed)


def grad_accumulators(model: nn.Module) -> list:
    """The AccumulateGrad node of each of `model`'s trainable parameters: the node a backward adds its gradient with,
    one per parameter for as long as something holds it (autograd keeps only a weak reference)."""
    with torch.enable_grad():
        return [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters() if p.requires_grad]


def checkpoint_dir(cfg: Config) -> Path:
    """The run's resume checkpoints: outside data/train, which holds only the stage's outputs; keyed by the settings,
    so a changed run never resumes from another one's state."""
    return cfg.path("checkpoints", f"train-{fingerprint(cfg)}")


def setup(cfg: Config, started: EarlyStart | None = None) -> Run:
    """started: the stage's first step (rlhf.trainers.early): the engine's placement and, where this rank holds it in
    a process of its own, that process, started before the trainer's imports. None: the engine is placed here."""
    c = cfg.train
    algorithm = resolve(c.trainer, c.engine)[0]
    started = started or EarlyStart(*engine_placement(cfg))
    engine_name, where, engine_process = started.engine, started.where, started.process
    objective = OBJECTIVES[algorithm](c)
    tokenizer = load_tokenizer(cfg.path("sft"))
    prompts = load_rl_prompts(cfg, tokenizer)
    reward = RewardSpec.of(cfg)
    # An engine in its own process builds vLLM (from the SFT folder) while this one loads its models.
    spec = _engine_spec(cfg, engine_name, where, tokenizer, prompts, reward)
    early = _start_engine_early(spec, engine_process)
    try:
        policy, ref, value = _setup_models(cfg, objective.needs_values, _learner_scores(c, engine_name))
        reward_fn, gold = _setup_reward(cfg, engine_name, reward)
        acc = _setup_accelerator(c)
        sizes = Sizes.derive(c, acc.num_processes)
        set_seed(cfg.rl_seed + acc.process_index)
        model = PolicyAndValueWrapper(policy, value) if objective.needs_values else policy
        optimizer, scheduler = _setup_optimization(c, model, sizes, acc.device)
        model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
        ref = ref if ref is None or isinstance(ref, AdaptersOff) else _place_frozen(ref, acc)
        reward_fn = reward_fn.placed(lambda m: _place_frozen(m, acc), acc.device) if reward_fn is not None else None
        policy = unwrap_policy(acc.unwrap_model(model))
        engine = _setup_engine(spec, early, policy, tokenizer, acc, engine_process, c.learner_first_batches)
    except BaseException:
        if early is not None:
            early.close()
        raise
    return Run(
        cfg=cfg,
        acc=acc,
        sizes=sizes,
        objective=objective,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        ref=ref,
        engine=engine,
        tokenizer=tokenizer,
        prompts=prompts,
        reward_fn=reward_fn,
        gold=gold,
    )


def _setup_models(cfg: Config, needs_values: bool, needs_reference: bool):
    """policy, reference (the SFT policy, frozen), value model (PPO: from the RM) or None, on the CPU.

    With train.lora.rank > 0 the policy gets LoRA adapters and the reference is the policy with them switched off.
    Without LoRA the reference is a second copy, None when the engine computes every batch's reference log-probs.

    They load before the Accelerator exists: under ZeRO-3 an active DeepSpeed config would make transformers
    partition them at load time. `_place_frozen` and `Accelerator.prepare` then put them on the device.
    """
    from rlhf.models.loading import load_causal_lm, load_reward_model

    c = cfg.train
    policy = load_causal_lm(cfg.path("sft"))
    value = load_reward_model(cfg.path("reward", "model")) if needs_values else None
    if c.gradient_checkpointing:  # activations recomputed in backward: memory for compute
        for model in (policy, value):
            if model is not None:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if c.lora.rank:
        policy = add_adapters(policy, c.lora, cfg.rl_seed)
        return policy, AdaptersOff(policy), value
    ref = load_causal_lm(cfg.path("sft")).requires_grad_(False) if needs_reference else None
    return policy, ref, value


def _place_frozen(model: nn.Module, acc: Accelerator) -> nn.Module:
    """A model that is never trained (the reference, the proxy RM) on the training device, as the original's
    prepare_deepspeed placed it: under ZeRO-3 a DeepSpeed inference engine sharded like the policy (gathered layer
    by layer in forward); otherwise a full replica, in bf16 when training in bf16 (the engine process's scorer
    loads them the same way: the same numbers on either side), run under the policy's autocast."""
    plugin = acc.state.deepspeed_plugin
    if plugin is None or plugin.zero_stage != 3:
        return model.to(acc.device, dtype=torch.bfloat16 if acc.mixed_precision == "bf16" else None)
    import deepspeed

    config = {k: v for k, v in plugin.deepspeed_config.items() if k not in ("optimizer", "scheduler")}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


def _scoring_side(c: TrainConfig, engine_name: str) -> str:
    """train.score_in_engine where it applies (the async engine), else "never": the learner scores. With several
    Ray engines "auto" is "always": each engine scores its slice of a batch, padded unlike the learner's whole part,
    so the last bits of a score would depend on which side scored it (and a run on timing)."""
    if not ENGINES[engine_name].samples_ahead:
        return "never"
    several = c.engine_backend == "ray" and c.num_engines > 1
    return "always" if several and c.score_in_engine == "auto" else c.score_in_engine


def _learner_scores(c: TrainConfig, engine_name: str) -> bool:
    """Whether the learner scores any batch (so it loads the reward model and the reference): unless the engine scores
    every batch, and the learner samples none itself (train.learner_first_batches)."""
    return _scoring_side(c, engine_name) != "always" or c.learner_first_batches > 0


def _setup_reward(cfg: Config, engine_name: str, reward: RewardSpec):
    """(the learner's reward function or None, the task's gold as a reward function or None).

    The learner always loads the gold (metrics of the training samples), so a bad judge folder fails here, naming
    it; with train.reward=gold the reward already is it; the math task's gold is the verifier without format bonus.
    """
    c = cfg.train
    reward_fn = reward.build() if _learner_scores(c, engine_name) else None
    if isinstance(reward_fn, GoldReward):
        return reward_fn, reward_fn
    if isinstance(reward_fn, RuleReward):  # the same problems without the format bonus: no second lookup table
        return reward_fn, RuleReward(reward_fn.answers)
    if c.reward == "rule":
        return reward_fn, RewardSpec.of(cfg, format_bonus=0.0).build()
    if c.reward != "gold" and not cfg.path("gold").exists():
        return reward_fn, None  # no judge: skip importing scikit-learn (~100 MB of RSS)
    return reward_fn, RewardSpec.gold(cfg).build()


def _engine_spec(
    cfg: Config, name: str, where: Placement | None, tokenizer, prompts, reward: RewardSpec
) -> EngineSpec | None:
    """The run's vLLM engine, placed `where` (None: the HF engine, which needs no spec). It starts from the SFT
    weights (version 0); a resumed run syncs its own weights right after."""
    if where is None:
        return None
    c = cfg.train
    score = _scoring_side(c, name)
    return EngineSpec(
        name,
        str(cfg.path("sft")),
        **token_ids(tokenizer),
        seed=cfg.rl_seed,
        max_model_len=max(map(len, prompts)) + c.response_length,
        where=where,
        work_dir=checkpoint_dir(cfg) / "engine",  # weights of batches in flight, for checkpoints (hard-linked)
        max_staleness=c.max_staleness,
        dtype=c.engine_dtype,
        reward=reward if score != "never" else None,
        reference=ReferenceSpec(c.temperature, c.mixed_precision == "bf16") if score != "never" else None,
        score=score,
        backend=c.engine_backend,
        num_engines=c.num_engines,
        resource=c.engine_resource,
        in_flight_step=_in_flight_step(c),
    )


def _in_flight_step(c: TrainConfig) -> int | None:
    """The decode step at which a batch takes the next weight version (train.in_flight_step, default half the
    response); None between batches."""
    if c.weight_updates != "in_flight":
        return None
    return c.response_length // 2 if c.in_flight_step is None else c.in_flight_step


def _start_engine_early(spec: EngineSpec | None, process) -> Engine | None:
    """On rank 0, an engine that runs in its own process starts building now (in `process` if the stage started
    one, rlhf.trainers.early); None otherwise, and for an engine on a GPU the learner uses too: that one is built
    once the learner's models are on the GPU (`_setup_engine`), so vLLM sizes its cache from what they leave."""
    if spec is None or not holds_own_process(spec.where) or spec.where.shares_gpu:
        return None
    return make_engine(spec, process)


def _setup_engine(spec: EngineSpec | None, early, policy, tokenizer, acc, process=None, learner_first=0) -> Engine:
    """The run's engine on every rank: with several training processes one engine on rank 0, shared
    (rlhf.generation.shared); the HF engine (no spec) samples from each rank's own model. `early`: the engine that
    started building first (`_start_engine_early`), else it is built now, in `process` when the stage started one.
    learner_first: train.learner_first_batches, for an async engine (rlhf.generation.learner_first)."""
    world = acc.num_processes
    hf = HFEngine(policy, device=acc.device, autocast=acc.autocast, **token_ids(tokenizer))  # references only: cheap
    if spec is None:
        return hf
    if world == 1:
        engine = early or make_engine(spec, process)
    else:
        engine = early if acc.process_index == 0 else None
        if engine is None and holds_own_process(spec.where):  # rank 0's engine on a shared GPU
            engine = make_engine(spec, process)
        engine = SharedEngine(engine, acc.process_index, world, lookahead=spec.lookahead)
    return LearnerFirst(hf, engine, learner_first) if learner_first and spec.lookahead else engine


def _setup_accelerator(c: TrainConfig) -> Accelerator:
    # On CPU, accelerate needs gloo spelled out or it believes there is one process (platform.md).
    distributed = env_int("WORLD_SIZE", 1, minimum=1) > 1
    kwargs = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    acc = Accelerator(
        gradient_accumulation_steps=c.gradient_accumulation_steps,
        mixed_precision="no" if c.mixed_precision == "fp32" else c.mixed_precision,
        kwargs_handlers=kwargs,
        # The prepared scheduler then steps once per optimizer step; by default it steps once per process (it
        # assumes each rank's dataloader batch grew W-fold), which ran the LR schedule W times too fast.
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = c.per_device_train_batch_size
        ds["gradient_accumulation_steps"] = c.gradient_accumulation_steps
        ds["gradient_clipping"] = c.max_grad_norm
        ds["zero_allow_untested_optimizer"] = True  # a torch AdamW: no DeepSpeed Adam build needed
        ds["train_batch_size"] = c.per_device_train_batch_size * c.gradient_accumulation_steps * acc.num_processes
    return acc


def _setup_optimization(c: TrainConfig, model: nn.Module, sizes: Sizes, device: torch.device):
    trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA the adapters only
    optimizer = adamw(trainable, device, lr=c.learning_rate, eps=1e-8, weight_decay=0.0)
    warmup = int(c.warmup_ratio * sizes.num_updates)
    scheduler = get_scheduler(c.lr_scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=sizes.num_updates)
    return optimizer, scheduler


def load_rl_prompts(cfg: Config, tokenizer) -> list[list[int]]:
    """The RL prompts as token ids, those that don't fit the context dropped (batch_prompts draws from them)."""
    from rlhf.data.splits import load_task_split

    df = load_task_split(cfg.path("prepared"), "rl_prompts", cfg.data.source)
    ids = encode_prompts(tokenizer, list(df["prompt"]), cfg.data.chat_template)
    room = cfg.model.max_position_embeddings - cfg.train.response_length if cfg.model.source == "tiny" else None
    kept = [p for p in ids if 0 < len(p) and (room is None or len(p) <= room)]
    if not kept:
        raise ValueError(f"rl_prompts: no prompt fits the context ({room} tokens left after train.response_length)")
    if len(kept) < len(ids):
        print(
            f"train: skipped {len(ids) - len(kept)} of {len(ids)} rl_prompts that are empty or longer than the "
            f"context ({room} tokens left after train.response_length)",
            file=sys.stderr,
        )
    return kept


def batch_prompts(prompts: list[list[int]], t: int, sizes: Sizes, rank: int, seed: int) -> list[list[int]]:
    """This rank's prompts of generated batch t: a pure function of t, so resume needs no dataloader state."""
    start = t * sizes.batch + rank * sizes.local_batch
    places = (divmod(i, len(prompts)) for i in range(start, start + sizes.local_batch))
    return [prompts[_epoch_order(len(prompts), seed + epoch)[j]] for epoch, j in places]


@functools.lru_cache(maxsize=4)  # a batch spans <= 2 epochs; each is drawn once, not twice a batch (submit, check)
def _epoch_order(n: int, seed: int) -> tuple[int, ...]:
    """The shuffle of n prompts for the epoch whose seed is `seed`."""
    return tuple(host_list(torch.randperm(n, generator=torch.Generator().manual_seed(seed))))
