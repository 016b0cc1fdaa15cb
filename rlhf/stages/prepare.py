"""Stage `prepare`: build every split of the task, validate each with its schema, save them reproducibly.

Outputs: data/prepared (a DatasetDict folder, see rlhf.data.splits for the split names and schemas) and
data/metrics/prepare.json (split sizes, sentiment balance). Same inputs -> byte-identical outputs.
"""

from __future__ import annotations

import hashlib

import pandas as pd

from rlhf.config import Config
from rlhf.data.schemas import validate
from rlhf.data.splits import save_splits, split_schemas
from rlhf.io import atomic_dir, write_json


def _reviews_splits(cfg: Config) -> tuple[dict[str, pd.DataFrame], dict]:
    from rlhf.data import reviews

    path = reviews.reviews_csv(cfg.data)
    raw = reviews.read_reviews(path)
    splits = reviews.build_splits(raw, cfg.data, cfg.seed)
    # Prompts keep the review id, so the sentiment of the review each prompt opens can be reported:
    # RL should make continuations positive starting from a mix, not from already-positive openings.
    positive = {
        name: reviews.positive_fraction(raw, splits[name]["prompt_id"])
        for name in ("reward_prompts", "rl_prompts", "eval_prompts")
    }
    # name + content hash, not the absolute path: the metrics file must not change from machine to machine
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    info = {
        "source_file": f"{path.name} (sha256 {digest})",
        "reviews_after_cleaning": len(raw),
        "prompt_source_positive_fraction": positive,
    }
    return splits, info


def _tldr_splits(cfg: Config) -> tuple[dict[str, pd.DataFrame], dict]:
    from rlhf.data import tldr

    splits = tldr.load_splits(cfg.data, cfg.seed)
    return splits, {"source_datasets": [cfg.data.tldr_prompts_dataset, cfg.data.tldr_pairs_dataset]}


def _math_splits(cfg: Config) -> tuple[dict[str, pd.DataFrame], dict]:
    from rlhf.data import math

    splits = math.build_splits(cfg.data, cfg.seed)
    mix = {name: splits[name]["difficulty"].value_counts().sort_index() for name in ("rl_prompts", "eval_prompts")}
    return splits, {"difficulty_counts": {name: {str(k): int(v) for k, v in c.items()} for name, c in mix.items()}}


SOURCES = {"reviews": _reviews_splits, "tldr": _tldr_splits, "math": _math_splits}


def run(cfg: Config) -> dict:
    """Build, validate and save the splits; returns (and writes) the prepare metrics."""
    splits, info = SOURCES[cfg.data.source](cfg)
    for name, schema in split_schemas(cfg.data.source).items():
        validate(splits[name], schema, f"split {name!r} (built by prepare, data.source={cfg.data.source})")
    folder = cfg.path("prepared")
    metrics = {"source": cfg.data.source, "split_sizes": {name: len(df) for name, df in splits.items()}, **info}
    if "gold_train" in splits:
        gold = ("gold_train", "gold_test")
        metrics["gold_positive_fraction"] = {name: float(splits[name]["label"].mean()) for name in gold}
    with atomic_dir(folder) as tmp:  # outputs go together: the metrics are written before the splits move in
        save_splits(splits, tmp)
        write_json(cfg.path("metrics", "prepare.json"), metrics)
    sizes = ", ".join(f"{name} {n}" for name, n in metrics["split_sizes"].items())
    print(f"prepare: {sizes} -> {folder}")
    if "prompt_source_positive_fraction" in info:
        mix = ", ".join(f"{k} {v:.2f}" for k, v in info["prompt_source_positive_fraction"].items())
        print(f"prepare: positive fraction of the reviews behind the prompts: {mix}")
    return metrics
