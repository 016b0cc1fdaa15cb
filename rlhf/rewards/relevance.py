"""The gold judge's relevance term: whether a response continues its own prompt (issue 57).

relevance(prompt, response) in (0, 1] comes from evidence that carries no sentiment, so that a response turning a
negative opening positive (the task) costs nothing here. Five features (FEATURES):
- the seam (4): how well the prompt's last two tokens predict the response's first two, and how well the start of
  a text does, each per token beyond its plain frequency (the trigram LM of rlhf.rewards.fluency). Openings are cut
  after 8 words, mostly mid-sentence, and real continuations go on from there ("... rave about this movie is" ->
  "beyond me."); canned text, sentences lifted from other reviews and text about something else start afresh
  ("this is one of the best ...") wherever the prompt stopped;
- the topic (1): the cosine of prompt and response in an LSA space (TOPIC_DIMENSIONS) of the reviews' content words:
  TF-IDF without English stop words and without the sentiment classifier's POLAR_WORDS most polar words.
A logistic model of them is fitted on held-out real reviews (text the LM never saw): each opening with its own
continuation (1) against the same opening followed by another review's continuation, or by a sentence start of
another review (0), both taken from reviews of the SAME label: sentiment agrees as often in the negatives as in the
real pairs, so agreement is no evidence the model could learn. Its logit z is calibrated like the fluency factor:
relevance = exp(min(0, z - threshold)), threshold the `relevance_quantile` of real continuations' z; below it the
factor is the odds of being the real continuation relative to the threshold's (never exactly 0).
An empty prompt has nothing to be relevant to: relevance 1 (a whole review judged alone).
Measured (tiny profile, gold_test prompts; ROC AUC of real continuations against each kind of response that ignores
the prompt: another review's continuation, a lifted sentence, generic praise, off-topic text): seam_first alone
0.86-0.87, the topic alone 0.57-0.71, the model 0.88, 0.90, 0.95, 0.88.

Shapes: B pairs (prompt, response); V topic words; K topic dimensions; F = len(FEATURES).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS, TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from rlhf.rewards.fluency import BOS, UNK, TrigramLM

FEATURES = ("seam_first", "seam_second", "fresh_first", "fresh_second", "topic")
TOPIC_DIMENSIONS = 64  # 50, 100, 200 separated real from mismatched pairs alike (AUC ~0.66); 64 keeps the file small
TOPIC_WORDS = 20000  # the most frequent content words; the components are (TOPIC_WORDS, K) float32, ~5 MB
POLAR_WORDS = 1000  # left out of the topic vocabulary: "great", "waste", "7", ... would let topic mean sentiment
MIN_PAIRS = 20  # fewer held-out real continuations to fit on: relevance is not judged (a factor of 1)
# Fixed settings (not tuned per run; changing them needs a new gold FORMAT_VERSION). Letters only: numbers are ratings
# or years, not topics.
_TOPIC_VECTORIZER = {
    "lowercase": True,
    "token_pattern": r"(?u)\b[a-z][a-z']+\b",
    "sublinear_tf": True,
    "norm": "l2",
    "smooth_idf": True,
}
_ENDS_SENTENCE = re.compile(r"[.!?][\"')\]]*$")


def seam_features(lm: TrigramLM, prompts: list[str], responses: list[str]) -> np.ndarray:
    """(B, 4): log P(token | context) - log frequency(token) of each response's first two tokens, in the context of
    the prompt's last two tokens (seam_first, seam_second), then of the start of a text (fresh_first,
    fresh_second). A token the response lacks (0 or 1 token) gains 0; an empty prompt is the start of a text."""
    heads = [lm.ids(r)[:2] for r in responses]
    present = np.array([[len(h) > 0, len(h) > 1] for h in heads], dtype=bool).reshape(-1, 2)
    w = np.array([h + [UNK] * (2 - len(h)) for h in heads], dtype=np.int64).reshape(-1, 2)
    tail = np.array([[BOS, BOS, *lm.ids(p)][-2:] for p in prompts], dtype=np.int64).reshape(-1, 2)
    start = np.full(len(w), BOS, dtype=np.int64)
    seam = [lm.log_probability(tail[:, 0], tail[:, 1], w[:, 0]), lm.log_probability(tail[:, 1], w[:, 0], w[:, 1])]
    fresh = [lm.log_probability(start, start, w[:, 0]), lm.log_probability(start, w[:, 0], w[:, 1])]
    gain = np.stack(seam + fresh, 1) - np.tile(lm.frequency[w], 2)
    return np.where(np.tile(present, 2), gain, 0.0)


@dataclass(frozen=True)
class TopicSpace:
    """LSA: a text's TF-IDF row (fixed vocabulary and idf) times `components`, scaled to unit length."""

    vocabulary: list[str]  # (V,) in column order; empty: too little text for a space, every cosine 0
    idf: np.ndarray  # (V,) float64
    components: np.ndarray  # (V, K) float32: each word's coordinates

    @classmethod
    def fit(cls, texts: list[str], left_out: set[str], min_df: int) -> TopicSpace:
        """On real texts; `left_out` words and English stop words never enter the vocabulary."""
        stop = sorted(ENGLISH_STOP_WORDS | left_out)
        vectorizer = TfidfVectorizer(stop_words=stop, min_df=min_df, max_features=TOPIC_WORDS, **_TOPIC_VECTORIZER)
        try:
            features = vectorizer.fit_transform(texts)
        except ValueError:  # sklearn's "no terms remain": no word is common enough
            return cls([], np.zeros(0), np.zeros((0, 1), dtype=np.float32))
        dimensions = min(TOPIC_DIMENSIONS, features.shape[0] - 1, features.shape[1] - 1)
        if dimensions < 1:
            return cls([], np.zeros(0), np.zeros((0, 1), dtype=np.float32))
        svd = TruncatedSVD(dimensions, algorithm="randomized", n_iter=5, random_state=0).fit(features)
        vocabulary = vectorizer.get_feature_names_out().tolist()
        return cls(vocabulary, vectorizer.idf_.astype(np.float64), svd.components_.T.astype(np.float32, order="C"))

    @cached_property
    def _vectorizer(self) -> TfidfVectorizer:
        vectorizer = TfidfVectorizer(vocabulary=self.vocabulary, dtype=np.float64, **_TOPIC_VECTORIZER)
        vectorizer.idf_ = self.idf
        return vectorizer

    def embed(self, texts: list[str]) -> np.ndarray:
        """(B, K) unit rows; a row of zeros for a text without a word of the vocabulary."""
        if not self.vocabulary:
            return np.zeros((len(texts), self.components.shape[1]))
        rows = np.asarray(self._vectorizer.transform(texts) @ self.components, dtype=np.float64)
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        return np.divide(rows, norms, out=np.zeros_like(rows), where=norms > 0)

    def cosine(self, prompts: list[str], responses: list[str]) -> np.ndarray:
        """(B,) cosine of each prompt and its response, 0 where either has no word of the vocabulary."""
        return (self.embed(prompts) * self.embed(responses)).sum(1)


