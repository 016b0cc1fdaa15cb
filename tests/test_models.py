"""rlhf.models: the word-level tokenizer, the tiny model factory, loading/saving, reward heads, packaged SmolLM2."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from rlhf.config import ModelConfig
from rlhf.models import loading, tiny
from rlhf.models.forward import response_logprobs, scalar_head, sequence_scores

TEXTS = [
    "The movie was great, and the acting was great!",
    "I didn't like the movie. The plot was bad.",
    "Great acting; bad plot. It's a movie.",
]
SMALL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48, max_position_embeddings=32
)


@pytest.fixture(scope="module")
def tok():
    return tiny.train_word_tokenizer(TEXTS, vocab_size=64)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tok):
    folder = tmp_path_factory.mktemp("tiny") / "policy"
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, folder)
    return folder


# --- tokenizer -------------------------------------------------------------------------------------------


def test_word_tokenizer_vocab_specials_and_round_trip(tmp_path, tok):
    # distinct lower-cased words/punctuation in TEXTS: the movie was great , and acting ! i didn't like . plot
    # bad ; it's a  -> 17, plus 4 specials (vocab_size 64 is not reached).
    assert len(tok) == 17 + 4
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    ids = tok("The MOVIE was great, it's bad!", add_special_tokens=False)["input_ids"]
    assert len(ids) == 8  # the movie was great , it's bad !  (no BOS/EOS added)
    assert tok.decode(ids) == "the movie was great, it's bad!"
    assert tok("zebra movie", add_special_tokens=False)["input_ids"][0] == tok.unk_token_id
    assert tiny.train_word_tokenizer(TEXTS, 64).get_vocab() == tok.get_vocab()  # deterministic
    assert len(tiny.train_word_tokenizer(TEXTS, 10)) == 10  # capped: 6 most frequent words + 4 specials

    tok.save_pretrained(tmp_path)
    reloaded = loading.load_tokenizer(tmp_path)
    assert reloaded.padding_side == "left"
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 3)
    assert reloaded("The MOVIE was great, it's bad!", add_special_tokens=False)["input_ids"] == ids
    batch = reloaded(["great movie", "the plot was bad"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0] and batch["attention_mask"][0] == [0, 0, 1, 1]


# --- tiny model, save/load -------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["llama", "gpt_neox"])
def test_response_logprobs_read_the_response_positions_of_the_full_logits(tok, architecture):
    """response_logprobs puts only the last T+1 positions through the LM head (logits_to_keep): the same numbers as
    the log-softmax of the whole forward's logits at positions C-1 .. C+T-2, left padding and a LoRA wrap included."""
    from peft import LoraConfig, get_peft_model

    from rlhf.algorithms.common import logprobs_from_logits
    from rlhf.models.batch import assemble

    model = tiny.build_tiny_model(SMALL.model_copy(update={"architecture": architecture}), tok, seed=3)
    lora = get_peft_model(tiny.build_tiny_model(SMALL, tok, seed=3), LoraConfig(r=2, target_modules="all-linear"))
    responses = torch.tensor([[5, 6, 3, 0], [7, 8, 9, 10], [4, 3, 0, 0], [11, 12, 13, 3]])
    batch = assemble([[4, 5, 6], [7, 8, 9, 10, 11]], responses, 2, tok.pad_token_id, tok.eos_token_id)
    rows, C = (batch.sequences, batch.attn, batch.positions), batch.context
    for m in (model, lora):
        full = m(input_ids=batch.sequences, attention_mask=batch.attn, position_ids=batch.positions).logits
        assert full.shape[1] == C + 4  # the model computed every position's logits
        expected = logprobs_from_logits(full[:, C - 1 : -1], batch.sequences[:, C:], 0.7)
        torch.testing.assert_close(response_logprobs(m, *rows, C, 0.7), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("architecture", ["llama", "gpt_neox"])
def test_tiny_model_save_reload_identical_logits(tmp_path, tok, architecture):
    cfg = SMALL.model_copy(update={"architecture": architecture})
    model = tiny.build_tiny_model(cfg, tok, seed=7)
    assert model.config.model_type == architecture
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tied == (architecture == "llama")  # GPT-NeoX as Pythia: embed_in and lm_head apart
    assert (model.config.pad_token_id, model.config.eos_token_id) == (0, 3)
    assert model.get_input_embeddings().weight.shape == (21, 32) and model.dtype == torch.float32
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())
    same = tiny.build_tiny_model(cfg, tok, seed=7)
    other = tiny.build_tiny_model(cfg, tok, seed=8)
    x = torch.tensor([[4, 5, 6, 7, 8]])
    assert torch.equal(model(x).logits, same(x).logits)
    assert not torch.equal(model(x).logits, other(x).logits)

    loading.save_pretrained(model, tok, tmp_path / "m")
    reloaded = loading.load_causal_lm(tmp_path / "m")
    assert not reloaded.training
    torch.testing.assert_close(reloaded(x).logits, model(x).logits, rtol=0, atol=0)


