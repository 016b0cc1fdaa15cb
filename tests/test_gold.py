"""The gold judge: accuracy on human labels, degenerate text and text that ignores its prompt scoring below real text,
a sentiment flip costing no relevance, pickle-free save/load, the judge as a reward function, and the gold stage."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ci_config

from rlhf.config import Config, DataConfig, GoldConfig
from rlhf.data import reviews
from rlhf.data.schemas import DataError
from rlhf.data.splits import load_split
from rlhf.models.batch import assemble
from rlhf.models.loading import encode_prompts
from rlhf.models.tiny import train_word_tokenizer
from rlhf.rewards.gold import JUDGE_JSON, GoldJudge, distinct_ratios, length_factor, repetition_factor
from rlhf.rewards.probes import GENERIC_PRAISE, probes
from rlhf.rewards.proxy import GoldReward, RewardSpec
from rlhf.rewards.relevance import sentence_starts, training_pairs
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


def adversarial(held_out: list[str], seed: int = 0) -> dict[str, tuple[list[str], list[str]]]:
    """The fixed adversarial set, kind -> (prompts, responses): real continuations of held-out reviews (words 8..32 of
    those with >= 32 words, after their words 0..8) and, for each, one text of every degenerate kind as a response to
    the same prompt (the prompts in turn for the kinds of another size); the same seed gives the same texts."""
    rng = np.random.default_rng(seed)
    long = [t.split() for t in held_out if len(t.split()) >= WINDOW[1]]
    openings = [" ".join(w[: WINDOW[0]]) for w in long]
    real = [" ".join(w[WINDOW[0] : WINDOW[1]]) for w in long]

    def repeated(text: str) -> str:  # its first 4..12 words said again and again, 24 words in all
        words = text.split()[: rng.integers(4, 13)]
        return " ".join((words * 24)[:24])

    def positive_list() -> str:  # 3..12 distinct positive words, space- or comma-separated
        words = rng.choice(POSITIVE_WORDS, rng.integers(3, 13), replace=False)
        return (", " if rng.random() < 0.5 else " ").join(words)

    responses = {
        "real": real,
        "word salad": [" ".join(rng.permutation(t.split())) for t in real],
        "function words": ISSUE_RESPONSES + [" ".join(rng.choice(FUNCTION_WORDS, rng.integers(8, 25))) for _ in real],
        "repeated phrase": [repeated(t) for t in real],
        "positive list": [positive_list() for _ in real],
        # The pipeline's responses run ~24 words (the references' length); truncated = its first 1..3 words.
        "truncated": [" ".join(t.split()[: rng.integers(1, 4)]) for t in real],
        "empty": ["", " ", ",", "...", "!!"],
    }
    return {kind: ([openings[i % len(openings)] for i in range(len(r))], r) for kind, r in responses.items()}


# Each kind's mean score may be at most this share of the real continuations' median score (measured with the
# packaged reviews, before the relevance factor: word salad 0.018, function words 0.002, repeated phrase 0.16, positive
# list 0.044, truncated 0.15; the TF-IDF judge alone: 0.99, 1.18, 0.31, 2.0, 0.96).
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
    kinds = adversarial(labelled[1]["text"].tolist())
    return {kind: judge.score(prompts, responses) for kind, (prompts, responses) in kinds.items()}


def test_accuracy_on_held_out_reviews(judge, labelled):
    """The stage's metric (score > 0.5 = positive) on held-out human labels, whole reviews judged alone (no prompt):
    >= 85% (the TF-IDF classifier alone reaches ~88%; the fluency, length and repetition factors may cost real
    reviews a little)."""
    _, test = labelled
    scores = judge.score([""] * len(test), test["text"].tolist())
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
    assert judge.score([""] * 3, ISSUE_RESPONSES).max() < 0.05
    assert (judge.probability(ISSUE_RESPONSES) > 0.5).all()


def test_fluency_is_calibrated_on_real_continuations(judge, adversarial_scores, labelled):
    """fluency_quantile = 0.1 of held-out real continuations fall below the full factor: about 10% of unseen ones do
    too (the calibration texts were held out of the LM, like these)."""
    _, real = adversarial(labelled[1]["text"].tolist())["real"]
    below = (judge.fluency(real) < 1.0).mean()
    assert 0.04 <= below <= 0.2
    assert judge.fluency_threshold > 0.3  # a gain per token in nats: the LM predicts real text well beyond frequency


def test_sentiment_and_factors(judge):
    texts = ["great great great great great", POSITIVE, NEGATIVE, ""]
    repeated, positive, negative, empty = judge.score([""] * 4, texts)
    assert negative < 0.5 < positive
    assert repeated < positive / 10
    assert empty == 0.0
    # the classifier alone is fooled by the repetition; the factors are what pull it down
    assert judge.probability(["great great great great great"])[0] > 0.5
    prompts, texts = ["", "The film opens on a quiet"], [POSITIVE, "wonderful superb brilliant excellent"]
    factors = judge.factors(prompts, texts)
    assert list(factors) == ["probability", "repetition", "fluency", "length", "relevance"]
    np.testing.assert_allclose(np.prod(np.stack(list(factors.values())), 0), judge.score(prompts, texts))
    assert factors["fluency"][0] == 1.0 and factors["fluency"][1] < 0.01  # a list of adjectives is not a sentence
    assert factors["relevance"][0] == 1.0  # no prompt: nothing to be relevant to
    with pytest.raises(ValueError, match="2 prompts and 1 responses"):
        judge.score(prompts, texts[:1])


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
    kinds = probes(labelled[1]["text"].tolist()[:100], labelled[1]["label"].to_numpy()[:100], WINDOW, 8)
    prompts = [p for p, _ in kinds.values() for p in p] + ["", "", ""]
    texts = [r for _, r in kinds.values() for r in r] + ["great great great great great", POSITIVE, ""]
    judge.save(tmp_path / "gold")
    assert sorted(p.name for p in (tmp_path / "gold").iterdir()) == ["judge.json", "weights.safetensors"]
    loaded = GoldJudge.load(tmp_path / "gold")
    np.testing.assert_array_equal(loaded.score(prompts, texts), judge.score(prompts, texts))
    for name in ("repetition_floor", "bigram_floor", "min_words", "fluency_threshold"):
        assert getattr(loaded, name) == getattr(judge, name)
    assert loaded.lm.vocabulary == judge.lm.vocabulary
    assert loaded.relevance.threshold == judge.relevance.threshold
    assert loaded.relevance.topics.vocabulary == judge.relevance.topics.vocabulary


def test_gold_reward_spec_travels_to_another_process_and_scores_responses_to_their_prompts(judge, tmp_path):
    """train.reward=gold in the async engine: the pickled RewardSpec rebuilds the judge from its folder there, and
    finds each batch row's prompt text by its token ids (the loop's encoding), so the reward is the judge's score of
    the response to that prompt; a prompt that is not the task's fails loudly (no silent prompt-free score)."""
    cfg = ci_config(tmp_path / "data", "train.reward=gold")
    prepare.run(cfg)
    sft_texts = load_split(cfg.path("prepared"), "sft")["text"].tolist()
    tokenizer = train_word_tokenizer(sft_texts, cfg.model.vocab_size)
    tokenizer.save_pretrained(cfg.path("sft"))
    judge.save(cfg.path("gold"))
    reward = pickle.loads(pickle.dumps(RewardSpec.of(cfg))).build()
    assert isinstance(reward, GoldReward) and reward.needs_texts
    prompts = load_split(cfg.path("prepared"), "rl_prompts")["prompt"].tolist()[:2]
    ids = encode_prompts(tokenizer, prompts, cfg.data.chat_template)
    answers = [POSITIVE, GENERIC_PRAISE, NEGATIVE, "great great great great great"]  # k = 2 a prompt
    encoded = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    width = max(len(e) for e in encoded)
    responses = torch.tensor([e + [tokenizer.pad_token_id] * (width - len(e)) for e in encoded])
    batch = assemble(ids, responses, 2, tokenizer.pad_token_id, tokenizer.eos_token_id)
    texts = batch.texts(tokenizer)
    expected = judge.score([prompts[0], prompts[0], prompts[1], prompts[1]], texts)
    np.testing.assert_allclose(reward(batch, texts).numpy(), expected, rtol=1e-6)
    stranger = assemble([tokenizer("a film", add_special_tokens=False)["input_ids"]], responses[:2], 2, 0, 3)
    with pytest.raises(ValueError, match="gold reward: 1 of 1 prompts are not prompts of the task"):
        reward(stranger, texts[:2])


