"""The gold judge: accuracy on human labels, repetition penalty, pickle-free save/load, and the gold stage."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from rlhf.config import Config, DataConfig, GoldConfig
from rlhf.data import reviews
from rlhf.data.schemas import DataError
from rlhf.rewards.gold import GoldJudge, distinct_ratio, repetition_factor
from rlhf.rewards.proxy import GoldReward, RewardSpec
from rlhf.stages import gold as gold_stage
from rlhf.stages import prepare

FIXTURES = Path(__file__).parent / "fixtures"
POSITIVE = "This movie was wonderful, the acting was superb and I loved every minute of it."
NEGATIVE = "A boring, badly acted mess of a film that wasted two hours of my life."


@pytest.fixture(scope="module")
def labelled():
    """(train, test) frames: 4000 and 1000 distinct packaged reviews, drawn with a fixed seed."""
    data = reviews.read_reviews(reviews.packaged_csv())
    rows = np.random.default_rng(0).permutation(len(data))
    return data.iloc[rows[:4000]], data.iloc[rows[4000:5000]]


@pytest.fixture(scope="module")
def judge(labelled) -> GoldJudge:
    train, _ = labelled
    return GoldJudge.fit(train["text"].tolist(), train["label"].to_numpy(), GoldConfig())


def test_accuracy_on_held_out_reviews(judge, labelled):
    _, test = labelled
    scores = judge.score(test["text"].tolist())
    assert scores.shape == (1000,) and scores.min() >= 0.0 and scores.max() <= 1.0
    assert ((scores > 0.5) == test["label"].to_numpy()).mean() > 0.75


def test_sentiment_and_repetition(judge):
    repeated, positive, negative, empty = judge.score(["great great great great great", POSITIVE, NEGATIVE, ""])
    assert negative < 0.5 < positive
    assert repeated < positive / 2
    assert empty == 0.0
    # the classifier alone is fooled by the repetition; the factor is what pulls it down
    assert judge.probability(["great great great great great"])[0] > 0.5


def test_repetition_factor_arithmetic():
    # 5 words, 1 distinct -> 1/5; 4 bigrams, 1 distinct -> 1/4; the ratio is the min = 0.2
    assert distinct_ratio("great great great great great") == pytest.approx(0.2)
    # "the film the film the film": words 2/6, bigrams {the film, film the} 2/5 -> 1/3
    assert distinct_ratio("The film, the film... the FILM!") == pytest.approx(1 / 3)
    # factor = min(1, ratio / floor)^2: (0.2 / 0.6)^2 = 1/9; a fluent sentence keeps 1; no words -> 0
    np.testing.assert_allclose(
        repetition_factor(["great great great great great", POSITIVE, "", "!!"], 0.6), [1 / 9, 1.0, 0.0, 0.0]
    )


def test_save_load_round_trip_without_pickle(judge, labelled, tmp_path):
    texts = labelled[1]["text"].tolist()[:200] + ["great great great great great", POSITIVE, ""]
    judge.save(tmp_path / "gold")
    assert sorted(p.name for p in (tmp_path / "gold").iterdir()) == ["judge.json", "weights.safetensors"]
    loaded = GoldJudge.load(tmp_path / "gold")
    np.testing.assert_array_equal(loaded.score(texts), judge.score(texts))
    assert loaded.repetition_floor == judge.repetition_floor


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
    assert set(metrics["accuracy_by_source"]) <= {"imdb", "rotten_tomatoes"}
    assert 0.0 <= metrics["accuracy"] <= 1.0
    loaded = GoldJudge.load(cfg.path("gold"))
    assert loaded.score([POSITIVE]).shape == (1,)
