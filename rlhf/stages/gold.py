"""Stage `gold`: fit the gold judge on gold_train, measure it on the disjoint gold_test, save it.

Outputs: data/gold (judge.json + weights.safetensors, no pickle) and data/metrics/gold.json with
held-out accuracy of the judge's score (> 0.5 = positive) overall and per source, and of the bare
classifier (without the repetition factor; the two should agree on real reviews).
"""

from __future__ import annotations

import time

from rlhf.config import Config
from rlhf.data.splits import load_split
from rlhf.io import atomic_dir, write_json
from rlhf.rewards.gold import GoldJudge


def run(cfg: Config) -> dict:
    """Fit, evaluate and save the judge; returns (and writes) the gold metrics."""
    train = load_split(cfg.path("prepared"), "gold_train")
    test = load_split(cfg.path("prepared"), "gold_test")
    start = time.perf_counter()
    judge = GoldJudge.fit(train["text"].tolist(), train["label"].to_numpy(), cfg.gold)
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
        "fit_seconds": round(fit_seconds, 2),
    }
    with atomic_dir(cfg.path("gold")) as tmp:  # outputs go together: the metrics are written before the judge moves in
        judge.save(tmp)
        write_json(cfg.path("metrics", "gold.json"), metrics)
    by_source = ", ".join(f"{s} {a:.3f}" for s, a in metrics["accuracy_by_source"].items())
    print(
        f"gold: held-out accuracy {metrics['accuracy']:.3f} ({by_source}) on {len(test)} texts; "
        f"fitted on {len(train)} in {fit_seconds:.1f}s -> {cfg.path('gold')}"
    )
    return metrics