def sentence_starts(words: list[str], min_words: int, first: int = 1) -> list[int]:
    """Indices k >= first of the words that open a sentence (the word before ends in . ! or ?, maybe then a quote or
    bracket) with >= min_words words from k on; 0 opens one too (first=0)."""
    last = len(words) - min_words
    opens = [k for k in range(max(first, 1), last + 1) if _ENDS_SENTENCE.search(words[k - 1])]
    return ([0] if first == 0 and last >= 0 else []) + opens


def training_pairs(texts: list[str], labels: np.ndarray, window: tuple[int, int], min_words: int, seed: int = 0):
    """(prompts, responses, real) of held-out real reviews: each opening (words [:start]) with its continuation
    (words [start:stop], >= min_words of them; real = 1), and with two of another review of the same label (0): that
    review's continuation, and its words from a sentence start after its first word on (as many as a continuation
    has, >= min_words; reviews without such a start give none). Same texts and seed: same pairs."""
    start, stop = window
    words = [t.split() for t in texts]
    usable = [i for i, w in enumerate(words) if len(w) >= start + min_words]
    rng = np.random.default_rng(seed)
    prompts, responses, real = [], [], []
    for label in (0, 1):
        group = [i for i in usable if labels[i] == label]
        for m, i in enumerate(group):
            opening = " ".join(words[i][:start])
            prompts.append(opening), responses.append(" ".join(words[i][start:stop])), real.append(1)
            if len(group) < 3:
                continue  # no other review of this label to take a continuation from
            other, lifted = words[group[(m + 1) % len(group)]], words[group[(m + 2) % len(group)]]
            prompts.append(opening), responses.append(" ".join(other[start:stop])), real.append(0)
            if starts := sentence_starts(lifted, min_words):
                k = int(rng.choice(starts))
                prompts.append(opening), responses.append(" ".join(lifted[k : k + stop - start])), real.append(0)
    return prompts, responses, np.array(real, dtype=np.int64)