def test_save_pretrained_replaces_old_folder_atomically(tmp_path, tok):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "stale.txt").write_text("old")
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, folder)
    assert not (folder / "stale.txt").exists()
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind


def test_load_missing_folder_names_it(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        loading.load_causal_lm(missing)


def test_truncated_or_missing_weights_name_the_file(tmp_path, tiny_folder):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_folder, bad)
    weights = bad / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    with pytest.raises(ValueError, match=r"bad/model\.safetensors: truncated or corrupt"):
        loading.load_causal_lm(bad)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match=r"bad/model\.safetensors"):
        loading.load_causal_lm(bad)


def test_load_policy_local_and_tiny(tiny_folder):
    model, tok = loading.load_policy(ModelConfig(source="local", path=str(tiny_folder)))
    assert model.config.model_type == "llama" and tok.padding_side == "left"
    with pytest.raises(ValueError, match="tiny"):
        loading.load_policy(ModelConfig(source="tiny"))


# --- reward / value heads --------------------------------------------------------------------------------


def test_reward_model_from_causal_scalar_per_sequence(tmp_path, tiny_folder):
    causal = loading.load_causal_lm(tiny_folder)
    rm = loading.reward_model_from_causal(tiny_folder, seed=0)
    assert rm.config.pad_token_id == 0 and rm.config.num_labels == 1
    torch.testing.assert_close(rm.model.embed_tokens.weight, causal.model.embed_tokens.weight, rtol=0, atol=0)
    # left-padded batch: the sequence score is the per-token value at the last position
    ids = torch.tensor([[0, 0, 4, 5, 6], [4, 5, 6, 7, 8]])
    mask = (ids != 0).long()
    scores = rm(input_ids=ids, attention_mask=mask).logits[:, 0]
    values = scalar_head(rm, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0))
    assert scores.shape == (2,) and values.shape == (2, 5)
    torch.testing.assert_close(scores, values[:, -1])
    # padding changes nothing: row 0 alone, unpadded, scores the same
    torch.testing.assert_close(rm(input_ids=ids[:1, 2:]).logits[0, 0], scores[0], rtol=1e-5, atol=1e-6)
    # the seed fixes the new head; a different seed changes it
    torch.testing.assert_close(
        loading.reward_model_from_causal(tiny_folder, seed=0).score.weight, rm.score.weight, rtol=0, atol=0
    )
    assert not torch.equal(loading.reward_model_from_causal(tiny_folder, seed=1).score.weight, rm.score.weight)

    loading.save_pretrained(rm, loading.load_tokenizer(tiny_folder), tmp_path / "rm")
    again = loading.load_reward_model(tmp_path / "rm")
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).logits[:, 0], scores)


def test_a_reward_model_from_a_causal_lm_loads_without_a_warning_but_refuses_a_checkpoint_lacking_a_weight(
    tmp_path, tiny_folder
):
    import logging

    from safetensors.torch import load_file, save_file

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append
    log = logging.getLogger("transformers")  # every transformers logger's records reach it (the LOAD REPORT table)
    log.addHandler(handler)
    try:
        loading.reward_model_from_causal(tiny_folder, seed=0)
        loading.load_causal_lm(tiny_folder)
        assert [r.getMessage() for r in warnings] == []  # the new score head is the design: no "MISSING" table
        broken = tmp_path / "broken"
        shutil.copytree(tiny_folder, broken)
        weights = load_file(broken / "model.safetensors")
        del weights["model.norm.weight"]
        save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"{broken}: .*lacks model.norm.weight"):
            loading.reward_model_from_causal(broken, seed=0)
        with pytest.raises(ValueError, match=f"{broken}: .*lacks model.norm.weight"):
            loading.load_causal_lm(broken)  # the policy too: the reward stage samples with it first
    finally:
        log.removeHandler(handler)