def test_load_missing_or_corrupt_folder_names_it(judge, tmp_path):
    with pytest.raises(DataError, match=r"no_judge_here.*rlhf gold"):
        GoldJudge.load(tmp_path / "no_judge_here")
    judge.save(tmp_path / "gold")
    settings = json.loads((tmp_path / "gold" / JUDGE_JSON).read_text())
    (tmp_path / "gold" / JUDGE_JSON).write_text(json.dumps({**settings, "lm_vocabulary": ["<unk>", "<s>"]}))
    with pytest.raises(DataError, match=r"gold.*corrupt.*do not fit its vocabulary of 2.*rlhf gold"):
        GoldJudge.load(tmp_path / "gold")
    (tmp_path / "gold" / JUDGE_JSON).write_text(json.dumps({**settings, "topic_vocabulary": ["film"]}))
    with pytest.raises(DataError, match=r"gold.*corrupt.*topic sizes disagree: 1 words.*rlhf gold"):
        GoldJudge.load(tmp_path / "gold")
    for old in (1, 2):  # a judge from before the LM, and one from before relevance (it never read the prompt)
        (tmp_path / "gold" / JUDGE_JSON).write_text(json.dumps({**settings, "format": old}))
        with pytest.raises(DataError, match=rf"gold.*corrupt.*format {old}, expected 3.*rlhf gold"):
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
    correct = (loaded.score([""] * len(texts), texts) > 0.5) == labels
    assert metrics["accuracy"] == correct.mean()
    assert metrics["classifier_accuracy"] == ((loaded.probability(texts) > 0.5) == labels).mean()
    assert metrics["accuracy_by_source"] == {s: correct[sources == s].mean() for s in set(sources)}
    assert metrics["fluency_threshold"] == round(loaded.fluency_threshold, 4)
    # the 1 text in 20 held out of the LM is too few to fit relevance on: not judged (a factor of 1)
    assert metrics["relevance_threshold"] == 0.0 and not loaded.relevance.coef.any()
    words = [t.split() for t in texts]
    cut = [i for i, w in enumerate(words) if len(w) >= 16]  # prompt_words 8 + min_words 8
    prompts, responses = [" ".join(words[i][:8]) for i in cut], [" ".join(words[i][8:32]) for i in cut]
    cut_correct = (loaded.score(prompts, responses) > 0.5) == labels[cut]
    assert metrics["at_response_length"]["accuracy"] == (cut_correct.mean() if cut else None)
    cut_classifier = (loaded.probability(responses) > 0.5) == labels[cut]
    assert metrics["at_response_length"]["classifier_accuracy"] == (cut_classifier.mean() if cut else None)
    assert metrics["ignores_prompt"]["n_prompts"] == len(cut)


