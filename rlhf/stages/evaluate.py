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

from rlhf.algorithms.common import truncate_after_eos
from rlhf.config import Config
from rlhf.generation.base import SamplingParams, pad_left
from rlhf.generation.hf import HFEngine
from rlhf.io import write_json
from rlhf.trainers.forward import attention_and_positions, response_logprobs, sequence_scores


def win_rate(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((a > b) + 0.5 * (a == b)))


@torch.no_grad()
def kl_and_proxy(policy, sft, reward_model, tokenizer, prompts: list[str], cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: sequence KL(policy || sft) on one policy sample, and the proxy reward of that sample."""
    engine = HFEngine(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
    params = SamplingParams(k=1, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.train.temperature)
    kls, proxies = [], []
    for i in range(0, len(prompts), cfg.eval.batch_size):
        ids = tokenizer(prompts[i : i + cfg.eval.batch_size])["input_ids"]
        engine.submit(ids, params)
        responses, mask, _ = truncate_after_eos(engine.receive().responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
        prompt_ids, prompt_mask = pad_left(ids, tokenizer.pad_token_id)
        attn, pos = attention_and_positions(prompt_mask, mask)
        seq, context = torch.cat([prompt_ids, responses], 1), prompt_ids.shape[1]
        logp, _ = response_logprobs(policy, seq, attn, pos, context, cfg.train.temperature)
        ref, _ = response_logprobs(sft, seq, attn, pos, context, cfg.train.temperature)
        kls.append(((logp - ref) * mask).sum(1))
        proxies.append(sequence_scores(reward_model, seq, attn, pos, context, mask.sum(1) - 1))
    return torch.cat(kls).numpy(), torch.cat(proxies).numpy()


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
    gold_ref = judge.score(list(prompts["reference"]))

    tokenizer = load_tokenizer(cfg.path("sft"))
    policy, sft = load_causal_lm(cfg.path("train", "policy")), load_causal_lm(cfg.path("sft"))
    rm = load_reward_model(cfg.path("reward", "model"))
    texts = list(prompts["prompt"])
    torch.manual_seed(cfg.seed)
    kl_policy, proxy_policy = kl_and_proxy(policy, sft, rm, tokenizer, texts, cfg)
    torch.manual_seed(cfg.seed)  # the SFT's samples must not depend on how much randomness the policy used
    _, proxy_sft = kl_and_proxy(sft, sft, rm, tokenizer, texts, cfg)

    metrics = {
        "gold/win_rate_vs_sft": win_rate(gold["policy"], gold["sft"]),
        "gold/win_rate_vs_reference": win_rate(gold["policy"], gold_ref),
        "gold/sft_win_rate_vs_reference": win_rate(gold["sft"], gold_ref),
        "gold/policy": float(gold["policy"].mean()),
        "gold/sft": float(gold["sft"].mean()),
        "gold/reference": float(gold_ref.mean()),
        "kl/policy_sft_mean": float(kl_policy.mean()),
        "kl/policy_sft_std": float(kl_policy.std()),
        "proxy/policy": float(proxy_policy.mean()),
        "proxy/sft": float(proxy_sft.mean()),
        "n_prompts": len(prompts),
    }
    results = pd.concat([
        pd.DataFrame({"prompt_id": prompts["prompt_id"].to_numpy(), "model": name, "gold": gold[name].astype(float),
                      "proxy": (proxy_policy if name == "policy" else proxy_sft).astype(float),
                      "kl": (kl_policy if name == "policy" else np.zeros(len(prompts))).astype(float)})
        for name in ("policy", "sft")
    ], ignore_index=True)
    validate(results, EvalResults, "eval results")
    save_splits({"results": results}, cfg.path("eval"))
    write_json(cfg.path("metrics", "eval.json"), metrics)
    cfg.path("plots").mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"model": ["sft", "policy", "reference"], "gold": [metrics["gold/sft"], metrics["gold/policy"], metrics["gold/reference"]]}).to_csv(cfg.path("plots", "eval_gold.csv"), index=False)
    print("evaluate: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "n_prompts"))
    return metrics
