"""What the vLLM engine tests share (tests/test_vllm_engines.py, the colocated engine; tests/test_async_engines.py,
the engine in its own process and as Ray actors): a tiny Llama policy and the learner's side of a comparison."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.config import ModelConfig
from rlhf.generation.base import SamplingParams
from rlhf.models import loading, tiny

TEXTS = [
    "the movie was great and i loved it .",
    "a bad film , boring plot and awful acting !",
    "i didn't like it but it's fine .",
    "great acting , great story , a fine movie .",
]
# head_dim 64 / 2 = 32: one that vLLM's CPU attention supports (16 fails at engine start).
SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=64)
MAX_MODEL_LEN = 64
SEED = 3
CPU = torch.device("cpu")  # where the tests' HF models live


def build_policy(folder: Path):
    """The tiny policy saved to `folder`: (folder, its tokenizer)."""
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, folder)
    return folder, loading.load_tokenizer(folder)


def prompt_ids(tok, texts: list[str]) -> list[list[int]]:
    return tok(texts, add_special_tokens=True)["input_ids"]


def response_length(row: list[int], eos: int) -> int:
    """Tokens up to and including the first EOS, else all: a sample ends only at EOS or at max_new_tokens.

    (Not `row != pad`: an untrained model may sample the pad token itself.)"""
    return row.index(eos) + 1 if eos in row else len(row)


def hf_logprobs(
    model, prompts: list[list[int]], responses: torch.Tensor, k: int, temperature: float, eos: int
) -> torch.Tensor:
    """log_softmax(logits / T) of each response token under `model` (0 on padding); row i uses prompt i // k."""
    out = torch.zeros(responses.shape)
    with torch.no_grad():
        for i, row in enumerate(responses):
            n = response_length(row.tolist(), eos)
            seq = torch.tensor([prompts[i // k] + row[:n].tolist()])
            logits = model(input_ids=seq).logits[0, len(prompts[i // k]) - 1 : -1] / temperature
            out[i, :n] = torch.log_softmax(logits.float(), -1).gather(-1, row[:n, None]).squeeze(-1)
    return out


def tied_embeddings_alone_reach(engine, policy) -> None:
    """Only the input embeddings change, and a tied model's output head is the same tensor: an engine that kept
    its own stale head, or skipped the one name that carries it, would sample from the old head. The training tests
    change every weight at once and could not tell."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    prompts, params = prompt_ids(tok, ["the movie was", "a bad"]), SamplingParams(k=2, max_new_tokens=6, temperature=1)

    def gap(version: int) -> float:
        """max |engine - learner| log-prob of a batch the engine samples now (with weights `version`)."""
        engine.submit(prompts, params)
        gen = engine.receive()
        assert gen.version == version
        learner = hf_logprobs(model, prompts, gen.responses, params.k, params.temperature, tok.eos_token_id)
        return (gen.logprobs - learner).abs().max().item()

    engine.load_weights(model, 20)  # a known start whatever ran before: the folder's weights
    assert gap(20) <= 2e-4
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(0.5 * torch.randn(model.lm_head.weight.shape))
    assert gap(20) > 1e-2  # not synced yet: the engine's head is the old one
    engine.load_weights(model, 21)
    assert gap(21) <= 2e-4
