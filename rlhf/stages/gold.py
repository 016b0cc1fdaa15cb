"""Stage `gold`: fit the gold judge on gold_train, measure it on the disjoint gold_test, save it.

Outputs: data/gold (judge.json + weights.safetensors, no pickle) and data/metrics/gold.json with
held-out accuracy of the judge's score (> 0.5 = positive) overall and per source, and of the bare
classifier (without the repetition, fluency and length factors; on real reviews they should cost little), and
the context gain at which the fluency factor reaches 1, calibrated on real text cut as the task's responses are
(words prompt_words .. prompt_words + reference_words of held-out gold_train texts).
The math task's judge is the rule verifier (rlhf.rewards.rule): nothing to fit; data/gold then holds rule.json,
and the metrics how often the verifier reads the right answer back from the task's own worked texts (1.0).
"""

from __future__ import annotations

import time

from rlhf.config import Config
from rlhf.data.splits import load_split, load_task_split
from rlhf.io import atomic_dir, write_json
from rlhf.rewards.gold import GoldJudge


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

    labels = test["label"].to_numpy()
    correct = (judge.score(test["text"].tolist()) > 0.5) == labels
    classifier_correct = (judge.probability(test["text"].tolist()) > 0.5) == labels
    sources = test["source"].to_numpy()
    metrics = {
        "accuracy": float(correct.mean()),
        "accuracy_by_source": {s: float(correct[sources == s].mean()) for s in sorted(set(sources))},
        "classifier_accuracy": float(classifier_correct.mean()),
        "n_train": len(train),
        "n_test": len(test),
        "n_features": int(len(judge.coef)),
        "fluency_threshold": round(judge.fluency_threshold, 4),
    }
    # The fit time is printed, not kept: a tracked file that changes with every run hides whether the results did.
    with atomic_dir(cfg.path("gold")) as tmp:  # outputs go together: the metrics are written before the judge moves in
        judge.save(tmp)
        write_json(cfg.path("metrics", "gold.json"), metrics)
    by_source = ", ".join(f"{s} {a:.3f}" for s, a in metrics["accuracy_by_source"].items())
    print(
        f"gold: held-out accuracy {metrics['accuracy']:.3f} ({by_source}) on {len(test)} texts; "
        f"fitted on {len(train)} in {fit_seconds:.1f}s -> {cfg.path('gold')}"
    )
    return metrics


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