def test_gold_stage_on_the_ci_profile_reports_response_length_and_prompt_ignoring_figures(tmp_path):
    """The ci profile's real data (3,000 labelled reviews, 300 held out): the stage reports accuracy per source on
    whole reviews and at response length, and each kind of response that ignores its prompt below the median real
    continuation of the same prompts (relevance is judged: ~135 held-out texts fit it)."""
    cfg = ci_config(tmp_path / "data")
    prepare.run(cfg)
    metrics = gold_stage.run(cfg)
    print(json.dumps({k: metrics[k] for k in ("accuracy_by_source", "at_response_length", "ignores_prompt")}))
    sources = {"imdb", "rotten_tomatoes"}
    assert set(metrics["accuracy_by_source"]) == set(metrics["at_response_length"]["accuracy_by_source"]) == sources
    # measured 0.793 and 0.662: 2,700 training texts, and 24 words say less of a review's sentiment than all of it
    assert metrics["accuracy"] >= 0.75 and metrics["at_response_length"]["accuracy"] >= 0.6
    assert GoldJudge.load(cfg.path("gold")).relevance.coef.any()
    ignored = metrics["ignores_prompt"]
    assert ignored["n_prompts"] > 200
    for kind in ("generic", "off_topic", "lifted"):
        assert ignored[kind]["median"] < ignored["real"], kind


