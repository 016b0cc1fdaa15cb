"""The gold judge's fluency term: a word trigram language model of real reviews (interpolated Kneser-Ney).

Fitted on human-written reviews only (the gold split), never on model output, so nothing RL trains or samples
can move it. A text's fluency is how much better than their plain frequency the LM predicts its tokens (words
and punctuation, lower-cased; `TrigramLM.gain`): real review text is predictable in context, word salad and
function-word strings are not ("the of", "a of" and "and and" are rare, shuffled words rarely form seen trigrams).

The model is kept as sorted int64 n-gram keys (ids packed base V) with their counts, looked up with
np.searchsorted: a batch is scored with a few vectorised lookups, and the arrays save to safetensors.
Trigrams and bigram continuations seen once, and trigram contexts seen once, are dropped after the discounts are
computed (the rest keep their full counts): 2x smaller, and such a lookup backs off to the lower order, for real
and degenerate text alike.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

UNK, BOS = 0, 1  # ids of an out-of-vocabulary token and of the start of a review
_TOKEN = re.compile(r"\w+(?:'\w+)?|[^\w\s]")


def tokens(text: str) -> list[str]:
    """Lower-cased words (with inner apostrophes) and single punctuation marks, in order."""
    return _TOKEN.findall(text.lower())


def _discount(counts: np.ndarray) -> float:
    """Kneser-Ney's absolute discount n1 / (n1 + 2 n2) from the counts of counts, in (0, 1)."""
    n1, n2 = int((counts == 1).sum()), int((counts == 2).sum())
    return min(max(n1 / (n1 + 2 * n2), 0.1), 0.9) if n1 + n2 else 0.5