def test_a_checkpoint_whose_weight_has_another_shape_than_its_config_says_is_an_error_naming_it(tmp_path, tiny_folder):
    import json

    folder = tmp_path / "resized"
    shutil.copytree(tiny_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    saved = (config["vocab_size"], config["hidden_size"])
    with pytest.raises(ValueError, match=re.escape(f"{folder}: model.embed_tokens.weight has shape {saved} in the")):
        loading.load_causal_lm(folder)  # transformers would re-initialise it at random, with a warning


def test_a_shallow_mean_pooled_reward_model_scores_the_response_mean_and_keeps_it_when_saved(tmp_path, tiny_folder):
    causal = loading.load_causal_lm(tiny_folder)
    rm = loading.reward_model_from_causal(tiny_folder, seed=0, num_layers=1, pooling="mean")
    assert len(rm.model.layers) == 1 and rm.config.num_hidden_layers == 1 < causal.config.num_hidden_layers
    for name, tensor in rm.model.layers[0].state_dict().items():
        torch.testing.assert_close(tensor, causal.model.layers[0].state_dict()[name], rtol=0, atol=0)
    ids = torch.tensor([[0, 4, 5, 6, 7, 0], [4, 5, 6, 7, 8, 9]])  # prompt: 3 columns; row 0's response is 2 tokens
    mask = (ids != 0).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    last = torch.tensor([1, 2])
    values = scalar_head(rm, ids, mask, positions)
    expected = torch.stack([values[0, 3:5].mean(), values[1, 3:6].mean()])
    torch.testing.assert_close(sequence_scores(rm, ids, mask, positions, 3, last), expected)
    loading.save_pretrained(rm, loading.load_tokenizer(tiny_folder), tmp_path / "rm")
    again = loading.load_reward_model(tmp_path / "rm")
    assert again.config.reward_pooling == "mean" and len(again.model.layers) == 1
    torch.testing.assert_close(sequence_scores(again, ids, mask, positions, 3, last), expected)
    last_token = loading.reward_model_from_causal(tiny_folder, seed=0)  # the default reads the last response token
    values = scalar_head(last_token, ids, mask, positions)
    torch.testing.assert_close(
        sequence_scores(last_token, ids, mask, positions, 3, last), torch.stack([values[0, 4], values[1, 5]])
    )


# --- packaged SmolLM2 ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_is_converted_once_into_the_cache_and_loads_as_converted(tmp_path, monkeypatch):
    """load_smollm2 reads the GGUF once (~1 min here), keeps the float32 checkpoint in the project's cache and loads
    that afterwards: the very logits and token ids of the conversion, and no second conversion."""
    conversions, convert_smollm2 = [], loading.convert_smollm2

    def convert():
        conversions.append(convert_smollm2())
        return conversions[-1]

    monkeypatch.setattr(loading, "CACHE", tmp_path / "cache")  # a cold cache: this test converts
    monkeypatch.setattr(loading, "convert_smollm2", convert)
    tokenizer_from_gguf = loading.load_smollm2_tokenizer()  # no checkpoint yet: read from the GGUF
    model, tok = loading.load_smollm2()
    assert len(conversions) == 1 and loading.smollm2_folder().parent == tmp_path / "cache" / "smollm2"
    assert not list((tmp_path / "cache" / "smollm2").glob(".*"))  # no temporary folder left
    converted, converted_tok = conversions[0]
    assert model.config.model_type == "llama" and tok.padding_side == "left" and tok.pad_token == "<|im_end|>"
    assert 134e6 < tiny.count_parameters(model) < 135e6  # 134.5M per platform.md
    enc = tok(["The movie was"], return_tensors="pt")
    torch.testing.assert_close(model(**enc).logits, converted(**enc).logits, rtol=0, atol=0)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    chat = [{"role": "user", "content": "What is 3 + 4?"}]
    for other in (converted_tok, tokenizer_from_gguf, loading.load_smollm2_tokenizer()):
        assert other("The movie was")["input_ids"] == enc["input_ids"][0].tolist()
        assert other.apply_chat_template(chat, add_generation_prompt=True) == tok.apply_chat_template(
            chat, add_generation_prompt=True
        )
    loading.load_smollm2()
    assert len(conversions) == 1  # loaded from the cache
    weights = loading.smollm2_folder() / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # damaged since (a full disk, a copy cut short)
    with pytest.raises(ValueError, match=r"model.safetensors.* delete .*smollm2/SmolLM2.* to convert it again"):
        loading.load_smollm2()
