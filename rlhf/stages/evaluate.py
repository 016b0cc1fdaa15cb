"""Stage `evaluate`: what the independent gold judge says of the trained policy, and how far it drifted.

- gold win-rate of the policy's near-greedy responses against the real references and against the SFT policy
  (per prompt; ties count one half);
- KL(policy || SFT) per sequence, estimated on the policy's OWN samples (train.temperature), summed over
  response tokens only (the original's "KL" was a perplexity with prompt tokens in its denominator);
- the proxy reward of both policies, so proxy-vs-gold divergence (over-optimisation) is visible.
The same for each policy kept through training (train.eval_checkpoints), as the points of the frontier: gold
win-rate against KL to the SFT policy over the run (the paper's figure), data/plots/frontier.csv.
Outputs: data/metrics/eval.json, data/plots/eval_gold.csv, data/plots/frontier.csv, data/eval (EvalResults: per
prompt and policy).
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
from rlhf.stages.generate import models
from rlhf.tracking import log_results


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
    sft = load_causal_lm(cfg.path("sft")).to(device)
    rm = load_reward_model(cfg.path("reward", "model")).to(device)
    texts, length, policies = list(prompts["prompt"]), cfg.eval.max_new_tokens, models(cfg)
    kl, proxy = {"sft": np.zeros(len(prompts))}, {}  # the SFT policy's KL to itself is 0
    for name, (folder, _) in policies.items():
        policy, kl_to = (sft, None) if name == "sft" else (load_causal_lm(folder).to(device), sft)
        torch.manual_seed(cfg.seed)  # a model's samples must not depend on how much randomness the others used
        with stage_engine(cfg.eval.engine, folder, tokenizer, texts, length, device, cfg.seed) as e:
            policy_kl, proxy[name] = kl_and_proxy(policy, kl_to, rm, tokenizer, texts, cfg, device, e)
        if kl_to is not None:
            kl[name] = policy_kl

    metrics = summarise(gold, kl["policy"], proxy)
    frontier = frontier_table(gold, kl, proxy, {name: episode for name, (_, episode) in policies.items()})
    results = pd.concat(
        [
            pd.DataFrame(
                {
                    "prompt_id": prompts["prompt_id"].to_numpy(),
                    "model": name,
                    "gold": gold[name].astype(float),
                    "proxy": proxy[name].astype(float),
                    "kl": kl[name].astype(float),
                }
            )
            for name in policies
        ],
        ignore_index=True,
    )
    validate(results, EvalResults, "eval results")
    log_results(cfg, "evaluate", metrics, {"frontier": frontier})  # W&B (offline by default)
    bars = ["sft", "policy", "reference"]
    plot = pd.DataFrame({"model": bars, "gold": [metrics[f"gold/{m}"] for m in bars]})
    with atomic_dir(cfg.path("eval")) as tmp:  # outputs go together: metrics and plot before the results move in
        save_splits({"results": results}, tmp)
        write_json(cfg.path("metrics", "eval.json"), metrics)
        write_text(cfg.path("plots", "eval_gold.csv"), plot.to_csv(index=False))
        write_text(cfg.path("plots", "frontier.csv"), frontier.to_csv(index=False))
    print("evaluate: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "n_prompts"))
    return metrics


def frontier_table(
    gold: dict[str, np.ndarray], kl: dict[str, np.ndarray], proxy: dict[str, np.ndarray], episodes: dict[str, int]
) -> pd.DataFrame:
    """data/plots/frontier.csv: a row per policy along the run, by episode (the SFT policy at 0, the final policy
    last): gold win-rates, KL to the SFT policy, mean gold and proxy scores."""
    total = max(episodes.values())
    rows = [
        {
            "episode": episode,
            "fraction": episode / total,
            "kl": float(kl[name].mean()),
            "win_rate_vs_sft": win_rate(gold[name], gold["sft"]),
            "win_rate_vs_reference": win_rate(gold[name], gold["reference"]),
            "gold": float(gold[name].mean()),
            "proxy": float(proxy[name].mean()),
        }
        for name, episode in sorted(episodes.items(), key=lambda item: item[1])
    ]
    return pd.DataFrame(rows)


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
