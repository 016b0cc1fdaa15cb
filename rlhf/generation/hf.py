"""Synchronous generation with HF `generate` on the training model itself (shared weights, no copy).

Besides the tokens it returns each sampled token's log-prob under softmax(logits / T), the distribution it
sampled from (as the vLLM engines do), so objectives that only report behaviour log-probs (DPO, best-of-k)
skip a second forward over the batch.

It samples by the Gumbel-max trick, not `generate`'s do_sample: argmax(log softmax(logits / T) + Gumbel noise) is
a draw from softmax(logits / T), and the noise comes from uniform draws. `generate` samples with torch.multinomial,
whose noise comes from Tensor.exponential_: on a CPU that was 5x slower than the uniform draws (2M values: 30.5 ms
against 5.9 ms, 2-core AMD EPYC) and half of all HF generate time at the `tiny` profile's vocabulary of 4,096.

Two ways to hold the KV cache (`decode`): dynamic, transformers' default, a cache that grows by concatenation each
step (the CPU's path); static, one preallocated cache per batch shape, kept across calls, whose decode step
transformers compiles on a GPU (torch.compile, CUDA graphs: a step replays as one graph instead of hundreds of kernel
launches). What each reproduces on a GPU: docs/gpu.md, "The HF engine on a GPU".
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch
from transformers import CompileConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache

from rlhf.generation.base import Generated, SamplingParams
from rlhf.generation.weights import _zero3, gathered_parameters
from rlhf.models import lora
from rlhf.models.batch import pad_left, pad_right, to_device


class _GumbelMaxSampler(LogitsProcessor):
    """Turns `generate`'s greedy decoding into sampling at temperature T, and records the log-prob of each sampled
    token under softmax(logits / T), one step behind: at step s it sees the token sampled at step s-1 (the last
    column of input_ids), so only one (N, V) matrix is held at a time.

    `generate` is run greedy (do_sample=False, so it adds no temperature or top-k/top-p warpers of its own) with
    this as its only processor: the scores it sees are the raw logits, and the argmax of what it returns,
    log softmax(logits / T) + Gumbel(0, 1) noise, is a sample from softmax(logits / T). The noise is drawn from the
    global torch RNG (of the logits' device), which a checkpoint restores.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.columns.append(self.previous.gather(1, input_ids[:, -1:]))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return self.previous + gumbel_noise(self.previous)

    def result(self, responses: torch.Tensor) -> torch.Tensor:
        """(N, S) log-probs of the S sampled tokens (rows padded after EOS get meaningless values: mask them)."""
        if self.previous is None:
            return torch.zeros(responses.shape[0], 0)
        last = self.previous.gather(1, responses[:, -1:].to(self.previous.device))
        return torch.cat([*self.columns, last], dim=1).cpu()


Decode = Literal["auto", "dynamic", "static"]
# Static caches are sized up to a multiple of this: batches whose longest prompt differs by a few tokens share one
# cache (and one compiled graph), and the size depends on the call alone, never on the calls before it.
CACHE_BUCKET = 64


def default_decode(device: torch.device, model: torch.nn.Module) -> Literal["dynamic", "static"]:
    """RLHF_HF_DECODE (dynamic or static) where it is set: one choice for every engine of a process, e.g. for stages
    that sample too little to repay a compile, or a GPU where compiling fails. Else static on CUDA, dynamic elsewhere
    (the CPU's results stay those of transformers' default cache, bit for bit) and for ZeRO-3 shards, which are
    gathered into new memory at every call: CUDA graphs, which replay fixed addresses, would record again at each."""
    if forced := os.environ.get("RLHF_HF_DECODE"):
        if forced not in ("dynamic", "static"):
            raise ValueError(f"RLHF_HF_DECODE={forced!r}: dynamic or static")
        return forced
    return "static" if device.type == "cuda" and not _zero3(model.parameters()) else "dynamic"


def _owner(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if lora.is_lora(model) else model  # PEFT forwards generate to its base model


@contextlib.contextmanager
def _only_generation_config(model: torch.nn.Module, config: GenerationConfig) -> Iterator[None]:
    """`config` as the generating model's own generation config inside the block. `generate` fills every field a
    config leaves unset from the model's: a checkpoint's repetition_penalty or no_repeat_ngram_size would reshape
    the distribution, and the log-probs returned would no longer be those the tokens were sampled from."""
    owner = _owner(model)
    saved, owner.generation_config = owner.generation_config, config
    try:
        yield
    finally:
        owner.generation_config = saved


def gumbel_noise(like: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise of like's shape, dtype and device: -log(-log U), U uniform on [0, 1). U = 0 gives -inf (that
    token loses; probability 2^-24 a value in float32)."""
    return torch.rand_like(like).log_().neg_().log_().neg_()


class _StaticCache(StaticCache):
    """transformers' static cache, holding keys and values in one dtype, `dtype` (None: as they come). Under autocast
    with float32 weights a rotary model's keys leave the rotation in float32 and its values leave their projection in
    bf16, which transformers' static cache, allocated in the dtype of the first keys it sees, cannot hold. The dynamic
    cache keeps each as it came, and attention casts both to the autocast dtype before using them (SDPA and matmul
    are autocast ops): stored in that dtype, they give attention the same numbers."""

    def __init__(self, config, max_cache_len: int, dtype: torch.dtype | None):
        super().__init__(config=config, max_cache_len=max_cache_len)
        self.states_dtype = dtype

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.states_dtype is not None:
            key_states, value_states = key_states.to(self.states_dtype), value_states.to(self.states_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class HFEngine:
    lookahead = 0

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_id: int,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        decode: Decode = "auto",
        compile_config: CompileConfig | None = None,
    ):
        """autocast: the training precision's context (the learner's `Accelerator.autocast`): the engine samples with
        the bare policy, whose forward accelerate wrapped only where the policy is the prepared model itself (not
        inside PPO's policy-and-value wrapper), so it enters it itself.
        decode: the KV cache, dynamic or static (the module's docstring); auto = `default_decode`.
        compile_config: how transformers compiles the static path's decode step, which it does on a GPU only; default
        its own (mode reduce-overhead: CUDA graphs) with dynamic=False, so each batch shape gets a graph of its own and
        a call's numbers depend on its shape alone, not on which shapes this process compiled before (a resumed run
        then samples what an uninterrupted one did). Unused by the dynamic path."""
        self.model = model
        self.device = device  # the model's: prompts go there, responses come back to the CPU like any engine's
        self.autocast = autocast
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.version = 0
        self._queue: deque = deque()
        self.decode = default_decode(device, model) if decode == "auto" else decode
        self.compile_config = compile_config or CompileConfig(dynamic=False)
        self._cache: _StaticCache | None = None
        self._cache_shape: tuple | None = None  # (rows, length, dtype) of _cache

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        self._queue.append((prompts, params))

    @torch.no_grad()
    def receive(self) -> Generated:
        prompts, p = self._queue.popleft()
        start = time.perf_counter()
        # k rows a prompt, prompt-major (greedy `generate` takes no num_return_sequences)
        ids, mask = (to_device(t.repeat_interleave(p.k, 0), self.device) for t in pad_left(prompts, self.pad_token_id))
        was_training = self.model.training
        self.model.eval()
        sampler, config = _GumbelMaxSampler(p.temperature), self._greedy(p)
        with gathered_parameters(self.model), _only_generation_config(self.model, config), self.autocast():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                logits_processor=LogitsProcessorList([sampler]),
                generation_config=config,
                **self._cache_kwargs(ids.shape[0], ids.shape[1] + p.max_new_tokens),  # made here: under autocast
            )
        self.model.train(was_training)
        responses = out[:, ids.shape[1] :]
        logprobs = torch.zeros(responses.shape[0], p.max_new_tokens)
        logprobs[:, : responses.shape[1]] = sampler.result(responses)
        return Generated(
            pad_right(responses.tolist(), p.max_new_tokens, self.pad_token_id),
            self.version,
            time.perf_counter() - start,
            logprobs,
            prompts=prompts,
            sampled_here=True,
        )

    def _greedy(self, p: SamplingParams) -> GenerationConfig:
        static = {"compile_config": self.compile_config} if self.decode == "static" else {}
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=p.max_new_tokens,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            **static,
        )

    def _cache_kwargs(self, rows: int, length: int) -> dict:
        """generate's cache argument: none on the dynamic path (transformers makes its own); on the static path the
        cache for `rows` sequences of up to `length` tokens, emptied. Kept across calls: a new one each call
        (transformers' own `cache_implementation="static"`) has new addresses, for which CUDA graphs record again at
        every call (and stop replaying after a limit). Replaced when the batch's shape changes (the old one freed
        first); its memory, 2 x layers x rows x length x hidden x 2 bytes in bf16, stays held between calls."""
        if self.decode == "dynamic":
            return {}
        dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        shape = (rows, -(-length // CACHE_BUCKET) * CACHE_BUCKET, dtype)
        if self._cache is not None and self._cache_shape == shape:
            self._cache.reset()
        else:
            self._cache = None
            config = _owner(self.model).config.get_text_config(decoder=True)
            self._cache, self._cache_shape = _StaticCache(config, shape[1], dtype), shape
        return {"past_key_values": self._cache}

    def seek(self, batch: int) -> None:
        pass  # samples come from the global torch RNG, which a checkpoint restores

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        # The engine samples from the training model itself: nothing to copy.
        self.version = version

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        return {}  # synchronous: nothing is sampled ahead

    def load_snapshot(self, folder: Path, version: int) -> None:
        raise RuntimeError("HFEngine samples from the training model: it has no snapshots to load")

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._queue.clear()
        self._cache = self._cache_shape = None
