"""The gold judge: the stand-in for the paper's gold reward model on the offline reviews task.

score(prompt, response) = P(positive | response) * repetition * fluency * length * relevance, each in [0, 1]:
- P(positive): a TF-IDF (word 1..ngram_max grams) + logistic-regression sentiment classifier of the human labels;
- repetition: 1 unless the text's distinct-word or distinct-bigram ratio falls below what real text shows;
- fluency: how well a word trigram LM of real reviews (rlhf.rewards.fluency) predicts each token beyond the
  token's plain frequency, relative to held-out real text: 1 at or above the `fluency_quantile` of real
  continuations, falling exponentially below it: e^-2 = 0.14 at no gain at all (text whose word order
  predicts nothing), ~0.005 for shuffled review words; never exactly 0, so degenerate texts stay ranked (the
  reward stage's pairs and RL keep a direction out of degeneracy instead of ties);
- length: words / min_words below min_words (a response cut after a few words), else 1;
- relevance: whether the response continues its own prompt (rlhf.rewards.relevance): how well the prompt's last
  words predict the response's first ones and whether both are about the same things, with no sentiment in the
  evidence (turning a negative opening positive is the task); 1 at or above the `relevance_quantile` of real
  continuations, below it their odds of being the real continuation relative to that quantile's. An empty prompt
  ("") judges the response alone (relevance 1), as the gold stage's accuracy on whole reviews does.
The first four read the response alone. Everything is fitted on the gold split's human-written texts, never on
anything a policy wrote, so RL can over-optimise the proxy while gold tells how good the text really is (the
paper's over-optimisation setting).

Why a policy cannot win it by degenerating: a bag-of-n-grams classifier alone rewards any text free of negative
words ("great great great", "of the of the of a of its ,": P(positive) 0.6-0.95). Each way of getting there
without writing text now costs a factor: repeated words or phrases the repetition factor, shuffled words,
function-word strings and lists of positive words the fluency factor (their context gain is below zero, where
real 24-word continuations have 0.7+ at their 10th percentile), few words the length factor, no words all, and
text that ignores the prompt the relevance factor: one fixed sentence of generic praise for every prompt scored
0.98 without it and has a median of ~0.09 with it, off-topic praise and sentences lifted from other positive reviews
~0.16 and ~0.22, against ~0.42 for real continuations (half of them negative; tests/test_gold.py).
What it still can do: pick the words real reviews predict best (bland, formulaic text scores as fluent as rich
text), continue the prompt's last words plausibly and then drift (the seam is two tokens, the topic evidence weak
for 8-word prompts), or repeat at a distance beyond the 32-word windows; these show up as falling diversity, which
the gold score does not measure.

Saved without pickle (a pickle can run code on load): `judge.json` holds the settings and the vocabularies,
`weights.safetensors` the classifier's idf, coef and intercept, the LM's n-gram tables and the relevance model
with its topic space.
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
from threadpoolctl import threadpool_limits

from rlhf.config import GoldConfig
from rlhf.data.schemas import DataError
from rlhf.io import atomic_dir, write_json
from rlhf.rewards.fluency import TrigramLM
from rlhf.rewards.relevance import POLAR_WORDS, Relevance

FORMAT_VERSION = 3  # 2: the fluency and length factors (the LM's tables); 3: relevance (its model, topic space)
JUDGE_JSON = "judge.json"
WEIGHTS = "weights.safetensors"
# Distinct-word ratio is measured per window of this many words: over a whole 200-word review it falls
# to ~0.5 just from "the"/"a" recurring, while 32-word windows of real reviews stay >= 0.62 (99.9%).
REPETITION_WINDOW = 32
# Below the threshold the fluency factor falls by a factor e per threshold / FLUENCY_FALLOFF of context gain.
FLUENCY_FALLOFF = 2.0
# Every this-many-th gold_train text is held out of the LM to calibrate the fluency factor on unseen real text.
CALIBRATION_EVERY = 20
_WORD = re.compile(r"\w+(?:'\w+)?")
# Vectorizer settings fixed here (not tuned per run); sublinear tf damps a word repeated many times.
_VECTORIZER = {
    "lowercase": True,
    "token_pattern": r"(?u)\b\w\w+\b",
    "sublinear_tf": True,
    "norm": "l2",
    "smooth_idf": True,
}


def distinct_ratios(text: str, window: int = REPETITION_WINDOW) -> tuple[float, float]:
    """(distinct-word ratio, distinct-bigram ratio), each averaged over `window`-word chunks; (0, 0) for no words.

    Real 24-word review continuations: words >= 0.72 and bigrams >= 0.91 in 99% of them; "great great great
    great great" has 0.2 and 0.25, a 12-word phrase said twice ~0.5 and ~0.52.
    """
    words = _WORD.findall(text.lower())
    if not words:
        return 0.0, 0.0
    chunks = [words[i : i + window] for i in range(0, len(words), window)]
    unigram = float(np.mean([len(set(c)) / len(c) for c in chunks]))
    bigrams = [list(zip(c, c[1:])) for c in chunks if len(c) > 1]
    bigram = float(np.mean([len(set(b)) / len(b) for b in bigrams])) if bigrams else 1.0
    return unigram, bigram


def repetition_factor(texts: list[str], floor: float, bigram_floor: float) -> np.ndarray:
    """(B,) in [0, 1]: min(1, words / floor, bigrams / bigram_floor)**2 of the distinct ratios (0 for no words).

    Squared so that the score drops fast: ratio 0.2 with floor 0.6 keeps 1/9 of P(positive).
    """
    ratios = np.array([distinct_ratios(t) for t in texts], dtype=np.float64).reshape(-1, 2)
    return np.minimum(1.0, np.minimum(ratios[:, 0] / floor, ratios[:, 1] / bigram_floor)) ** 2


def length_factor(texts: list[str], min_words: int) -> np.ndarray:
    """(B,) min(1, words / min_words): a response cut after a few words keeps that share of its score."""
    return np.minimum(1.0, np.array([len(_WORD.findall(t)) for t in texts], dtype=np.float64) / min_words)


def polar_words(vectorizer: TfidfVectorizer, coef: np.ndarray, n: int) -> set[str]:
    """The n single words whose sentiment coefficient (coef (V,) over the vectorizer's n-grams) is largest in size."""
    names = vectorizer.get_feature_names_out()
    single = np.array([" " not in name for name in names], dtype=bool)
    return set(names[single][np.argsort(-np.abs(coef[single]), kind="stable")[:n]].tolist())


def calibration_texts(texts: list[str], window: tuple[int, int], min_words: int) -> list[str]:
    """Words [start:stop] of each text that has >= start + min_words words: real text cut like a response."""
    start, stop = window
    cut = [t.split()[start:stop] for t in texts]
    return [" ".join(c) for c in cut if len(c) >= min_words]


@dataclass(frozen=True)
class GoldJudge:
    """Fitted judge. vectorizer: TF-IDF with fixed vocabulary/idf; coef (V,), intercept: the logistic model;
    lm: the fluency LM; fluency_threshold: the context gain at which fluency reaches 1 (0: fluency not judged);
    relevance: the prompt-reading factor (it reads the seam with `lm`)."""

    vectorizer: TfidfVectorizer
    coef: np.ndarray
    intercept: float
    repetition_floor: float
    bigram_floor: float
    min_words: int
    lm: TrigramLM
    fluency_threshold: float
    relevance: Relevance

    @classmethod
    def fit(
        cls, texts: list[str], labels: list[int] | np.ndarray, cfg: GoldConfig, window: tuple[int, int] = (8, 32)
    ) -> GoldJudge:
        """Fit on human labels (1 = positive). texts: N strings; labels: N ints in {0, 1}. The LM and the topic space
        learn from all but every CALIBRATION_EVERY-th text; words [window] of those calibrate the fluency factor, and
        their openings (words [:window[0]]) with their own and other reviews' words fit the relevance factor."""
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
        with threadpool_limits(limits=1, user_api="blas"):  # liblinear's sums differ in the last bits with the cores
            model.fit(features, labels)
        held = np.zeros(len(texts), dtype=bool)
        held[np.random.default_rng(0).permutation(len(texts))[::CALIBRATION_EVERY]] = True
        seen, unseen = [t for t, h in zip(texts, held) if not h], [t for t, h in zip(texts, held) if h]
        lm = TrigramLM.fit(seen)
        calibration = calibration_texts(unseen, window, cfg.min_words)
        gains = lm.gain(calibration)[0] if calibration else np.zeros(1)
        threshold = max(float(np.quantile(gains, cfg.fluency_quantile)), 0.0)
        polar = polar_words(vectorizer, model.coef_[0], POLAR_WORDS)  # kept out of the topics: no sentiment there
        held_out = (unseen, labels[held])
        relevance = Relevance.fit(lm, seen, held_out, window, polar, cfg.relevance_quantile, cfg.min_words, cfg.min_df)
        return cls(
            vectorizer,
            model.coef_[0].astype(np.float64),
            float(model.intercept_[0]),
            cfg.repetition_floor,
            cfg.bigram_floor,
            cfg.min_words,
            lm,
            threshold,
            relevance,
        )

    def probability(self, texts: list[str]) -> np.ndarray:
        """(B,) P(positive) of the classifier alone (no other factor)."""
        logits = self.vectorizer.transform(texts) @ self.coef + self.intercept
        return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))

    def fluency(self, texts: list[str]) -> np.ndarray:
        """(B,) in [0, 1]: exp(FLUENCY_FALLOFF * min(0, gain / fluency_threshold - 1)) of the LM's context gain;
        0 for no tokens, 1 when the LM had no positive gain on held-out real text to calibrate against (too little
        text to judge fluency)."""
        if self.fluency_threshold <= 0.0:
            return np.ones(len(texts))
        gain, _ = self.lm.gain(texts)
        return np.exp(FLUENCY_FALLOFF * np.minimum(0.0, gain / self.fluency_threshold - 1.0))

    def factors(self, prompts: list[str], responses: list[str]) -> dict[str, np.ndarray]:
        """The five (B,) factors whose product is the score, by name: all but relevance read the response alone."""
        prompts, responses = list(prompts), list(responses)
        if len(prompts) != len(responses):
            raise ValueError(f"gold judge: {len(prompts)} prompts and {len(responses)} responses (need one each)")
        return {
            "probability": self.probability(responses),
            "repetition": repetition_factor(responses, self.repetition_floor, self.bigram_floor),
            "fluency": self.fluency(responses),
            "length": length_factor(responses, self.min_words),
            "relevance": self.relevance.factor(self.lm, prompts, responses),
        }

    def score(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        """(B,) gold score in [0, 1] of each response to its prompt (the words it continues; "" = none: a text judged
        alone): the product of the factors; an empty response scores 0."""
        if len(responses) == 0 and len(prompts) == 0:
            return np.zeros(0, dtype=np.float64)
        return np.prod(np.stack(list(self.factors(prompts, responses).values())), axis=0)

    def save(self, folder: Path | str) -> None:
        """Write judge.json (settings, vocabularies) and weights.safetensors (classifier, LM) atomically."""
        vocabulary = self.vectorizer.get_feature_names_out().tolist()  # ordered by column index
        settings = {
            "format": FORMAT_VERSION,
            "ngram_range": list(self.vectorizer.ngram_range),
            "vectorizer": _VECTORIZER,
            "repetition_floor": self.repetition_floor,
            "bigram_floor": self.bigram_floor,
            "repetition_window": REPETITION_WINDOW,
            "min_words": self.min_words,
            "fluency_threshold": self.fluency_threshold,
            "fluency_falloff": FLUENCY_FALLOFF,
            **self.relevance.settings(),
            "vocabulary": vocabulary,
            "lm_vocabulary": sorted(self.lm.vocabulary, key=self.lm.vocabulary.__getitem__),
        }
        weights = {
            "idf": np.ascontiguousarray(self.vectorizer.idf_, dtype=np.float64),
            "coef": np.ascontiguousarray(self.coef, dtype=np.float64),
            "intercept": np.array([self.intercept], dtype=np.float64),
            **self.lm.arrays(),
            **self.relevance.arrays(),
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
            lm = TrigramLM.from_arrays(settings["lm_vocabulary"], weights)
            floors = float(settings["repetition_floor"]), float(settings["bigram_floor"]), int(settings["min_words"])
            threshold = float(settings["fluency_threshold"])
            relevance = Relevance.restore(settings, weights)
        except (ValueError, KeyError, TypeError, OSError, SafetensorError) as e:  # JSONDecodeError is a ValueError
            raise DataError(f"gold judge in {folder} is corrupt ({type(e).__name__}: {e}); {hint}") from None
        return cls(vectorizer, coef, float(intercept[0]), *floors, lm, threshold, relevance)
