"""The gold judge: accuracy on human labels, degenerate text scoring below real text, pickle-free save/load, and the
gold stage."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from rlhf.config import Config, DataConfig, GoldConfig
from rlhf.data import reviews
from rlhf.data.schemas import DataError
from rlhf.data.splits import load_split
from rlhf.rewards.gold import JUDGE_JSON, GoldJudge, distinct_ratios, length_factor, repetition_factor
from rlhf.rewards.proxy import GoldReward, RewardSpec
from rlhf.stages import gold as gold_stage
from rlhf.stages import prepare

FIXTURES = Path(__file__).parent / "fixtures"
POSITIVE = "This movie was wonderful, the acting was superb and I loved every minute of it."
NEGATIVE = "A boring, badly acted mess of a film that wasted two hours of my life."
HELD_OUT = 3000
# Real continuations as the pipeline cuts them: words 8..32 of a review (data.prompt_words, + reference_words).
WINDOW = (8, 32)
FUNCTION_WORDS = ["the", "of", "a", "and", "to", "its", ",", "is", "that", "in", "his", "but", "by", "an", "."]
POSITIVE_WORDS = [
    "great", "wonderful", "excellent", "amazing", "brilliant", "superb", "best", "perfect",
    "loved", "beautiful", "masterpiece", "fantastic", "outstanding", "enjoyable", "favorite", "incredible",
]  # fmt: skip
# What the online-DPO policy of issue 35 wrote, scored 0.68 win-rate vs SFT by the TF-IDF-only judge.
ISSUE_RESPONSES = [
    "of the of the of a of its,",
    ", but the, the acting of the and and that the of his kind of",
    "an incredible, by of and the movie the and the of its, the and a",
]


@pytest.fixture(scope="module")
def labelled():
    """(train, test) frames: every packaged review but HELD_OUT, and those HELD_OUT, drawn with a fixed seed: the
    gold stage's sizes (~30k / ~3.3k), so the accuracy asserted here is the one `rlhf gold` reports."""
    data = reviews.read_reviews(reviews.packaged_csv())
    rows = np.random.default_rng(0).permutation(len(data))
    return data.iloc[rows[HELD_OUT:]], data.iloc[rows[:HELD_OUT]]


@pytest.fixture(scope="module")
def judge(labelled) -> GoldJudge:
    train, _ = labelled
    return GoldJudge.fit(train["text"].tolist(), train["label"].to_numpy(), GoldConfig(), WINDOW)


def adversarial(held_out: list[str], seed: int = 0) -> dict[str, list[str]]:
    """The fixed adversarial set: real continuations of held-out reviews (words 8..32 of those with >= 32 words)
    and, for each, one text of every degenerate kind; the same seed gives the same texts."""
    rng = np.random.default_rng(seed)
    real = [" ".join(t.split()[WINDOW[0] : WINDOW[1]]) for t in held_out if len(t.split()) >= WINDOW[1]]

    def repeated(text: str) -> str:  # its first 4..12 words said again and again, 24 words in all
        words = text.split()[: rng.integers(4, 13)]
        return " ".join((words * 24)[:24])

    def positive_list() -> str:  # 3..12 distinct positive words, space- or comma-separated
        words = rng.choice(POSITIVE_WORDS, rng.integers(3, 13), replace=False)
        return (", " if rng.random() < 0.5 else " ").join(words)

    return {
        "real": real,
        "word salad": [" ".join(rng.permutation(t.split())) for t in real],
        "function words": ISSUE_RESPONSES + [" ".join(rng.choice(FUNCTION_WORDS, rng.integers(8, 25))) for _ in real],
        "repeated phrase": [repeated(t) for t in real],
        "positive list": [positive_list() for _ in real],
        # The pipeline's responses run ~24 words (the references' length); truncated = its first 1..3 words.
        "truncated": [" ".join(t.split()[: rng.integers(1, 4)]) for t in real],
        "empty": ["", " ", ",", "...", "!!"],
    }


# Each kind's mean score may be at most this share of the real continuations' median score (measured with the
# packaged reviews: word salad 0.018, function words 0.002, repeated phrase 0.16, positive list 0.044, truncated
# 0.15; the TF-IDF judge alone: 0.99, 1.18, 0.31, 2.0, 0.96).
MEAN_LIMIT = {
    "word salad": 0.05,
    "function words": 0.05,
    "repeated phrase": 0.3,
    "positive list": 0.1,
    "truncated": 0.3,
    "empty": 0.0,
}


