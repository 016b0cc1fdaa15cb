"""Stage `evaluate`: what the independent gold judge says of the trained policy, and how far it drifted.

- gold win-rate of the policy's near-greedy responses against the real references and against the SFT policy
  (per prompt; ties count one half);
- KL(policy || SFT) per sequence, estimated on the policy's OWN samples (train.temperature), summed over
  response tokens only (the original's "KL" was a perplexity with prompt tokens in its denominator);
- the proxy reward of both policies, so proxy-vs-gold divergence (over-optimisation) is visible;
- diversity across prompts of each model's responses (`diversity`): a policy that writes one text whatever the
  prompt, or a few stock phrases, shows it here whatever gold says of the text.
The same for each policy kept through training (train.eval_checkpoints), as the points of the frontier: gold
win-rate against KL to the SFT policy over the run (the paper's figure), data/plots/frontier.csv.
Outputs: data/metrics/eval.json, data/plots/eval_gold.csv, data/plots/frontier.csv, data/eval (EvalResults: per
prompt and policy). Each model's sampling, scoring and KL is one job (`_kl_and_scores_of`); eval.processes runs
that many at once, each in its own process (rlhf.runtime.map_in_processes), seeded alike: the same numbers.

The math task (data.source: math) has the rule verifier for gold and no proxy RM: its exact-match accuracy of the
near-greedy answers (overall and by difficulty), pass@k over eval.pass_k samples at train.temperature and the KL on
the first of them; its frontier's win-rate vs SFT counts a problem the policy gets right and the SFT policy wrong as
a win, both right or both wrong as a tie (0.5 + accuracy gain / 2). data/eval then holds MathResults.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from rlhf import runtime
from rlhf.config import Config, profile_note
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample, stage_engine
from rlhf.io import atomic_dir, write_json, write_text
from rlhf.models.forward import sequence_kl
from rlhf.rewards.proxy import ProxyReward
from rlhf.stages.generate import models, processes
from rlhf.tracking import log_results

_WORD = re.compile(r"\w+(?:'\w+)?")


def wins(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per prompt, a's outcome against b by the gold: 1 a win, 0.5 a tie, 0 a loss. Shapes: (n,), (n,) -> (n,)."""
    return (a > b) + 0.5 * (a == b)


def win_rate(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(wins(a, b)))


def diversity(texts: list[str]) -> dict[str, float]:
    """How much a set of responses (one per prompt) differs across prompts, on lowercased words:
    distinct_1 / distinct_2: distinct word unigrams / bigrams over all of them in the set (Li et al. 2016,
    "distinct-n"; 0 when there are none); repeated: the share of responses whose words another prompt's response
    has too (the same text whatever the prompt)."""
    words = [tuple(_WORD.findall(t.lower())) for t in texts]
    grams = {n: [w[i : i + n] for w in words for i in range(len(w) - n + 1)] for n in (1, 2)}
    copies = Counter(words)
    return {
        **{f"distinct_{n}": len(set(g)) / len(g) if g else 0.0 for n, g in grams.items()},
        "repeated": sum(c for c in copies.values() if c > 1) / max(len(texts), 1),
    }


@torch.no_grad()
def kl_and_scores(
    policy, sft, reward, tokenizer, prompts: list[list[int]], cfg: Config, device, engine=None, k: int = 1
) -> tuple[np.ndarray, ...]:
    """On the policy's own samples at train.temperature, k per prompt: per prompt, the sequence KL(policy || sft) of
    its first sample (empty without `sft`: two forwards a prompt, whatever k), and per sample (prompt-major) its
    `reward` (a reward function, rlhf.rewards.proxy). The models live on `device`; `engine` samples the policy
    (None: HF generate)."""
    params = SamplingParams(k=k, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.train.temperature)
    kls, proxies = [], []
    batches = sample(
        policy, tokenizer, prompts, params, cfg.eval.batch_size, device, score=reward, desc="evaluate", engine=engine
    )
    for s in batches:
        b = s.batch
        if sft is not None:  # on each prompt's first sample
            kls.append(sequence_kl(policy, sft, b, cfg.train.temperature, slice(None, None, k)))
        proxies.append(s.scores)
    return (torch.cat(kls).cpu().numpy() if kls else np.zeros(0)), torch.cat(proxies).cpu().numpy()


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import Generations
    from rlhf.data.splits import load_split, load_task_split

    prompts = load_task_split(cfg.path("prepared"), "eval_prompts", cfg.data.source)
    gens = load_split(cfg.path("generations"), "eval", Generations)
    by_model = {name: df.set_index("prompt_id").loc[prompts["prompt_id"]] for name, df in gens.groupby("model")}
    responses = {name: list(df["response"]) for name, df in by_model.items()}

    policies = models(cfg)
    jobs = [(cfg, name, folder, list(prompts["prompt"])) for name, (folder, _) in policies.items()]
    results = runtime.map_in_processes(_kl_and_scores_of, jobs, processes(cfg, runtime.device()))
    kl = {name: policy_kl for name, (policy_kl, _) in zip(policies, results)}
    scores = {name: model_scores for name, (_, model_scores) in zip(policies, results)}
    episodes = {name: episode for name, (_, episode) in policies.items()}
    if cfg.data.source == "math":
        metrics = _write_math(cfg, prompts, responses, scores, kl, episodes)
    else:
        metrics = _write(cfg, prompts, responses, scores, kl, episodes)
    print("evaluate: " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items() if k != "n_prompts"))
    if note := profile_note(cfg.profile):
        print(f"evaluate: {note}")
    return metrics


