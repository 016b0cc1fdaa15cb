"""Stage `evaluate`: what the independent gold judge says of the trained policy, and how far it drifted.

- gold win-rate of the policy's near-greedy responses against the real references and against the SFT policy
  (per prompt; ties count one half);
- KL(policy || SFT) per sequence, estimated on the policy's OWN samples (train.temperature), summed over
  response tokens only (the original's "KL" was a perplexity with prompt tokens in its denominator);
- the proxy reward of both policies, so proxy-vs-gold divergence (over-optimisation) is visible.
Outputs: data/metrics/eval.json, data/plots/eval.csv (per-prompt results), data/eval (EvalResults dataset).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from rlhf import runtime
from rlhf.config import Config
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample, stage_engine
from rlhf.io import atomic_dir, write_json, write_text
from rlhf.models.forward import response_logprobs
from rlhf.rewards.proxy import ProxyReward


def win_rate(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a > b) + 0.5 * (a == b)))


@torch.no_grad()
def kl_and_proxy(
    policy, sft, reward_model, tokenizer, prompts: list[str], cfg: Config, device, engine=None
) -> tuple[np.ndarray, ...]:
    """Per prompt: sequence KL(policy || sft) on one policy sample (empty without `sft`), and the proxy reward of that
    sample. The models live on `device`; `engine` samples the policy (None: HF generate)."""
    params = SamplingParams(k=1, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.train.temperature)
    kls, proxies = [], []
    reward = ProxyReward(reward_model, device)
    batches = sample(
        policy, tokenizer, prompts, params, cfg.eval.batch_size, device, score=reward, desc="evaluate", engine=engine
    )
    for s in batches:
        b = s.batch
        inputs = (b.sequences, b.attn, b.positions, b.context, cfg.train.temperature)
        if sft is not None:
            kl = (response_logprobs(policy, *inputs) - response_logprobs(sft, *inputs)) * b.response_mask
            kls.append(kl.sum(1))
        proxies.append(s.scores)
    return (torch.cat(kls).cpu().numpy() if kls else np.zeros(0)), torch.cat(proxies).cpu().numpy()


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import EvalPrompts, EvalResults, Generations, validate
    from rlhf.data.splits import load_split, save_splits
    from rlhf.models.loading import load_causal_lm, load_reward_model, load_tokenizer
    from rlhf.rewards.gold import GoldJudge

    judge = GoldJudge.load(cfg.path("gold"))
    prompts = load_split(cfg.path("prepared"), "eval_prompts", EvalPrompts)
    gens = load_split(cfg.path("generations"), "eval", Generations)
    by_model = {name: df.set_index("prompt_id").loc[prompts["prompt_id"]] for name, df in gens.groupby("model")}
    gold = {name: judge.score(list(df["response"])) for name, df in by_model.items()}
    gold["reference"] = judge.score(list(prompts["reference"]))

    tokenizer, device = load_tokenizer(cfg.path("sft")), runtime.device()
    policy, sft = (load_causal_lm(cfg.path(*parts)).to(device) for parts in (("train", "policy"), ("sft",)))
    rm = load_reward_model(cfg.path("reward", "model")).to(device)
    texts, length = list(prompts["prompt"]), cfg.eval.max_new_tokens
    torch.manual_seed(cfg.seed)
    with stage_engine(cfg.eval.engine, cfg.path("train", "policy"), tokenizer, texts, length, device, cfg.seed) as e:
        kl, proxy_policy = kl_and_proxy(policy, sft, rm, tokenizer, texts, cfg, device, e)
    torch.manual_seed(cfg.seed)  # the SFT's samples must not depend on how much randomness the policy used
    with stage_engine(cfg.eval.engine, cfg.path("sft"), tokenizer, texts, length, device, cfg.seed) as e:
        _, proxy_sft = kl_and_proxy(sft, None, rm, tokenizer, texts, cfg, device, e)  # its KL to itself is 0
    proxy = {"policy": proxy_policy, "sft": proxy_sft}

    metrics = summarise(gold, kl, proxy)
    results = pd.concat(
        [
            pd.DataFrame(
                {
                    "prompt_id": prompts["prompt_id"].to_numpy(),
                    "model": name,
                    "gold": gold[name].astype(float),
                    "proxy": proxy[name].astype(float),
                    "kl": (kl if name == "policy" else np.zeros(len(prompts))).astype(float),
                }
            )
            for name in ("policy", "sft")
        ],
        ignore_index=True,
    )
    validate(results, EvalResults, "eval results")
    models = ["sft", "policy", "reference"]
    plot = pd.DataFrame({"model": models, "gold": [metrics[f"gold/{m}"] for m in models]})
    with atomic_dir(cfg.path("eval")) as tmp:  # outputs go together: metrics and plot before the results move in
        save_splits({"results": results}, tmp)
        write_json(cfg.path("metrics", "eval.json"), metrics)
        write_text(cfg.path("plots", "eval_gold.csv"), plot.to_csv(index=False))
    print("evaluate: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "n_prompts"))
    return metrics


def summarise(gold: dict[str, np.ndarray], kl: np.ndarray, proxy: dict[str, np.ndarray]) -> dict:
    """data/metrics/eval.json from per-prompt gold scores (policy, sft, reference), the policy's KL to the SFT
    policy and the proxy reward of both policies' samples."""
    return {
        "gold/win_rate_vs_sft": win_rate(gold["policy"], gold["sft"]),
        "gold/win_rate_vs_reference": win_rate(gold["policy"], gold["reference"]),
        "gold/sft_win_rate_vs_reference": win_rate(gold["sft"], gold["reference"]),
        "gold/policy": float(gold["policy"].mean()),
        "gold/sft": float(gold["sft"].mean()),
        "gold/reference": float(gold["reference"].mean()),
        "kl/policy_sft_mean": float(kl.mean()),
        "kl/policy_sft_std": float(kl.std()),
        "proxy/policy": float(proxy["policy"].mean()),
        "proxy/sft": float(proxy["sft"].mean()),
        "n_prompts": len(kl),
    }