@pytest.fixture(scope="module")
def adversarial_scores(judge, labelled) -> dict[str, np.ndarray]:
    return {kind: judge.score(texts) for kind, texts in adversarial(labelled[1]["text"].tolist()).items()}


def test_accuracy_on_held_out_reviews(judge, labelled):
    """The stage's metric (score > 0.5 = positive) on held-out human labels: >= 85% (the TF-IDF classifier alone
    reaches ~88%; the fluency, length and repetition factors may cost real reviews a little)."""
    _, test = labelled
    scores = judge.score(test["text"].tolist())
    assert scores.shape == (HELD_OUT,) and scores.min() >= 0.0 and scores.max() <= 1.0
    assert ((scores > 0.5) == test["label"].to_numpy()).mean() >= 0.85


@pytest.mark.parametrize("kind", MEAN_LIMIT)
def test_real_continuations_score_above_degenerate_text(adversarial_scores, kind):
    """Degenerate text of each kind scores far below real continuations of held-out reviews (which are half
    negative: their median is ~0.47): its mean under MEAN_LIMIT x the real median, 90% of it under the real
    lower quartile, and a real continuation beats its own degenerate twin in >= 90% of the pairs."""
    real, fake = adversarial_scores["real"], adversarial_scores[kind]
    assert len(real) > 2000
    assert fake.mean() <= MEAN_LIMIT[kind] * np.median(real)
    assert np.quantile(fake, 0.9) < np.quantile(real, 0.25)
    if len(fake) == len(real):  # each text made from the real continuation at the same index
        assert np.mean((real > fake) + 0.5 * (real == fake)) >= 0.9


def test_issue_responses_score_near_zero(judge):
    """The function-word salad the online-DPO policy learned (issue 35) wins nothing: scores below 0.05, though the
    sentiment classifier alone calls it positive."""
    assert judge.score(ISSUE_RESPONSES).max() < 0.05
    assert (judge.probability(ISSUE_RESPONSES) > 0.5).all()


def test_fluency_is_calibrated_on_real_continuations(judge, adversarial_scores, labelled):
    """fluency_quantile = 0.1 of held-out real continuations fall below the full factor: about 10% of unseen ones do
    too (the calibration texts were held out of the LM, like these)."""
    real = adversarial(labelled[1]["text"].tolist())["real"]
    below = (judge.fluency(real) < 1.0).mean()
    assert 0.04 <= below <= 0.2
    assert judge.fluency_threshold > 0.3  # a gain per token in nats: the LM predicts real text well beyond frequency


def test_sentiment_and_factors(judge):
    repeated, positive, negative, empty = judge.score(["great great great great great", POSITIVE, NEGATIVE, ""])
    assert negative < 0.5 < positive
    assert repeated < positive / 10
    assert empty == 0.0
    # the classifier alone is fooled by the repetition; the factors are what pull it down
    assert judge.probability(["great great great great great"])[0] > 0.5
    texts = [POSITIVE, "wonderful superb brilliant excellent"]
    factors = judge.factors(texts)
    np.testing.assert_allclose(np.prod(np.stack(list(factors.values())), 0), judge.score(texts))
    assert factors["fluency"][0] == 1.0 and factors["fluency"][1] < 0.01  # a list of adjectives is not a sentence


def test_repetition_and_length_factor_arithmetic():
    # 5 words, 1 distinct -> 1/5; 4 bigrams, 1 distinct -> 1/4
    assert distinct_ratios("great great great great great") == pytest.approx((0.2, 0.25))
    # "the film the film the film": words 2/6, bigrams {the film, film the} 2/5
    assert distinct_ratios("The film, the film... the FILM!") == pytest.approx((1 / 3, 2 / 5))
    # factor = min(1, words / floor, bigrams / bigram_floor)^2: "great" x5: words 0.2 / 0.6 = 0.33, bigrams
    # 0.25 / 0.85 = 0.29; "a b c d a b c d": words 4/8 / 0.6 = 0.83, bigrams 4/7 / 0.85 = 0.67; fluent text 1
    np.testing.assert_allclose(
        repetition_factor(["great great great great great", "a b c d a b c d", POSITIVE, "", "!!"], 0.6, 0.85),
        [(0.25 / 0.85) ** 2, (4 / 7 / 0.85) ** 2, 1.0, 0.0, 0.0],
    )
    # 10 words, 7 distinct (0.7 / 0.5 > 1); 9 bigrams, 7 distinct: ((7/9) / 0.9)^2
    np.testing.assert_allclose(
        repetition_factor(["one two three one two three four five six seven"], 0.5, 0.9), [((7 / 9) / 0.9) ** 2]
    )
    # words / min_words, at most 1: punctuation is not a word
    np.testing.assert_allclose(length_factor(["", "...", "a fine film", POSITIVE], 8), [0.0, 0.0, 3 / 8, 1.0])


