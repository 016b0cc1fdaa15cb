"""HF generate as an engine (rlhf.generation.hf): it samples from softmax(logits / T) by the Gumbel-max trick on top
of greedy `generate`, and returns the log-prob of each token it sampled, as the trainer's forward computes it."""

from __future__ import annotations

import contextlib

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


def _sample(engine: HFEngine, prompts, params: SamplingParams, seed: int):
    torch.manual_seed(seed)
    engine.submit(prompts, params)
    return engine.receive()


def test_the_engine_decodes_with_a_static_cache_on_cuda_and_a_dynamic_one_elsewhere(policy, monkeypatch):
    """The CPU keeps transformers' default cache (the recorded CPU results are its numbers); nothing runs on CUDA
    here, the choice is made from the device alone. RLHF_HF_DECODE overrides it for a whole process."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    monkeypatch.delenv("RLHF_HF_DECODE", raising=False)
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    _sample(engine, prompt_ids(tok, TEXTS[:2]), SamplingParams(k=2, max_new_tokens=4, temperature=1.0), 0)
    assert engine.decode == "dynamic" and engine._cache is None
    assert HFEngine(model, tok.pad_token_id, tok.eos_token_id, torch.device("cuda")).decode == "static"
    monkeypatch.setenv("RLHF_HF_DECODE", "dynamic")
    assert HFEngine(model, tok.pad_token_id, tok.eos_token_id, torch.device("cuda")).decode == "dynamic"
    monkeypatch.setenv("RLHF_HF_DECODE", "graphs")
    with pytest.raises(ValueError, match="RLHF_HF_DECODE='graphs': dynamic or static"):
        HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_the_static_cache_samples_what_the_dynamic_one_does(policy, autocast):
    """One seed, prompts of three lengths, k = 2: the same tokens, and the same log-probs but for the last bits of the
    precision attention computes in. Bitwise equality does not hold: the static cache attends over its whole length
    (a multiple of 64, the unused end masked), so attention sums over other lengths in another order: float32 apart by
    ~5e-7; under bf16 autocast, where an attention output that rounds the other way moves by a bf16 step (2^-8
    relative), by ~2e-3. There (float32 weights, the learner's sampling), the rotary keys come out in float32 and the
    values in bf16: the static cache holds both in bf16, as attention reads them. The cache is kept between calls:
    other prompts of the same shape are sampled as the dynamic cache samples them (a cache not emptied in between
    would pass for their prefix), and the first prompts again, after a call of another shape, bit for bit."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    dynamic = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU, context)
    static = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU, context, decode="static")
    params = SamplingParams(k=2, max_new_tokens=8, temperature=0.8)
    first = None
    for prompts in (prompt_ids(tok, TEXTS[:3]), prompt_ids(tok, TEXTS[1:])):
        expected, got = _sample(dynamic, prompts, params, 7), _sample(static, prompts, params, 7)
        assert torch.equal(got.responses, expected.responses)
        torch.testing.assert_close(got.logprobs, expected.logprobs, rtol=0, atol=2e-2 if autocast else 1e-5)
        first = first or (prompts, got)
    assert static._cache_shape == (6, 64, torch.bfloat16 if autocast else None)  # one cache for both
    _sample(static, first[0][:1], SamplingParams(k=1, max_new_tokens=3, temperature=0.8), 8)  # another shape
    again = _sample(static, first[0], params, 7)
    assert torch.equal(again.responses, first[1].responses) and torch.equal(again.logprobs, first[1].logprobs)


def test_the_compiled_static_decode_compiles_once_and_keeps_its_numbers(policy):
    """The static path's decode step through torch.compile, as on a GPU, with dynamo's `eager` backend (tracing only:
    inductor takes ~20 s to build a CPU graph here): two calls of one shape compile one graph, the second reuses it
    (a new cache each call would still compile once, but CUDA graphs would record again at every call), and the
    compiled step samples what the uncompiled one does, bit for bit (the eager backend runs the same ops)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    folder, tok = policy
    model = loading.load_causal_lm(folder)
    config = CompileConfig(backend="eager", dynamic=False)
    config._compile_all_devices = True  # transformers' own flag: compile off a GPU too
    prompts, params = prompt_ids(tok, TEXTS[:3]), SamplingParams(k=2, max_new_tokens=8, temperature=0.8)
    plain = _sample(HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU, decode="static"), prompts, params, 3)
    torch._dynamo.reset()
    counters.clear()
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU, decode="static", compile_config=config)
    first, second = (_sample(engine, prompts, params, 3) for _ in range(2))
    assert counters["stats"]["unique_graphs"] == 1 and counters["stats"]["calls_captured"] > 0
    for got in (first, second):
        assert torch.equal(got.responses, plain.responses) and torch.equal(got.logprobs, plain.logprobs)
