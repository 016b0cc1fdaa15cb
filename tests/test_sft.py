"""rlhf.stages.sft: data helpers, schedule, and the stage end to end on a micro config."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import torch

from rlhf.config import Config, ConfigError, ModelConfig, SFTConfig
from rlhf.data.schemas import DataError
from rlhf.data.splits import save_splits
from rlhf.io import read_json
from rlhf.models import loading, tiny
from rlhf.stages import sft

MICRO_MODEL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=32
)
MICRO_SFT = SFTConfig(epochs=4, batch_size=16, learning_rate=1e-2, warmup_ratio=0.1, max_length=16, heldout_texts=40)


def _reviews(n: int, seed: int = 0) -> list[str]:
    """Template reviews: a small, learnable language (the loss must fall well below uniform)."""
    rng = random.Random(seed)
    subjects = ["the movie", "this film", "the acting", "the plot", "the story", "the ending"]
    verdicts = ["was great", "was bad", "was boring", "was wonderful", "is a mess", "is a delight"]
    tails = ["and i loved it .", "and i hated it .", "so see it !", "so skip it .", "overall ."]
    return [f"{rng.choice(subjects)} {rng.choice(verdicts)} {rng.choice(tails)}" for _ in range(n)]


def _config(tmp_path, **sft_updates) -> Config:
    return Config(
        profile="test", seed=3, data_dir=str(tmp_path), model=MICRO_MODEL, sft=MICRO_SFT.model_copy(update=sft_updates)
    )


@pytest.fixture
def prepared(tmp_path):
    save_splits({"sft": pd.DataFrame({"text": _reviews(300)})}, tmp_path / "prepared")
    return tmp_path


# --- helpers ---------------------------------------------------------------------------------------------


def test_encode_texts_truncates_and_appends_eos():
    tok = tiny.train_word_tokenizer(["a b c d e f g h"], vocab_size=32)
    seqs = sft.encode_texts(tok, ["a b c d e f g h", "a b"], max_length=5)
    assert seqs[0] == tok("a b c d", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # 4 words + EOS = 5
    assert seqs[1] == tok("a b", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with pytest.raises(ConfigError, match="max_length"):
        sft.encode_texts(tok, ["a"], max_length=1)


def test_collate_masks_the_prompt_of_each_sequence():
    ids, mask, labels = sft.collate([[5, 6, 7], [8, 9]], pad_id=0, prompt_lengths=[2, 1])
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert labels.tolist() == [[sft.IGNORE, sft.IGNORE, 7], [sft.IGNORE, 9, sft.IGNORE]]


def test_collate_right_pads_and_masks_labels():
    ids, mask, labels = sft.collate([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [[5, 6, 7], [8, -100, -100]]


@pytest.mark.parametrize("architecture", ["llama", "gpt_neox"])
def test_packed_batches_give_the_padded_batches_loss_and_gradients(architecture):
    tok = tiny.train_word_tokenizer(_reviews(50), vocab_size=64)
    model = tiny.build_tiny_model(MICRO_MODEL.model_copy(update={"architecture": architecture}), tok, seed=0)
    rng = random.Random(0)
    seqs = [[rng.randrange(4, len(tok)) for _ in range(rng.randrange(2, 16))] for _ in range(12)]
    prompts = [rng.randrange(0, len(s) - 1) for s in seqs]  # 0: a plain text, every token but the first learnt

    def loss_and_grads(inputs):
        model.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    ids, mask, labels = sft.collate(seqs, tok.pad_token_id, prompts)
    padded, padded_grads = loss_and_grads({"input_ids": ids, "attention_mask": mask, "labels": labels})
    inputs = sft.pack(seqs, tok.pad_token_id, prompts, row_tokens=32)
    packed, packed_grads = loss_and_grads(inputs)
    assert len(inputs["input_ids"]) < len(seqs)  # several sequences share a row
    assert packed == pytest.approx(padded, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(packed_grads, padded_grads))
    assert (inputs["labels"] != sft.IGNORE).sum() == (labels[:, 1:] != sft.IGNORE).sum()  # the same tokens learnt


def test_batch_order_covers_epochs_and_is_seeded():
    batches = sft.batch_order(10, batch_size=4, epochs=1.0, seed=0)
    assert [len(b) for b in batches] == [4, 4, 2]
    assert sorted(i for b in batches for i in b) == list(range(10))  # one epoch: each index once
    flat = [i for b in sft.batch_order(10, batch_size=4, epochs=1.5, seed=0) for i in b]
    assert len(flat) == 15 and sorted(flat[:10]) == list(range(10)) and len(set(flat[10:])) == 5
    assert sft.batch_order(10, 4, 1.5, seed=0) == sft.batch_order(10, 4, 1.5, seed=0)
    assert sft.batch_order(10, 4, 1.0, seed=0) != sft.batch_order(10, 4, 1.0, seed=1)


def test_lr_factor_warmup_then_cosine():
    # 10 warmup steps of 110: step s < 10 gives (s+1)/10; then cos over the remaining 100 steps
    assert sft.lr_factor(0, 110, 10) == pytest.approx(0.1)
    assert sft.lr_factor(9, 110, 10) == pytest.approx(1.0)
    assert sft.lr_factor(10, 110, 10) == pytest.approx(1.0)
    assert sft.lr_factor(60, 110, 10) == pytest.approx(0.5)  # halfway: (1 + cos(pi/2)) / 2
    assert sft.lr_factor(110, 110, 10) == pytest.approx(0.0)
    assert sft.lr_factor(0, 5, 0) == pytest.approx(1.0)


def test_split_heldout_is_disjoint_and_capped():
    texts = [f"t{i}" for i in range(50)]
    train, held = sft.split_heldout(texts, n_heldout=40, seed=0)
    assert len(held) == 10 and len(train) == 40  # capped at len // 5
    assert sorted(train + held) == list(range(50))


# --- the stage -------------------------------------------------------------------------------------------


def test_sft_stage_lowers_loss_and_writes_loadable_model(prepared):
    cfg = _config(prepared)
    metrics = sft.run(cfg)

    assert read_json(cfg.path("metrics", "sft.json")) == metrics
    assert metrics["n_train_texts"] == 260 and metrics["n_heldout_texts"] == 40  # 300 texts, 40 held out
    assert metrics["steps"] == math.ceil(4 * 260 / 16)
    assert metrics["train_loss"] < 0.5 * metrics["train_loss_initial"]
    model = loading.load_causal_lm(cfg.path("sft"))
    tok = loading.load_tokenizer(cfg.path("sft"))
    assert tok.padding_side == "left" and metrics["n_params"] == tiny.count_parameters(model)
    # far below the uniform guess over the vocabulary: the template language was learnt
    assert metrics["heldout_loss"] < 0.5 * math.log(len(tok))
    assert metrics["heldout_perplexity"] == pytest.approx(math.exp(metrics["heldout_loss"]))
    # the saved model is the trained one: recomputing the held-out loss from disk gives the same number
    texts = _reviews(300)
    held = [texts[i] for i in sft.split_heldout(texts, cfg.sft.heldout_texts, cfg.seed)[1]]
    again = sft.mean_token_loss(model, sft.encode_texts(tok, held, cfg.sft.max_length), 16, tok.pad_token_id, "cpu")
    assert again == pytest.approx(metrics["heldout_loss"], rel=1e-5)
    # it learnt to stop: after a full template, EOS is the most likely next token
    ids = tok("the movie was great and i loved it .", return_tensors="pt", add_special_tokens=False)["input_ids"]
    assert model(ids).logits[0, -1].argmax().item() == tok.eos_token_id


def test_sft_stage_nan_loss_saves_nothing(prepared, monkeypatch):
    build = tiny.build_tiny_model

    def poisoned(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            model.get_input_embeddings().weight.fill_(float("nan"))
        return model

    monkeypatch.setattr(tiny, "build_tiny_model", poisoned)
    cfg = _config(prepared)
    with pytest.raises(FloatingPointError, match="nothing was saved"):
        sft.run(cfg)
    assert not cfg.path("sft").exists() and not cfg.path("metrics", "sft.json").exists()


def test_sft_stage_needs_prepared_data(tmp_path):
    with pytest.raises(DataError, match="rlhf prepare"):
        sft.run(_config(tmp_path))


def test_tiny_without_training_is_refused(prepared):
    with pytest.raises(ConfigError, match="sft.train"):
        sft.run(_config(prepared, train=False))


def test_a_pretrained_reward_model_is_used_as_the_proxy_and_measured_against_gold(ci_stages, tmp_path):
    """reward.pretrained (the paper's RMs on GPU machines; a local folder here): no training, only agreement."""
    from conftest import ci_config

    from rlhf.stages import reward

    data = tmp_path / "data"
    data.mkdir()
    for name in ("prepared", "gold", "sft"):
        (data / name).symlink_to(ci_stages / name)
    metrics = reward.run(ci_config(data, f"reward.pretrained={ci_stages / 'reward' / 'model'}"))
    assert metrics["pretrained"] == str(ci_stages / "reward" / "model") and "train_loss" not in metrics
    assert 0 <= metrics["agreement_heldout"] <= 1 and metrics["n_test"] == metrics["n_pairs"] >= 4
    saved, given = (loading.load_reward_model(d / "reward" / "model").state_dict() for d in (data, ci_stages))
    assert saved.keys() == given.keys() and all(torch.equal(saved[k], given[k]) for k in saved)


def test_the_reward_model_scores_the_sft_samples_it_was_fitted_on_at_mean_0_std_1(ci_stages, tmp_path):
    """reward.normalize: whatever offset and scale the Bradley-Terry fit left, the RM reads the SFT samples it is
    normalised on at mean 0, std 1 (so train.penalty_reward_value = -1 is one std below them), every later load
    reads it so (the stage's figures are in its config), and the ranking is the raw head's."""
    from conftest import ci_config

    from rlhf.data.schemas import PreferencePairs
    from rlhf.data.splits import load_split
    from rlhf.models.forward import reward_normalization
    from rlhf.stages import reward

    rm = loading.load_reward_model(ci_stages / "reward" / "model")
    metrics = json.loads((ci_stages / "metrics" / "reward.json").read_text())
    assert reward_normalization(rm) == (metrics["raw_score_mean"], metrics["raw_score_std"])
    df = load_split(ci_stages / "reward" / "pairs", "train", PreferencePairs)
    tok = loading.load_tokenizer(ci_stages / "sft")
    df["prompt_ids"] = loading.encode_prompts(tok, list(df["prompt"]), ci_config(ci_stages).data.chat_template)
    for column in ("chosen", "rejected"):  # the saved pairs are text
        df[f"{column}_ids"] = [tok(t, add_special_tokens=False)["input_ids"] for t in df[column]]

    def scores():
        with torch.no_grad():
            return torch.cat(reward._pair_scores(rm, tok, df, "cpu"))

    stats = reward.normalize(rm, tok, df, 8, "cpu")  # on these pairs, 8 a batch
    normalized = scores()
    assert float(normalized.mean()) == pytest.approx(0, abs=1e-5) and float(normalized.std()) == pytest.approx(1)
    rm.config.reward_normalization = None
    raw = scores()
    assert stats["raw_score_mean"] == pytest.approx(float(raw.mean()))
    assert stats["raw_score_std"] == pytest.approx(float(raw.std()))
    assert torch.equal(raw.argsort(), normalized.argsort())
    data = tmp_path / "data"
    data.mkdir()
    for name in ("prepared", "gold", "sft"):
        (data / name).symlink_to(ci_stages / name)
    off = reward.run(ci_config(data, "reward.normalize=false"))
    assert "raw_score_mean" not in off
    assert reward_normalization(loading.load_reward_model(data / "reward" / "model")) is None


def test_a_pretrained_reward_model_of_another_tokenizer_is_refused_in_one_line(ci_stages, tmp_path):
    """The RM is saved and used with the SFT policy's tokenizer: one trained with another would score other words."""
    from conftest import ci_config

    from rlhf.stages import reward

    data = tmp_path / "data"
    data.mkdir()
    for name in ("prepared", "gold", "sft"):
        (data / name).symlink_to(ci_stages / name)
    other = tmp_path / "other_tokenizer"  # the same weights, two words' ids swapped: it reads other words
    shutil.copytree(ci_stages / "reward" / "model", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[-2:]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(
        ValueError, match=r"reward.pretrained: .*other_tokenizer's tokenizer is not the SFT policy's \(2 of"
    ):
        reward.run(ci_config(data, f"reward.pretrained={other}"))


def test_a_hub_reward_model_is_held_to_its_tokenizer_too(ci_stages, monkeypatch):
    """`reward.pretrained` as a hub id (the GPU profile's, mnoukhov/pythia410m-rm-tldr6.9b): its tokenizer comes from
    the hub, here a stand-in for the hub (no network): the same vocabulary passes, another is refused, a repo without
    a tokenizer falls back to the embedding's size."""
    from rlhf.stages import reward

    tokenizer = loading.load_tokenizer(ci_stages / "sft")
    model = loading.load_reward_model(ci_stages / "reward" / "model")
    other = loading.load_tokenizer(ci_stages / "sft")
    first, second = sorted(other.get_vocab(), key=other.get_vocab().get)[-2:]
    swapped = {**other.get_vocab(), first: other.get_vocab()[second], second: other.get_vocab()[first]}
    repos = {"org/same": tokenizer, "org/other": type("Tok", (), {"get_vocab": lambda self: swapped})()}

    def from_hub(repo, hub=False):  # the stand-in for the hub
        assert hub, "a hub id must be read from the hub"
        if repo not in repos:
            raise OSError(f"{repo} does not appear to have a file named tokenizer_config.json")
        return repos[repo]

    monkeypatch.setattr(loading, "load_tokenizer", from_hub)
    reward._check_vocabulary("org/same", True, model, tokenizer)
    reward._check_vocabulary("org/weights-only", True, model, tokenizer)
    with pytest.raises(ValueError, match=r"reward.pretrained: org/other's tokenizer is not the SFT policy's \(2 of"):
        reward._check_vocabulary("org/other", True, model, tokenizer)


@pytest.mark.slow
def test_a_shallow_reward_model_gets_its_head_fitted_on_pairs_vllm_sampled(ci_stages, tmp_path):
    """The smollm2 profile's reward settings at ci size: pairs from vLLM, the first layer of the SFT backbone kept as
    it is, scores averaged over the response, and only the head fitted."""
    from conftest import ci_config

    from rlhf.stages import reward

    data = tmp_path / "data"
    data.mkdir()
    for name in ("prepared", "gold", "sft"):
        (data / name).symlink_to(ci_stages / name)
    settings = ("reward.engine=vllm", "reward.num_layers=1", "reward.pooling=mean", "reward.trainable=head")
    metrics = reward.run(ci_config(data, *settings))
    assert metrics["head_l2"] in reward.HEAD_L2 and metrics["agreement_train"] > 0.6, metrics
    rm, sft = loading.load_reward_model(data / "reward" / "model"), loading.load_causal_lm(ci_stages / "sft")
    assert rm.config.reward_pooling == "mean" and len(rm.model.layers) == 1
    backbone = {**rm.model.layers[0].state_dict(), "embed": rm.model.embed_tokens.weight}
    original = {**sft.model.layers[0].state_dict(), "embed": sft.model.embed_tokens.weight}
    assert all(torch.equal(backbone[k], original[k]) for k in backbone)
    with pytest.raises(ValueError, match="reward.num_layers=99: the SFT model in .* has"):
        reward.run(ci_config(data, "reward.num_layers=99"))


def test_map_in_processes_runs_in_workers_and_raises_their_errors_here():
    from rlhf.runtime import map_in_processes

    me = str(os.getpid())
    assert map_in_processes(os.readlink, ["/proc/self"], 2) == [me]  # one item: no worker to start
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs 2 allowed CPU cores to start 2 workers")
    assert me not in map_in_processes(os.readlink, ["/proc/self", "/proc/self"], 2)
    with pytest.raises(FileNotFoundError, match="no-such-file"):
        map_in_processes(os.readlink, ["/proc/self", "/no-such-file"], 2)


@pytest.mark.slow
def test_generate_and_evaluate_sample_with_vllm_as_hf_does(ci_data):
    """eval.engine=vllm: one vLLM engine per model samples the eval prompts; near-greedy, it writes the responses HF
    generate writes (up to a rare near-tie between float paths), and evaluate's metrics come out of the same code."""
    import shutil

    from conftest import ci_config

    from rlhf.data.schemas import Generations
    from rlhf.data.splits import load_split
    from rlhf.stages import evaluate, generate
    from rlhf.trainers.loop import train

    train(ci_config(ci_data, "train.total_episodes=8", "train.per_device_train_batch_size=2"))
    generate.run(ci_config(ci_data))
    by_hf = load_split(ci_data / "generations", "eval", Generations)
    shutil.rmtree(ci_data / "generations")
    generate.run(ci_config(ci_data, "eval.engine=vllm"))
    by_vllm = load_split(ci_data / "generations", "eval", Generations)
    assert list(by_vllm["model"]) == list(by_hf["model"]) and list(by_vllm["prompt"]) == list(by_hf["prompt"])
    differ = int((by_vllm["response"] != by_hf["response"]).sum())  # 0 of 48 when measured (ci, 2026-11-27)
    assert differ <= 1, f"{differ} of {len(by_hf)} responses differ"
    shutil.rmtree(ci_data / "generations")  # sampled at temperature 1, the micro model says something
    generate.run(ci_config(ci_data, "eval.engine=vllm", "eval.temperature=1.0"))
    sampled = load_split(ci_data / "generations", "eval", Generations)
    assert (sampled["response"].str.len() > 0).mean() > 0.5, sampled["response"]
    metrics = evaluate.run(ci_config(ci_data, "eval.engine=vllm"))
    # eval.processes=2: the models in two processes at once sample and score what they do one after another (the
    # jobs are the engine's either way; HF's, whose build costs a fresh process nothing, at temperature 1)
    shutil.rmtree(ci_data / "generations")
    generate.run(ci_config(ci_data, "eval.temperature=1.0"))
    one_by_one = load_split(ci_data / "generations", "eval", Generations)
    shutil.rmtree(ci_data / "generations")
    generate.run(ci_config(ci_data, "eval.temperature=1.0", "eval.processes=2"))
    pd.testing.assert_frame_equal(load_split(ci_data / "generations", "eval", Generations), one_by_one)
    assert evaluate.run(ci_config(ci_data, "eval.processes=2")) == evaluate.run(ci_config(ci_data))
    models = ["policy", "sft", "policy@4"]  # and the policy kept after batch 1 of 2 (train.eval_checkpoints)
    assert list(by_vllm["model"].unique()) == models and metrics["n_prompts"] * 3 == len(by_vllm)
    assert all(math.isfinite(v) for v in metrics.values()), metrics


def test_a_stage_alone_takes_a_thread_per_core_unless_told(monkeypatch):
    """`dvc repro` runs the sft stage alone on its cores (2 threads: 1.7x on the tiny SFT); the suite's processes
    share theirs, so conftest sets RLHF_TORCH_THREADS=1, which wins; an invalid value names the variable."""
    from rlhf.runtime import threads_alone

    monkeypatch.delenv("RLHF_TORCH_THREADS")
    assert threads_alone() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("RLHF_TORCH_THREADS", "1")
    assert threads_alone() == 1
    monkeypatch.setenv("RLHF_TORCH_THREADS", "0")
    with pytest.raises(ValueError, match="RLHF_TORCH_THREADS='0': expected an integer >= 1"):
        threads_alone()


def test_a_stage_on_every_core_says_so_when_another_stage_runs_on_them(monkeypatch, capsys):
    """A `make run` beside a queued experiment's stage: the stage alone takes a thread per core, and a 2-thread stage
    beside a 1-thread one ran 4-40x slower (docs/benchmarks.md). It keeps its thread count (results must not hang
    on what runs beside) and warns in one line naming the other stage and the setting."""
    from rlhf import runtime

    monkeypatch.delenv("RLHF_TORCH_THREADS")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two cores, as on these boxes
    # stands in for another stage: a process whose command line is `python -c ... rlhf.cli sft`
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rlhf.cli", "sft"])
    try:
        assert f"pid {other.pid} `rlhf.cli sft`" in runtime.other_stages()
        assert runtime.threads_alone() == 2
        warning = capsys.readouterr().err
        assert warning.count("\n") == 1 and warning.startswith("rlhf: warning: 2 torch threads")
        assert f"pid {other.pid} `rlhf.cli sft`" in warning and "RLHF_TORCH_THREADS=1" in warning
    finally:
        other.kill()
        other.wait()
    assert f"pid {other.pid} " not in " ".join(runtime.other_stages())


def test_a_stage_of_a_queued_dvc_experiment_takes_one_thread_and_the_repositorys_cache(monkeypatch, tmp_path):
    """DVC's queue runs experiments side by side in copies under <repo>/.dvc/tmp (DVC_ROOT names the repo): two
    `tiny` train stages at once took 6-8x as long with a thread per core each as with one. A copy's caches are the
    repository's (the copy is deleted after the run)."""
    from rlhf import runtime

    monkeypatch.delenv("RLHF_TORCH_THREADS")
    copy = tmp_path / "repo" / ".dvc" / "tmp" / "exps" / "tmpab12"
    copy.mkdir(parents=True)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "repo"))
    assert runtime.queued_from(copy) == (tmp_path / "repo").resolve()
    assert runtime.queued_from(tmp_path / "repo") is None  # `dvc repro`, `dvc exp run` in the workspace
    monkeypatch.chdir(copy)
    assert runtime.threads_alone() == 1
    monkeypatch.setenv("RLHF_TORCH_THREADS", "2")  # told: `RLHF_TORCH_THREADS=2 dvc queue start` (one worker)
    assert runtime.threads_alone() == 2
    monkeypatch.delenv("RLHF_TORCH_THREADS")
    monkeypatch.chdir(tmp_path / "repo")
    assert runtime.threads_alone() == len(os.sched_getaffinity(0))
    monkeypatch.delenv("DVC_ROOT")  # outside DVC
    assert runtime.queued_from(copy) is None
    env = {**os.environ, "DVC_ROOT": str(tmp_path / "repo"), "RLHF_CACHE_DIR": ""}
    code = "from rlhf import runtime; print(runtime.CACHE)"
    cache = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env, capture_output=True, text=True, check=True)
    assert cache.stdout.strip() == str((tmp_path / "repo").resolve() / ".cache")