def test_save_load_round_trip_without_pickle(judge, labelled, tmp_path):
    texts = labelled[1]["text"].tolist()[:200] + ["great great great great great", POSITIVE, ""]
    judge.save(tmp_path / "gold")
    assert sorted(p.name for p in (tmp_path / "gold").iterdir()) == ["judge.json", "weights.safetensors"]
    loaded = GoldJudge.load(tmp_path / "gold")
    np.testing.assert_array_equal(loaded.score(texts), judge.score(texts))
    for name in ("repetition_floor", "bigram_floor", "min_words", "fluency_threshold"):
        assert getattr(loaded, name) == getattr(judge, name)
    assert loaded.lm.vocabulary == judge.lm.vocabulary


def test_gold_reward_spec_travels_to_another_process_and_scores_like_the_judge(judge, tmp_path):
    """train.reward=gold in the async engine: the pickled RewardSpec rebuilds the judge from its folder there."""
    judge.save(tmp_path / "gold")
    reward = pickle.loads(pickle.dumps(RewardSpec("gold", str(tmp_path / "gold")))).build()
    assert isinstance(reward, GoldReward) and reward.needs_texts
    texts = [POSITIVE, NEGATIVE, "great great great great great"]
    np.testing.assert_allclose(reward(None, texts).numpy(), judge.score(texts), rtol=1e-6)


def test_load_missing_or_corrupt_folder_names_it(judge, tmp_path):
    with pytest.raises(DataError, match=r"no_judge_here.*rlhf gold"):
        GoldJudge.load(tmp_path / "no_judge_here")
    judge.save(tmp_path / "gold")
    settings = json.loads((tmp_path / "gold" / JUDGE_JSON).read_text())
    (tmp_path / "gold" / JUDGE_JSON).write_text(json.dumps({**settings, "lm_vocabulary": ["<unk>", "<s>"]}))
    with pytest.raises(DataError, match=r"gold.*corrupt.*do not fit its vocabulary of 2.*rlhf gold"):
        GoldJudge.load(tmp_path / "gold")
    (tmp_path / "gold" / JUDGE_JSON).write_text(json.dumps({**settings, "format": 1}))  # a judge from before the LM
    with pytest.raises(DataError, match=r"gold.*corrupt.*format 1, expected 2.*rlhf gold"):
        GoldJudge.load(tmp_path / "gold")
    (tmp_path / "gold" / "weights.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DataError, match=r"gold.*corrupt.*rlhf gold"):
        GoldJudge.load(tmp_path / "gold")


def test_fit_rejects_a_single_class():
    with pytest.raises(ValueError, match="both 0 and 1"):
        GoldJudge.fit(["good film", "fine film"], [1, 1], GoldConfig(min_df=1))


def test_gold_stage_on_prepared_fixture(tmp_path):
    data = DataConfig(
        reviews_csv=str(FIXTURES / "reviews_sample.csv"),
        n_sft=4,
        n_reward_prompts=4,
        n_rl_prompts=4,
        n_eval_prompts=4,
        gold_test_fraction=0.2,
    )
    cfg = Config(profile="test", data_dir=str(tmp_path), data=data, gold=GoldConfig(min_df=1))
    prepare.run(cfg)
    metrics = gold_stage.run(cfg)
    assert json.loads(cfg.path("metrics", "gold.json").read_text()) == metrics
    assert (metrics["n_train"], metrics["n_test"]) == (24, 6)  # 30 fixture rows, round(30 * 0.2) held out
    # 24 training texts are too few for a meaningful accuracy floor: recompute the reported accuracies instead
    loaded = GoldJudge.load(cfg.path("gold"))
    test = load_split(cfg.path("prepared"), "gold_test")
    texts, labels, sources = test["text"].tolist(), test["label"].to_numpy(), test["source"].to_numpy()
    correct = (loaded.score(texts) > 0.5) == labels
    assert metrics["accuracy"] == correct.mean()
    assert metrics["classifier_accuracy"] == ((loaded.probability(texts) > 0.5) == labels).mean()
    assert metrics["accuracy_by_source"] == {s: correct[sources == s].mean() for s in set(sources)}
    assert metrics["fluency_threshold"] == round(loaded.fluency_threshold, 4)