def _find(keys: np.ndarray, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index, found) of each query in the sorted `keys`; index is only meaningful where found."""
    if len(keys) == 0:
        return np.zeros(len(query), dtype=np.int64), np.zeros(len(query), dtype=bool)
    at = np.minimum(np.searchsorted(keys, query), len(keys) - 1)
    return at, keys[at] == query


@dataclass(frozen=True)
class TrigramLM:
    """vocabulary: token -> id (UNK and BOS first); the arrays are named as in `arrays()`."""

    vocabulary: dict[str, int]
    tri_keys: np.ndarray  # (T,) int64 (u*V + v)*V + w, sorted; counts >= 2 only
    tri_counts: np.ndarray  # (T,) float64 c(uvw)
    ctx3_keys: np.ndarray  # (C,) int64 u*V + v, sorted
    ctx3_stats: np.ndarray  # (C, 2) float64: c(uv.), distinct w after uv (before pruning)
    bi_keys: np.ndarray  # (B,) int64 v*V + w, sorted
    bi_counts: np.ndarray  # (B,) float64 N1+(.vw): distinct u before vw
    ctx2_stats: np.ndarray  # (V, 2) float64: sum_w N1+(.vw), distinct w after v
    unigram: np.ndarray  # (V,) float64 P1(w) from continuation counts, smoothed
    frequency: np.ndarray  # (V,) float64 log of the plain relative frequency of w (add-one), the gain's baseline
    discounts: np.ndarray  # (2,) float64 D2, D3

    @classmethod
    def fit(cls, texts: list[str], min_count: int = 2) -> TrigramLM:
        """Fit on real texts; tokens seen fewer than min_count times become UNK."""
        docs = [tokens(t) for t in texts]
        counts = Counter(tok for doc in docs for tok in doc)
        words = sorted(w for w, c in counts.items() if c >= min_count)
        vocabulary = {"<unk>": UNK, "<s>": BOS, **{w: i + 2 for i, w in enumerate(words)}}
        ids = np.fromiter((i for doc in docs for i in (BOS, *(vocabulary.get(t, UNK) for t in doc))), dtype=np.int64)
        return cls.from_ids(vocabulary, ids)

    @classmethod
    def from_ids(cls, vocabulary: dict[str, int], ids: np.ndarray) -> TrigramLM:
        """ids: every text's token ids, each text preceded by BOS, concatenated."""
        size = len(vocabulary)
        a, b, c = ids[:-2], ids[1:-1], ids[2:]
        keep = (b != BOS) & (c != BOS)  # no n-gram spans two texts
        tri, tri_counts = np.unique((a[keep] * size + b[keep]) * size + c[keep], return_counts=True)
        d3 = _discount(tri_counts)
        ctx3_keys, inverse = np.unique(tri // size, return_inverse=True)
        ctx3_stats = np.stack([np.bincount(inverse, weights=tri_counts), np.bincount(inverse)], 1).astype(np.float64)
        common = ctx3_stats[:, 0] >= 2  # a context seen once backs off to the bigram: 2x smaller, same separation
        ctx3_keys, ctx3_stats = ctx3_keys[common], ctx3_stats[common]
        # Kneser-Ney: the lower orders count the distinct contexts a word follows, not its occurrences
        bi_keys, bi_counts = np.unique(tri % (size * size), return_counts=True)
        d2 = _discount(bi_counts)
        v = bi_keys // size
        ctx2_stats = np.stack(
            [np.bincount(v, weights=bi_counts, minlength=size), np.bincount(v, minlength=size)], 1
        ).astype(np.float64)
        cont1 = np.bincount(bi_keys % size, minlength=size).astype(np.float64)
        unigram = (cont1 + 1.0) / (cont1.sum() + size)  # add-one: every id, UNK included, has some mass
        occurrences = np.bincount(ids, minlength=size).astype(np.float64)
        occurrences[BOS] = 0.0
        frequency = np.log((occurrences + 1.0) / (occurrences.sum() + size))
        pruned, bi_pruned = tri_counts >= 2, bi_counts >= 2
        return cls(
            vocabulary,
            tri[pruned],
            tri_counts[pruned].astype(np.float64),
            ctx3_keys,
            ctx3_stats,
            bi_keys[bi_pruned],
            bi_counts[bi_pruned].astype(np.float64),
            ctx2_stats,
            unigram,
            frequency,
            np.array([d2, d3]),
        )

    def _bigram(self, v: np.ndarray, w: np.ndarray) -> np.ndarray:
        """P2(w | v), interpolated with P1."""
        size, d2 = len(self.vocabulary), self.discounts[0]
        at, found = _find(self.bi_keys, v * size + w)
        count = np.where(found, self.bi_counts[at], 0.0)
        total, types = self.ctx2_stats[v, 0], self.ctx2_stats[v, 1]
        seen = total > 0
        safe = np.where(seen, total, 1.0)
        p = np.maximum(count - d2, 0.0) / safe + d2 * types / safe * self.unigram[w]
        return np.where(seen, p, self.unigram[w])

    def _trigram(self, u: np.ndarray, v: np.ndarray, w: np.ndarray) -> np.ndarray:
        """P3(w | u v), interpolated with P2."""
        size, d3 = len(self.vocabulary), self.discounts[1]
        lower = self._bigram(v, w)
        at, found = _find(self.tri_keys, (u * size + v) * size + w)
        count = np.where(found, self.tri_counts[at], 0.0)
        cat, cfound = _find(self.ctx3_keys, u * size + v)
        total = np.where(cfound, self.ctx3_stats[cat, 0], 1.0)
        types = np.where(cfound, self.ctx3_stats[cat, 1], 0.0)
        p = np.maximum(count - d3, 0.0) / total + d3 * types / total * lower
        return np.where(cfound, p, lower)

    def ids(self, text: str) -> list[int]:
        """The text's token ids (UNK for a token out of the vocabulary)."""
        return [self.vocabulary.get(t, UNK) for t in tokens(text)]

    def log_probability(self, u: np.ndarray, v: np.ndarray, w: np.ndarray) -> np.ndarray:
        """(N,) log P(w | u v) of id arrays (N,). u = v = BOS: the start of a text, where the LM keeps no bigram, so
        w gets the lowest order P1(w); u = BOS alone: w is a text's second token."""
        return np.log(self._trigram(u, v, w))

    def gain(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(mean log-probability gain per token over the token's plain frequency, number of tokens), each (B,).

        log P(w | u v) - log P(w): how much the context predicts each token beyond how common it is (SLOR, Lau et
        al. 2017, without its length term). Frequent words alone do not earn it: "of the of a of" gains less than
        nothing although each word is common, because "the of" and "a of" predict "of" worse than its frequency.
        The text is read alone (the seam to a prompt is the relevance factor's, rlhf.rewards.relevance): its first
        token gains 0, its second is predicted from one word. -inf for a text without tokens.
        """
        docs = [self.ids(text) for text in texts]
        lengths = np.array([len(d) for d in docs], dtype=np.int64)
        w = np.fromiter((i for d in docs for i in d), dtype=np.int64, count=int(lengths.sum()))
        position = np.arange(len(w)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        v, u = np.roll(w, 1), np.roll(w, 2)  # only read where position says they belong to the same text
        p = np.where(position >= 2, self._trigram(u, v, w), self._bigram(v, w))
        gain = np.where(position >= 1, np.log(p) - self.frequency[w], 0.0)
        total = np.bincount(np.repeat(np.arange(len(docs)), lengths), weights=gain, minlength=len(docs))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(lengths > 0, total / np.maximum(lengths, 1), -np.inf), lengths

    def arrays(self) -> dict[str, np.ndarray]:
        """The model's arrays by name (the vocabulary is saved apart, as JSON)."""
        names = ("tri_keys", "tri_counts", "ctx3_keys", "ctx3_stats", "bi_keys", "bi_counts", "ctx2_stats")
        names += ("unigram", "frequency", "discounts")
        return {f"lm_{n}": np.ascontiguousarray(getattr(self, n)) for n in names}

    @classmethod
    def from_arrays(cls, vocabulary: list[str], arrays: dict[str, np.ndarray]) -> TrigramLM:
        """Rebuild from `arrays()` and the vocabulary in id order; ValueError when they disagree."""
        lm = cls({w: i for i, w in enumerate(vocabulary)}, **{k[3:]: v for k, v in arrays.items() if k[:3] == "lm_"})
        size = len(vocabulary)
        if lm.unigram.shape != (size,) or lm.ctx2_stats.shape != (size, 2) or lm.discounts.shape != (2,):
            raise ValueError(f"language model arrays do not fit its vocabulary of {size}")
        if len(lm.tri_keys) != len(lm.tri_counts) or len(lm.bi_keys) != len(lm.bi_counts):
            raise ValueError("language model n-gram keys and counts differ in length")
        return lm