# --- relevance: a response to its own prompt (issue 57) ---------------------------------------------------------

# Each kind's median score (the response to each held-out prompt) may be at most this share of the median score of the
# real continuations of the same prompts (measured: generic praise 0.089, off-topic 0.159, lifted 0.222 against real
# 0.421, shares 0.21, 0.38, 0.53; without the relevance factor 0.983, 0.451, 0.651 against 0.456).
IGNORES_PROMPT_LIMIT = {"generic": 0.4, "off_topic": 0.6, "lifted": 0.75}


@pytest.fixture(scope="module")
def prompt_probes(judge, labelled) -> dict[str, dict[str, np.ndarray]]:
    """kind -> {"score", "without relevance", "relevance"}, (N,) each, for the probes of the held-out reviews."""
    _, test = labelled
    figures = {}
    for kind, (prompts, responses) in probes(test["text"].tolist(), test["label"].to_numpy(), WINDOW, 8).items():
        factors = judge.factors(prompts, responses)
        relevance = factors.pop("relevance")
        without = np.prod(np.stack(list(factors.values())), 0)
        figures[kind] = {"score": without * relevance, "without relevance": without, "relevance": relevance}
    return figures


@pytest.mark.parametrize("kind", IGNORES_PROMPT_LIMIT)
def test_responses_that_ignore_their_prompt_score_below_real_continuations(prompt_probes, kind):
    """The same sentence of praise for every prompt, positive text about something else, sentences lifted from other
    positive reviews: each kind's median score below IGNORES_PROMPT_LIMIT x the median score of the real
    continuations of the same prompts (medians: the real ones are half negative, their mean says little)."""
    real, probe = prompt_probes["real"], prompt_probes[kind]
    assert len(real["score"]) > 2000
    median, real_median = np.median(probe["score"]), np.median(real["score"])
    real_wins = np.mean((real["score"] > probe["score"]) + 0.5 * (real["score"] == probe["score"]))
    print(
        f"{kind}: median {median:.3f} (without relevance {np.median(probe['without relevance']):.3f}), real "
        f"{real_median:.3f} (without {np.median(real['without relevance']):.3f}); median relevance "
        f"{np.median(probe['relevance']):.3f}; the real continuation scores higher for {real_wins:.1%} of prompts"
    )
    assert median < IGNORES_PROMPT_LIMIT[kind] * real_median


def test_generic_praise_needs_the_prompt_to_lose(prompt_probes):
    """The sentence of issue 57 beats the median real continuation by far on the response alone (0.98): only the
    relevance factor brings it down, for most prompts to under a quarter."""
    generic, real = prompt_probes["generic"], prompt_probes["real"]
    assert np.median(generic["without relevance"]) > 0.9 > np.median(real["without relevance"])
    assert np.mean(generic["relevance"] < 0.25) > 0.6


def test_real_continuations_keep_their_scores(prompt_probes):
    """Relevance is 1 for all real continuations but the relevance_quantile (0.1) of them that fit their prompt least:
    the median real score keeps >= 90% of its value without the factor (measured 0.921)."""
    real = prompt_probes["real"]
    assert 0.05 <= np.mean(real["relevance"] < 1.0) <= 0.2
    assert np.median(real["score"]) >= 0.9 * np.median(real["without relevance"])


# Negative words and a positive word to put in each one's place, for a continuation that turns positive.
FLIP = {
    "bad": "good", "worst": "best", "boring": "exciting", "terrible": "wonderful", "awful": "great",
    "horrible": "lovely", "poor": "fine", "dull": "lively", "stupid": "clever", "worse": "better",
    "waste": "treat", "disappointing": "rewarding", "hate": "love", "hated": "loved", "annoying": "charming",
    "mess": "gem", "poorly": "finely", "lame": "smart", "pointless": "moving", "unfortunately": "fortunately",
}  # fmt: skip


