"""HF generate as an engine (rlhf.generation.hf): it samples from softmax(logits / T) by the Gumbel-max trick on top
of greedy `generate`, and returns the log-prob of each token it sampled, as the trainer's forward computes it."""

from __future__ import annotations

import pytest
import torch
from vllm_engine_cases import CPU, TEXTS, build_policy, hf_logprobs, prompt_ids

from rlhf.generation.base import SamplingParams
from rlhf.generation.hf import HFEngine, _GumbelMaxSampler
from rlhf.models import loading


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_policy(tmp_path_factory.mktemp("hf") / "policy")


def _within_five_standard_errors(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = counts.sum()
    freq = counts / n
    se = (probs * (1 - probs) / n).sqrt().clamp(min=1e-3)
    worst = ((freq - probs).abs() / se).max()
    assert worst < 5, f"frequencies {freq.tolist()} vs probabilities {probs.tolist()}: {worst:.1f} standard errors"


def test_the_sampler_draws_from_softmax_of_the_logits_over_the_temperature():
    """200,000 draws from fixed logits at T = 0.5: each token's frequency within 5 standard errors of
    softmax(logits / T). Without the noise it would always pick token 2; with T applied twice (or not at all) the
    frequencies land hundreds of standard errors away."""
    torch.manual_seed(0)
    logits, temperature, n = torch.tensor([[0.0, 1.0, 2.0, 0.5, -1.0]]), 0.5, 200_000
    sampler = _GumbelMaxSampler(temperature)
    chosen = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1)).argmax(-1)
    _within_five_standard_errors(
        torch.bincount(chosen, minlength=5).float(), torch.softmax(logits[0] / temperature, -1)
    )
    torch.testing.assert_close(sampler.previous[0], torch.log_softmax(logits[0] / temperature, -1))


def test_hf_engine_samples_the_models_next_token_distribution(policy):
    """Through `generate` itself: 4,000 one-token samples of one prompt (k rows a prompt) follow the model's
    softmax(logits / T) at the prompt's last position."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    [prompt], k, temperature = prompt_ids(tok, TEXTS[:1]), 4000, 1.5
    torch.manual_seed(0)
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    engine.submit([prompt], SamplingParams(k=k, max_new_tokens=1, temperature=temperature))
    first = engine.receive().responses[:, 0]
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float() / temperature, -1)
    _within_five_standard_errors(torch.bincount(first, minlength=len(probs)).float(), probs)


def test_hf_engine_returns_the_log_probs_it_sampled_with(policy):
    """HFEngine records log softmax(logits / T) of each sampled token: what the trainer's forward computes. Rows are
    prompt-major (row i answers prompt i // k): prompts of different lengths, so left padding and order both count."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    prompts, k, temperature = prompt_ids(tok, TEXTS[:3]), 2, 0.8
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    engine.submit(prompts, SamplingParams(k=k, max_new_tokens=8, temperature=temperature))
    gen = engine.receive()
    expected = hf_logprobs(model, prompts, gen.responses, k, temperature, tok.eos_token_id)
    real = expected != 0
    assert real.sum() > 10 and (gen.logprobs[real] < 0).all()
    torch.testing.assert_close(gen.logprobs[real], expected[real], rtol=0, atol=1e-4)


def test_a_checkpoints_own_sampling_defaults_do_not_reach_the_sampler(policy, tmp_path):
    """A saved generation_config with do_sample, temperature, top-k and a repetition penalty (as hub checkpoints
    ship) changes nothing: the engine samples at the temperature it is asked for, from the full distribution."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    prompts, params = prompt_ids(tok, TEXTS[:2]), SamplingParams(k=2, max_new_tokens=6, temperature=0.9)
    torch.manual_seed(1)
    plain = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    plain.submit(prompts, params)
    expected = plain.receive()
    model.generation_config.update(do_sample=True, temperature=0.1, top_k=2, repetition_penalty=2.0)
    torch.manual_seed(1)
    tuned = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    tuned.submit(prompts, params)
    got = tuned.receive()
    assert torch.equal(got.responses, expected.responses)
    torch.testing.assert_close(got.logprobs, expected.logprobs)