def _kl_and_scores_of(job: tuple[Config, str, Path, list[str]]) -> tuple[np.ndarray, np.ndarray]:
    """kl_and_scores of the model `name` saved in `folder` on the prompts (texts): its KL to the SFT policy per
    prompt (zeros for the SFT policy itself) and the reward of each of its samples (the proxy RM; the verifier on
    the math task, eval.pass_k samples a problem)."""
    from rlhf.models.loading import encode_prompts, load_causal_lm, load_tokenizer

    cfg, name, folder, texts = job
    tokenizer, device = load_tokenizer(cfg.path("sft")), runtime.device()
    math = cfg.data.source == "math"
    reward = _verifier(cfg) if math else _proxy(cfg, device)
    sft = load_causal_lm(cfg.path("sft")).to(device)
    ids = encode_prompts(tokenizer, texts, cfg.data.chat_template)
    policy, kl_to = (sft, None) if name == "sft" else (load_causal_lm(folder).to(device), sft)
    torch.manual_seed(cfg.seed)  # a model's samples must not depend on how much randomness the others used
    with stage_engine(cfg.eval.engine, folder, tokenizer, ids, cfg.eval.max_new_tokens, device, cfg.seed) as e:
        policy_kl, scores = kl_and_scores(
            policy, kl_to, reward, tokenizer, ids, cfg, device, e, cfg.eval.pass_k if math else 1
        )
    return (policy_kl if kl_to is not None else np.zeros(len(ids))), scores  # the SFT policy's KL to itself is 0


def _proxy(cfg: Config, device) -> ProxyReward:
    from rlhf.models.loading import load_reward_model

    return ProxyReward(load_reward_model(cfg.path("reward", "model")).to(device), device)


def _write(cfg: Config, prompts, responses: dict[str, list[str]], proxy, kl, episodes: dict[str, int]) -> dict:
    """The reviews/tldr task's outputs: gold scores of each policy's responses and of the references."""
    from rlhf.data.schemas import EvalResults, validate
    from rlhf.rewards.gold import GoldJudge

    judge = GoldJudge.load(cfg.path("gold"))
    openings = list(prompts["prompt"])  # responses are in prompt order, each the continuation of its prompt
    gold = {name: judge.score(openings, texts) for name, texts in responses.items()}
    gold["reference"] = judge.score(openings, list(prompts["reference"]))
    texts = {**responses, "reference": list(prompts["reference"])}
    metrics = summarise(gold, kl["policy"], proxy, texts)
    frontier = frontier_table(gold, kl, proxy, episodes, texts)
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
            for name in episodes
        ],
        ignore_index=True,
    )
    validate(results, EvalResults, "eval results")
    log_results(cfg, "evaluate", metrics, {"frontier": frontier})  # W&B (offline by default)
    bars = ["sft", "policy", "reference"]
    plot = pd.DataFrame({"model": bars, "gold": [metrics[f"gold/{m}"] for m in bars]})
    write_outputs(cfg, {"results": results}, metrics, plot, frontier)
    return metrics


def write_outputs(cfg: Config, results: dict[str, pd.DataFrame], metrics: dict, plot, frontier) -> None:
    """data/eval, data/metrics/eval.json, data/plots/eval_gold.csv and frontier.csv, together: the metrics and plots
    are written before the results folder moves in."""
    from rlhf.data.splits import save_splits

    with atomic_dir(cfg.path("eval")) as tmp:
        save_splits(results, tmp)
        write_json(cfg.path("metrics", "eval.json"), metrics)
        write_text(cfg.path("plots", "eval_gold.csv"), plot.to_csv(index=False))
        write_text(cfg.path("plots", "frontier.csv"), frontier.to_csv(index=False))


