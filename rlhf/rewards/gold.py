"""The gold judge: the stand-in for the paper's gold reward model on the offline reviews task.

A TF-IDF (word 1..ngram_max grams) + logistic-regression sentiment classifier fitted on human labels. It
shares nothing with the policies or the proxy reward model, so RL can over-optimise the proxy while gold
tells how good the text really is (the paper's over-optimisation setting).

score(text) = P(positive | text) * repetition_factor(text), in [0, 1].

A bag-of-n-grams classifier alone is easy to game: "great great great great" gets P(positive) ~ 0.94. The
repetition factor pulls such degenerate text toward 0, so reward hacking by repetition shows up as a
*falling* gold score instead of hiding behind a rising one.

Saved without pickle (a pickle can run code on load): `judge.json` holds the settings and the vocabulary,
`weights.safetensors` holds idf, coef and intercept. Loading rebuilds the vectorizer from them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression

from rlhf.config import GoldConfig
from rlhf.data.schemas import DataError
from rlhf.io import atomic_dir, write_json

FORMAT_VERSION = 1
JUDGE_JSON = "judge.json"
WEIGHTS = "weights.safetensors"
# Distinct-word ratio is measured per window of this many words: over a whole 200-word review it falls
# to ~0.5 just from "the"/"a" recurring, while 32-word windows of real reviews stay >= 0.62 (99.9%).
REPETITION_WINDOW = 32
_WORD = re.compile(r"\w+(?:'\w+)?")
# Vectorizer settings fixed here (not tuned per run); sublinear tf damps a word repeated many times.
_VECTORIZER = {
    "lowercase": True,
    "token_pattern": r"(?u)\b\w\w+\b",
    "sublinear_tf": True,
    "norm": "l2",
    "smooth_idf": True,
}


def distinct_ratio(text: str, window: int = REPETITION_WINDOW) -> float:
    """min(distinct-word ratio averaged over `window`-word chunks, distinct-bigram ratio); 0 for no words.

    Natural review text scores >= 0.62 on 99.9% of reviews; "great great great great great" scores 0.2.
    """
    words = _WORD.findall(text.lower())
    if not words:
        return 0.0
    chunks = [words[i : i + window] for i in range(0, len(words), window)]
    unigram = float(np.mean([len(set(c)) / len(c) for c in chunks]))
    bigrams = list(zip(words, words[1:]))
    bigram = len(set(bigrams)) / len(bigrams) if bigrams else 1.0
    return min(unigram, bigram)


def repetition_factor(texts: list[str], floor: float) -> np.ndarray:
    """(B,) in [0, 1]: 1 where distinct_ratio >= floor, else (ratio / floor)**2 (0 for empty text).

    Squared so that the score drops fast: ratio 0.2 with floor 0.6 keeps 1/9 of P(positive).
    """
    ratios = np.array([distinct_ratio(t) for t in texts], dtype=np.float64)
    return np.minimum(1.0, ratios / floor) ** 2


@dataclass(frozen=True)
class GoldJudge:
    """Fitted judge. vectorizer: TF-IDF with fixed vocabulary/idf; coef (V,), intercept: the logistic model."""

    vectorizer: TfidfVectorizer
    coef: np.ndarray
    intercept: float
    repetition_floor: float

    @classmethod
    def fit(cls, texts: list[str], labels: list[int] | np.ndarray, cfg: GoldConfig) -> GoldJudge:
        """Fit on human labels (1 = positive). texts: N strings; labels: N ints in {0, 1}."""
        labels = np.asarray(labels)
        if len(texts) != len(labels) or len(texts) == 0:
            raise ValueError(f"GoldJudge.fit: {len(texts)} texts and {len(labels)} labels (need equal, > 0)")
        if set(np.unique(labels).tolist()) != {0, 1}:
            raise ValueError(f"GoldJudge.fit: labels must contain both 0 and 1, got {sorted(set(labels.tolist()))}")
        vectorizer = TfidfVectorizer(ngram_range=(1, cfg.ngram_max), min_df=cfg.min_df, dtype=np.float64, **_VECTORIZER)
        features = vectorizer.fit_transform(texts)
        model = LogisticRegression(
            C=cfg.c, max_iter=2000, solver="liblinear", random_state=0
        )  # fixed: same data -> same bytes
        model.fit(features, labels)
        return cls(vectorizer, model.coef_[0].astype(np.float64), float(model.intercept_[0]), cfg.repetition_floor)

    def probability(self, texts: list[str]) -> np.ndarray:
        """(B,) P(positive) of the classifier alone (no repetition factor)."""
        logits = self.vectorizer.transform(texts) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))

    def score(self, texts: list[str]) -> np.ndarray:
        """(B,) gold score in [0, 1] = P(positive) * repetition factor; empty text scores 0."""
        texts = list(texts)
        if not texts:
            return np.zeros(0, dtype=np.float64)
        return self.probability(texts) * repetition_factor(texts, self.repetition_floor)

    def save(self, folder: Path | str) -> None:
        """Write judge.json (settings, vocabulary) and weights.safetensors (idf, coef, intercept) atomically."""
        vocabulary = self.vectorizer.get_feature_names_out().tolist()  # ordered by column index
        settings = {
            "format": FORMAT_VERSION,
            "ngram_range": list(self.vectorizer.ngram_range),
            "vectorizer": _VECTORIZER,
            "repetition_floor": self.repetition_floor,
            "repetition_window": REPETITION_WINDOW,
            "vocabulary": vocabulary,
        }
        weights = {
            "idf": np.ascontiguousarray(self.vectorizer.idf_, dtype=np.float64),
            "coef": np.ascontiguousarray(self.coef, dtype=np.float64),
            "intercept": np.array([self.intercept], dtype=np.float64),
        }
        with atomic_dir(folder) as tmp:
            write_json(tmp / JUDGE_JSON, settings)
            save_file(weights, str(tmp / WEIGHTS))

    @classmethod
    def load(cls, folder: Path | str) -> GoldJudge:
        """Rebuild a saved judge; a missing or corrupt folder raises DataError naming it."""
        folder = Path(folder)
        hint = "run `rlhf gold` to fit the gold judge"
        if not (folder / JUDGE_JSON).is_file() or not (folder / WEIGHTS).is_file():
            raise DataError(f"gold judge not found in {folder} (needs {JUDGE_JSON} and {WEIGHTS}); {hint}")
        try:
            settings = json.loads((folder / JUDGE_JSON).read_text(encoding="utf-8"))
            weights = load_file(str(folder / WEIGHTS))
            if settings.get("format") != FORMAT_VERSION:
                raise ValueError(f"format {settings.get('format')!r}, expected {FORMAT_VERSION}")
            vocabulary = settings["vocabulary"]
            idf, coef, intercept = weights["idf"], weights["coef"], weights["intercept"]
            if not (len(vocabulary) == idf.shape[0] == coef.shape[0]) or intercept.shape != (1,):
                raise ValueError(f"sizes disagree: vocabulary {len(vocabulary)}, idf {idf.shape}, coef {coef.shape}")
            vectorizer = TfidfVectorizer(
                ngram_range=tuple(settings["ngram_range"]),
                vocabulary=vocabulary,
                dtype=np.float64,
                **settings["vectorizer"],
            )
            vectorizer.idf_ = idf
        except (ValueError, KeyError, TypeError, OSError, SafetensorError) as e:  # JSONDecodeError is a ValueError
            raise DataError(f"gold judge in {folder} is corrupt ({type(e).__name__}: {e}); {hint}") from None
        return cls(vectorizer, coef, float(intercept[0]), float(settings["repetition_floor"]))
