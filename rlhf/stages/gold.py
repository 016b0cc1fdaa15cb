"""Stage `gold`: fit the gold judge on gold_train, measure it on the disjoint gold_test, save it.

Outputs: data/gold (judge.json + weights.safetensors, no pickle) and data/metrics/gold.json:
- accuracy (overall and per source) of the judge's score (> 0.5 = positive) of whole reviews, judged alone (no
  prompt), and of the bare classifier (without the other factors; on real reviews they should cost little);
- at_response_length: the same of reviews cut as the task cuts them, scored as a response to their prompt: words
  [prompt_words, prompt_words + reference_words) after the first prompt_words (reviews with >= prompt_words +
  min_words words), so the relevance factor (how well a response continues its prompt) is in the score; 24 words
  say less of a review's sentiment than all of it (tiny: 0.69 with every factor, 0.72 the classifier alone);
- ignores_prompt: the median score of gold_test's real continuations and of responses that ignore the same prompts
  (rlhf.rewards.probes: one generic sentence of praise, off-topic text, sentences lifted from other reviews), with
  the share of prompts whose real continuation scores higher (ties one half);
- the context gain at which the fluency factor reaches 1 and the logit at which relevance does, both calibrated on
  real text cut as the task's responses are (held-out gold_train texts).
The math task's judge is the rule verifier (rlhf.rewards.rule): nothing to fit; data/gold then holds rule.json,
and the metrics how often the verifier reads the right answer back from the task's own worked texts (1.0).
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd

from rlhf.config import Config
from rlhf.data.splits import load_split, load_task_split
from rlhf.io import atomic_dir, write_json
from rlhf.rewards.gold import GoldJudge
from rlhf.rewards.probes import probes


def run(cfg: Config) -> dict:
    """Fit, evaluate and save the judge; returns (and writes) the gold metrics."""
    if cfg.data.source == "math":
        return _rule_judge(cfg)
    train = load_split(cfg.path("prepared"), "gold_train")
    test = load_split(cfg.path("prepared"), "gold_test")
    start = time.perf_counter()
    window = (cfg.data.prompt_words, cfg.data.prompt_words + cfg.data.reference_words)
    judge = GoldJudge.fit(train["text"].tolist(), train["label"].to_numpy(), cfg.gold, window)
    fit_seconds = time.perf_counter() - start

    texts, labels, sources = test["text"].tolist(), test["label"].to_numpy(), test["source"].to_numpy()
    correct = (judge.score([""] * len(texts), texts) > 0.5) == labels
    classifier_correct = (judge.probability(texts) > 0.5) == labels
    metrics = {
        "accuracy": float(correct.mean()),
        "accuracy_by_source": by_source(correct, sources),
        "classifier_accuracy": float(classifier_correct.mean()),
        "at_response_length": at_response_length(judge, test, window, cfg.gold.min_words),
        "ignores_prompt": ignores_prompt(judge, texts, labels, window, cfg.gold.min_words),
        "n_train": len(train),
        "n_test": len(test),
        "n_features": int(len(judge.coef)),
        "fluency_threshold": round(judge.fluency_threshold, 4),
        "relevance_threshold": round(judge.relevance.threshold, 4),
    }
    # The fit time is printed, not kept: a tracked file that changes with every run hides whether the results did.
    with atomic_dir(cfg.path("gold")) as tmp:  # outputs go together: the metrics are written before the judge moves in
        judge.save(tmp)
        write_json(cfg.path("metrics", "gold.json"), metrics)
    by_source_line = ", ".join(f"{s} {a:.3f}" for s, a in metrics["accuracy_by_source"].items())
    print(
        f"gold: held-out accuracy {metrics['accuracy']:.3f} ({by_source_line}) on {len(test)} texts; "
        f"fitted on {len(train)} in {fit_seconds:.1f}s -> {cfg.path('gold')}"
    )
    short, probes = metrics["at_response_length"], metrics["ignores_prompt"]
    short_line = ", ".join(f"{s} {a:.3f}" for s, a in short["accuracy_by_source"].items())
    probe_line = ", ".join(f"{name} {p['median']:.3f}" for name, p in probes.items() if isinstance(p, dict))
    print(
        f"gold: at response length accuracy {short['accuracy']:.3f} ({short_line}); median score of real "
        f"continuations {probes['real']:.3f}, of responses that ignore the prompt: {probe_line}"
    )
    return metrics


def by_source(correct: np.ndarray, sources: np.ndarray) -> dict[str, float]:
    """Accuracy per source of (N,) right/wrong flags."""
    return {s: float(correct[sources == s].mean()) for s in sorted(set(sources))}


def at_response_length(judge: GoldJudge, test: pd.DataFrame, window: tuple[int, int], min_words: int) -> dict:
    """Accuracy of reviews cut as the task cuts them, each scored as a response to its opening: words [window] of
    the reviews with >= window[0] + min_words words, after words [:window[0]]."""
    start, stop = window
    words = test["text"].str.split()
    cut = test[words.str.len() >= start + min_words]
    prompts = [" ".join(w[:start]) for w in words[cut.index]]
    responses = [" ".join(w[start:stop]) for w in words[cut.index]]
    labels, sources = cut["label"].to_numpy(), cut["source"].to_numpy()
    correct = (judge.score(prompts, responses) > 0.5) == labels
    classifier_correct = (judge.probability(responses) > 0.5) == labels
    return {
        "accuracy": float(correct.mean()) if len(cut) else None,  # None: no review is long enough
        "accuracy_by_source": by_source(correct, sources),
        "classifier_accuracy": float(classifier_correct.mean()) if len(cut) else None,
        "n_texts_by_source": {s: int((sources == s).sum()) for s in sorted(set(sources))},
    }


def ignores_prompt(judge: GoldJudge, texts: list[str], labels, window: tuple[int, int], min_words: int) -> dict:
    """Median score of real continuations ("real") and, per kind of response that ignores its prompt
    (rlhf.rewards.probes), its median and the share of prompts whose real continuation scores higher."""
    kinds = probes(texts, labels, window, min_words)
    scores = {kind: judge.score(prompts, responses) for kind, (prompts, responses) in kinds.items()}
    real = scores.pop("real")
    if len(real) == 0:  # no review is long enough to cut a prompt and a response from
        return {"n_prompts": 0}
    figures: dict = {"real": round(float(np.median(real)), 4), "n_prompts": len(real)}
    for kind, score in scores.items():
        real_wins = np.mean((real > score) + 0.5 * (real == score))
        figures[kind] = {"median": round(float(np.median(score)), 4), "real_wins": round(float(real_wins), 4)}
    return figures


def _rule_judge(cfg: Config) -> dict:
    from rlhf.data.math import worked
    from rlhf.rewards.rule import RULE_JUDGE, rule_score

    rl = load_task_split(cfg.path("prepared"), "rl_prompts", cfg.data.source)
    texts = worked(rl["prompt"], rl["answer"])
    correct = [rule_score(text, answer) for text, answer in zip(texts, rl["answer"])]
    metrics = {"judge": "rule", "verifier_reads_worked_answers": sum(correct) / len(correct), "n_texts": len(texts)}
    with atomic_dir(cfg.path("gold")) as tmp:
        write_json(tmp / "rule.json", RULE_JUDGE)
        write_json(cfg.path("metrics", "gold.json"), metrics)
    read = metrics["verifier_reads_worked_answers"]
    print(f"gold: the rule verifier is the judge; it reads back {read:.3f} of the worked answers")
    return metrics