def frontier_table(
    gold: dict[str, np.ndarray],
    kl: dict[str, np.ndarray],
    proxy: dict[str, np.ndarray],
    episodes: dict[str, int],
    texts: dict[str, list[str]],
) -> pd.DataFrame:
    """data/plots/frontier.csv: a row per policy along the run, by episode (the SFT policy at 0, the final policy
    last): gold win-rates, KL to the SFT policy, mean gold and proxy scores, its responses' `diversity`."""
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
            **diversity(texts[name]),
        }
        for name, episode in sorted(episodes.items(), key=lambda item: item[1])
    ]
    return pd.DataFrame(rows)


def summarise(
    gold: dict[str, np.ndarray], kl: np.ndarray, proxy: dict[str, np.ndarray], texts: dict[str, list[str]]
) -> dict:
    """data/metrics/eval.json from per-prompt gold scores (policy, sft, reference), the policy's KL to the SFT
    policy, the proxy reward of both policies' samples and the texts of policy, sft and reference (`diversity`)."""
    spread = {f"diversity/{m}_{k}": v for m in ("policy", "sft", "reference") for k, v in diversity(texts[m]).items()}
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
        **spread,
        "n_prompts": len(kl),
    }


# --- the math task ----------------------------------------------------------------------------------------


def _verifier(cfg: Config):
    """The rule verifier as a reward function (no format bonus): 1 per right sample, else 0."""
    from rlhf.rewards.proxy import RewardSpec

    return RewardSpec.of(cfg, format_bonus=0.0).build()


def _write_math(cfg: Config, prompts: pd.DataFrame, responses: dict, sampled: dict, kl: dict, episodes: dict) -> dict:
    """prompts: eval_prompts (MathProblems); responses: model -> near-greedy texts in prompt order; sampled: model ->
    (n * k,) 0/1 of its samples, prompt-major; kl: model -> (n,) KL to the SFT policy; episodes: model -> episode.
    Writes the stage's outputs, returns the metrics."""
    from rlhf.data.schemas import MathResults, validate
    from rlhf.rewards.rule import rule_score

    k = cfg.eval.pass_k
    n = len(prompts)
    answers = list(prompts["answer"])
    right = {m: np.array([rule_score(t, a) for t, a in zip(texts, answers)]) for m, texts in responses.items()}
    per_problem = {m: s.reshape(n, k) for m, s in sampled.items()}
    metrics = summarise_math(right, per_problem, kl, prompts["difficulty"].to_numpy(), k)
    frontier = pd.DataFrame(
        [
            {
                "episode": episode,
                "fraction": episode / max(episodes.values()),
                "kl": float(kl[m].mean()),
                "win_rate_vs_sft": win_rate(right[m], right["sft"]),
                "accuracy": float(right[m].mean()),
                f"pass_at_{k}": float(per_problem[m].max(1).mean()),
            }
            for m, episode in sorted(episodes.items(), key=lambda item: item[1])
        ]
    )
    results = pd.concat(
        [
            pd.DataFrame(
                {
                    "prompt_id": prompts["prompt_id"].to_numpy(),
                    "model": m,
                    "correct": right[m].astype(int),
                    "samples_correct": per_problem[m].mean(1).astype(float),
                    "kl": kl[m].astype(float),
                }
            )
            for m in episodes
        ],
        ignore_index=True,
    )
    validate(results, MathResults, "eval results (math)")
    log_results(cfg, "evaluate", metrics, {"frontier": frontier})
    plot = pd.DataFrame({"model": ["sft", "policy"], "gold": [metrics["accuracy/sft"], metrics["accuracy/policy"]]})
    write_outputs(cfg, {"results": results}, metrics, plot, frontier)
    return metrics


def summarise_math(right: dict, sampled: dict, kl: dict, difficulty: np.ndarray, k: int) -> dict:
    """data/metrics/eval.json of the math task from 0/1 per problem (right), (n, k) 0/1 per sample (sampled), the
    KL of the policy's samples and each problem's difficulty."""
    metrics = {"n_prompts": len(difficulty), "kl/policy_sft_mean": float(kl["policy"].mean())}
    metrics["kl/policy_sft_std"] = float(kl["policy"].std())
    for m in ("policy", "sft"):
        metrics[f"accuracy/{m}"] = float(right[m].mean())
        metrics[f"pass_at_{k}/{m}"] = float(sampled[m].max(1).mean())
        metrics[f"sample_accuracy/{m}"] = float(sampled[m].mean())
        for level in sorted(set(difficulty.tolist())):
            metrics[f"accuracy/{m}_difficulty_{level}"] = float(right[m][difficulty == level].mean())
    metrics["accuracy/gain"] = metrics["accuracy/policy"] - metrics["accuracy/sft"]
    return metrics