@dataclass(frozen=True)
class Relevance:
    """Fitted relevance: topics for the topic feature, the logistic model (coef (F,), intercept) of FEATURES, and
    the logit at which relevance reaches 1. Zero coefficients: relevance not judged (1 everywhere)."""

    topics: TopicSpace
    coef: np.ndarray
    intercept: float
    threshold: float

    @classmethod
    def fit(
        cls,
        lm: TrigramLM,
        topic_texts: list[str],
        held: tuple[list[str], np.ndarray],
        window: tuple[int, int],
        left_out: set[str],
        quantile: float,
        min_words: int,
        min_df: int,
    ) -> Relevance:
        """lm and the topics learn from `topic_texts`; the logistic model and its threshold from the pairs of the
        `held` (texts, labels) neither saw (`training_pairs`). One BLAS thread: a multi-threaded BLAS sums in another
        order, and the saved judge would differ in its last bits with the machine's cores."""
        with threadpool_limits(limits=1, user_api="blas"):
            topics = TopicSpace.fit(topic_texts, left_out, min_df)
            prompts, responses, real = training_pairs(*held, window, min_words)
            if real.sum() < MIN_PAIRS or real.min() == 1:
                return cls(topics, np.zeros(len(FEATURES)), 0.0, 0.0)
            features = cls.features_of(lm, topics, prompts, responses)
            model = LogisticRegression(C=1.0, class_weight="balanced", max_iter=1000).fit(features, real)
            coef, intercept = model.coef_[0].astype(np.float64), float(model.intercept_[0])
            threshold = float(np.quantile(features[real == 1] @ coef + intercept, quantile))
        return cls(topics, coef, intercept, threshold)

    @staticmethod
    def features_of(lm: TrigramLM, topics: TopicSpace, prompts: list[str], responses: list[str]) -> np.ndarray:
        """(B, F) FEATURES of each pair."""
        return np.concatenate([seam_features(lm, prompts, responses), topics.cosine(prompts, responses)[:, None]], 1)

    def logit(self, lm: TrigramLM, prompts: list[str], responses: list[str]) -> np.ndarray:
        """(B,) the logistic model's logit: log-odds that the response is the prompt's real continuation."""
        return self.features_of(lm, self.topics, prompts, responses) @ self.coef + self.intercept

    def factor(self, lm: TrigramLM, prompts: list[str], responses: list[str]) -> np.ndarray:
        """(B,) in (0, 1]: exp(min(0, logit - threshold)); 1 for a prompt without tokens."""
        relevance = np.exp(np.minimum(0.0, self.logit(lm, prompts, responses) - self.threshold))
        return np.where([bool(lm.ids(p)) for p in prompts], relevance, 1.0)

    def settings(self) -> dict:
        """What judge.json keeps of it: the features' names, the threshold and the topic vocabulary."""
        return {
            "relevance_features": list(FEATURES),
            "relevance_threshold": self.threshold,
            "topic_vocabulary": self.topics.vocabulary,
        }

    def arrays(self) -> dict[str, np.ndarray]:
        """What weights.safetensors keeps of it."""
        return {
            "relevance_coef": np.ascontiguousarray(self.coef, dtype=np.float64),
            "relevance_intercept": np.array([self.intercept], dtype=np.float64),
            "topic_idf": np.ascontiguousarray(self.topics.idf, dtype=np.float64),
            "topic_components": np.ascontiguousarray(self.topics.components, dtype=np.float32),
        }

    @classmethod
    def restore(cls, settings: dict, arrays: dict[str, np.ndarray]) -> Relevance:
        """From `settings()` and `arrays()`; ValueError when they disagree with each other or with FEATURES."""
        vocabulary, idf, components = settings["topic_vocabulary"], arrays["topic_idf"], arrays["topic_components"]
        if settings["relevance_features"] != list(FEATURES) or arrays["relevance_coef"].shape != (len(FEATURES),):
            raise ValueError(f"relevance features {settings['relevance_features']}, expected {list(FEATURES)}")
        if not (len(vocabulary) == idf.shape[0] == components.shape[0]) or components.ndim != 2:
            raise ValueError(f"topic sizes disagree: {len(vocabulary)} words, idf {idf.shape}, {components.shape}")
        topics = TopicSpace(vocabulary, idf, components)
        intercept = float(arrays["relevance_intercept"][0])
        return cls(topics, arrays["relevance_coef"], intercept, float(settings["relevance_threshold"]))