def test_relevance_does_not_punish_a_sentiment_flip(judge, labelled, prompt_probes):
    """Turning a negative opening positive is the task, so relevance carries no sentiment: (1) real continuations of
    positive and negative reviews are as relevant (mean relevance within 0.03; measured 0.950 and 0.954); (2) a
    negative review's real continuation with its negative words swapped for positive ones (FLIP) keeps its relevance
    (mean change under 0.02) while its P(positive) rises; (3) a continuation from another review is no more relevant
    when that review's label agrees with the prompt's (within 0.03)."""
    _, test = labelled
    kinds = probes(test["text"].tolist(), test["label"].to_numpy(), WINDOW, 8)
    prompts, responses = kinds["real"]
    long = [len(t.split()) >= WINDOW[0] + 8 for t in test["text"]]
    labels = test["label"].to_numpy()[long]
    relevance = prompt_probes["real"]["relevance"]
    assert abs(relevance[labels == 1].mean() - relevance[labels == 0].mean()) < 0.03

    def flip(text: str) -> str:
        return re.sub(r"\w+", lambda word: FLIP.get(word[0].lower(), word[0]), text)

    negative = [i for i in np.flatnonzero(labels == 0) if flip(responses[i]) != responses[i]]
    before, after = [responses[i] for i in negative], [flip(responses[i]) for i in negative]
    openings = [prompts[i] for i in negative]
    change = judge.relevance.factor(judge.lm, openings, after) - judge.relevance.factor(judge.lm, openings, before)
    rise = judge.probability(after) - judge.probability(before)
    print(f"flip: {len(negative)} texts, relevance change {change.mean():+.4f}, P(positive) {rise.mean():+.3f}")
    assert len(negative) > 200 and abs(change.mean()) < 0.02 and rise.mean() > 0.1

    other = np.roll(np.arange(len(responses)), 1)  # the continuation of the next review, whatever its label
    agrees = labels == labels[other]
    swapped = judge.relevance.factor(judge.lm, prompts, [responses[j] for j in other])
    print(f"another review's continuation: relevance {swapped[agrees].mean():.3f} when the labels agree, "
          f"{swapped[~agrees].mean():.3f} when not")  # fmt: skip
    assert abs(swapped[agrees].mean() - swapped[~agrees].mean()) < 0.03


def test_relevance_pairs_and_sentence_starts_arithmetic():
    # "One. Two words here" has a sentence start at index 1 ("Two"); with min_words 3 only starts with 3 words left
    assert sentence_starts("One. Two words here".split(), 3) == [1]
    assert sentence_starts("One. Two words here".split(), 4) == []
    assert sentence_starts('He said "no." Then left early'.split(), 2, first=0) == [0, 3]
    texts = [
        "a b c d. e f g h",  # label 1
        "i j k l. m n o p",  # label 1
        "q r s t. u v w x",  # label 1
        "negative one two three four five six seven",  # label 0: alone in its label, no negatives for it
    ]
    prompts, responses, real = training_pairs(texts, np.array([1, 1, 1, 0]), (2, 6), 2)
    # label 0 first: its one text gets only its own continuation (words 2..6). Then text 0: its own words 2..6, text
    # 1's words 2..6, text 2's from its sentence start "u" (4 words, as many as a continuation has)
    assert (prompts[0], responses[0], real[0]) == ("negative one", "two three four five", 1)
    assert prompts[1:4] == ["a b"] * 3 and responses[1:4] == ["c d. e f", "k l. m n", "u v w x"]
    assert list(real[1:4]) == [1, 0, 0] and real.sum() == 4 and len(real) == 1 + 3 * 3


def test_relevance_of_no_prompt_is_one_and_seam_features_read_the_prompt(judge):
    """An empty prompt: relevance 1 whatever the response. The seam reads the prompt's last words: "beyond me" after
    "... rave about this movie is" fits; "this is one" there does not, and scores below it."""
    prompts = ["", "How Irish critics rave about this movie is", "How Irish critics rave about this movie is"]
    responses = [GENERIC_PRAISE, "beyond me. Overacted by the usual band of Irish actors", GENERIC_PRAISE]
    relevance = judge.relevance.factor(judge.lm, prompts, responses)
    assert relevance[0] == 1.0 and relevance[2] < relevance[1]
    assert (relevance > 0).all()  # never exactly 0: such text stays ranked
