"""The async engine's own process: a VLLMEngine that handles the trainer's messages in order until stopped
(the protocol is described in rlhf.generation.async_engine, the trainer's side)."""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from rlhf.generation.base import EngineSpec
from rlhf.generation.vllm import VLLMEngine, import_engine_code
from rlhf.runtime import visible_gpus

POLL_SECONDS = 0.5  # how often a waiting side checks that the other one is still alive
PR_SET_PDEATHSIG = 1  # linux/prctl.h


MIN_KV_CACHE_BYTES = 2**30  # the least KV cache an engine is started with: below it, it samples a few rows at a time


def engine_memory_share(gpu_bytes: int, share: float, held_bytes: int, weight_bytes: int) -> float:
    """vLLM's gpu_memory_utilization for an engine given `share` of a GPU of `gpu_bytes`, whose process already holds
    `held_bytes` there (its scorer: the reward model and the reference, loaded first) and whose policy's weights
    take `weight_bytes` in the engine's precision. vLLM counts its share from the whole GPU and, at start, wants that
    much free: what the process holds must come out of the share, or the start fails or eats another's memory.
    Raises ValueError naming the setting when what is left cannot hold the weights and a minimal KV cache."""
    left = share * gpu_bytes - held_bytes
    if left < weight_bytes + MIN_KV_CACHE_BYTES:
        gib = 2**30
        raise ValueError(
            f"train.engine_gpu_memory_utilization: {share:g} of the engine's {gpu_bytes / gib:.1f} GiB GPU, less the "
            f"{held_bytes / gib:.1f} GiB its scorer holds, leaves {left / gib:.1f} GiB: not enough for the policy's "
            f"{weight_bytes / gib:.1f} GiB of weights and a {MIN_KV_CACHE_BYTES / gib:.0f} GiB KV cache (raise the "
            "share, or score on the learner: train.score_in_engine=never)"
        )
    return left / gpu_bytes


def engine_process_main(device: str, inbox, results, stop) -> None:
    """Entry point of the engine process: import vLLM and the scorer's code, wait for ("build", EngineSpec), build
    the VLLMEngine (and the scorer), then serve until stopped. The imports (~7 s of the ~11 s start-up on these
    CPUs) run before the spec exists: the trainer starts this process first and sends the spec once it knows it.

    device: "cpu" or "cuda:<i>" (spec.device): needed before CUDA starts, so it comes at spawn, not with the spec.
    Errors are sent back as ("error", traceback) before the process exits with code 1.
    """
    _die_with_parent()
    device = see_only(device)
    outbox = _Sender(results)
    try:
        import_ahead(device)
        spec = _next_work(inbox, stop)
        if spec is None:
            return
        if spec[0] != "build":
            raise ValueError(f"expected the engine's spec first, got {spec[0]!r}")
        spec = spec[1]
        engine, scorer = build(spec, device)
        outbox.send(("ready", engine.start_seconds))
        _serve(engine, scorer, inbox, outbox, stop)
    except BaseException:
        outbox.send(("error", traceback.format_exc()))
        outbox.flush(timeout=10)
        # Exit at once, with the code the trainer reports: vLLM lives in this process only, so there is
        # nothing to shut down, and a normal interpreter exit (vLLM/torch teardown) can take seconds.
        os._exit(1)
    outbox.flush(timeout=10)
    # Stopped: nothing of this process outlives it, and vLLM's and torch's teardown at a normal exit took ~2 s
    # of the train stage's wall clock.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def see_only(device: str) -> str:
    """Set this (new) process up for its engine on `device`, as the trainer numbers it; returns the device as this
    process numbers it. On the CPU: a core of its own (the trainer keeps the others) and one torch thread. On a GPU:
    before CUDA starts, only that GPU is visible (mapped through the trainer's CUDA_VISIBLE_DEVICES, which this
    process inherited), and no core pinning: vLLM's scheduler and the sampling loop then run wherever a core is free."""
    if not device.startswith("cuda"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            os.sched_setaffinity(0, {cores[-1]})
        torch.set_num_threads(1)
        return device
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus([int(device.partition(":")[2] or 0)])
    return "cuda:0"


def build(spec: EngineSpec, device: str) -> tuple[VLLMEngine, Scorer | None]:
    """The engine `spec` describes, on `device` as this process numbers it, and its scorer when it scores. The
    scorer loads first, and on a GPU its bytes come out of vLLM's share (factory.engine_memory_share)."""
    scorer = Scorer(spec, torch.device(device)) if spec.reward is not None else None
    memory = spec.where.gpu_memory_utilization
    if memory is not None and device.startswith("cuda"):
        total = torch.cuda.get_device_properties(device).total_memory
        weights = folder_parameters(Path(spec.model_folder)) * getattr(torch, spec.dtype).itemsize
        memory = engine_memory_share(total, memory, scorer.nbytes if scorer is not None else 0, weights)
    engine = VLLMEngine(
        Path(spec.model_folder),
        spec.eos_token_id,
        spec.pad_token_id,
        spec.seed,
        spec.max_model_len,
        spec.dtype,
        memory,
        device,
    )
    return engine, scorer


def folder_parameters(folder: Path) -> int:
    """How many parameters the safetensors files of a model folder hold, read from their headers."""
    from safetensors import safe_open

    count = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count


def import_ahead(device: str = "cpu") -> None:
    """What building the engine and the scorer imports, imported while the spec is not known yet."""
    import_engine_code(device)  # vLLM's engine: ~6 s on these CPUs, 6 min on the slow box

    import rlhf.models.forward  # noqa: F401
    import rlhf.models.loading  # noqa: F401


def _serve(engine: VLLMEngine, scorer, inbox, outbox, stop) -> None:
    """Handle ("weights", SharedWeights, version) and ("generate", batch, prompts, params, score, parts) in order;
    each result carries the seconds the engine was idle and reloading since the previous one."""
    idle = reload = 0.0
    while True:
        waited = time.perf_counter()
        msg = _next_work(inbox, stop)
        idle += time.perf_counter() - waited
        if msg is None:
            return
        if msg[0] == "weights":
            _, weights, version = msg
            reload += engine.reload(weights, version)
            del msg, weights  # vLLM holds its own copy now: the trainer may reuse the shared buffers
            outbox.send(("ack", version))
        elif msg[0] == "generate":
            outbox.send(("result", msg[1], *sample_and_score(engine, scorer, msg[1:]), idle, reload))
            idle = reload = 0.0
        else:
            raise ValueError(f"unknown message {msg[0]!r}")


def sample_and_score(engine: VLLMEngine, scorer, work: tuple, first: int = 0) -> tuple:
    """One batch: work = (batch, prompts, params, score, parts) -> (responses, logprobs, scores, reference log-probs,
    prompts as sampled, weight version, generation seconds, scoring seconds), arrays as numpy (the wire format).
    `first`: the index of prompts[0] in the run's batch, when this engine samples a slice of it (Ray engines)."""
    batch, prompts, params, score, parts = work
    gen = engine.generate(prompts, params, batch, first)
    scored = time.perf_counter()
    scores, refs = scorer(prompts, gen.responses, params, parts) if scorer is not None and score else (None, None)
    scoring = time.perf_counter() - scored
    return gen.responses.numpy(), gen.logprobs.numpy(), scores, refs, gen.prompts, gen.version, gen.seconds, scoring


class Scorer:
    """The run's reward function, and the reference log-probs when asked, inside the engine process: fed exactly
    what the learner would feed them and computed by the same functions, so the numbers are the learner's."""

    def __init__(self, spec: EngineSpec, device: torch.device):
        """device: the engine's, where the reward model (and the reference) run beside vLLM."""
        from rlhf.models.loading import load_causal_lm, load_tokenizer

        # In the training precision, as the learner places its frozen models (rlhf.trainers.setup._place_frozen)
        dtype = torch.bfloat16 if spec.reference is not None and spec.reference.autocast_bf16 else None
        self.reward_fn = spec.reward.build().placed(lambda m: m.to(device, dtype=dtype), device)
        self.tokenizer = load_tokenizer(Path(spec.model_folder)) if self.reward_fn.needs_texts else None
        self.pad, self.eos, self.device = spec.pad_token_id, spec.eos_token_id, device
        self.reference = spec.reference
        models = [getattr(self.reward_fn, "model", None)]
        if spec.reference is not None:
            self.ref_model = load_causal_lm(Path(spec.model_folder)).requires_grad_(False).to(device, dtype=dtype)
            models.append(self.ref_model.eval())
        self.nbytes = sum(t.nbytes for m in models if m is not None for t in (*m.parameters(), *m.buffers()))

    def __call__(self, prompts: list[list[int]], responses: torch.Tensor, params, parts: list[int]):
        """(scores (N,), reference log-probs (N, T) or None) of a sampled batch, as numpy arrays to send. The
        batch is scored part by part (one per training rank), each assembled as its rank would assemble it: the
        same padding, so the same floats as when the learner scores it (train.score_in_engine: auto)."""
        starts = np.cumsum([0, *parts])
        rows = [responses[s * params.k : e * params.k] for s, e in zip(starts[:-1], starts[1:])]
        results = [self._score_part(prompts[s:e], r, params) for s, e, r in zip(starts[:-1], starts[1:], rows)]
        scores = np.concatenate([s for s, _ in results])
        return scores, None if self.reference is None else np.concatenate([r for _, r in results])

    def _score_part(self, prompts: list[list[int]], responses: torch.Tensor, params) -> tuple[np.ndarray, np.ndarray]:
        from rlhf.models.batch import assemble
        from rlhf.models.forward import reference_logprobs

        batch = assemble(prompts, responses, params.k, self.pad, self.eos).to(self.device)
        scores = self.reward_fn(batch, batch.texts(self.tokenizer) if self.tokenizer is not None else [])
        if self.reference is None:
            return scores.cpu().numpy(), None
        bf16 = self.reference.autocast_bf16
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            refs = reference_logprobs(self.ref_model, batch, self.reference.temperature)
        return scores.cpu().numpy(), refs.cpu().numpy()  # the wire format: numpy arrays in host memory


def _next_work(inbox, stop):
    """The next message, or None when asked to stop or when the trainer is gone."""
    while not stop.is_set():
        if not _trainer_alive():
            return None
        try:
            msg = inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        return None if msg[0] == "stop" or stop.is_set() else msg
    return None


def _trainer_alive() -> bool:
    """The trainer (the process that started this one) still runs: its end of multiprocessing's start-up pipe is
    open. Unlike a parent-pid check, this holds when a launcher sits between the two (the suite's tests/warm.py)."""
    return mp.parent_process().is_alive()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the trainer dies, so no engine outlives a killed run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the check in _next_work still ends it
    if not _trainer_alive():
        os._exit(1)


class _Sender:
    """Sends messages to the trainer from a thread, through a bounded buffer, in order."""

    def __init__(self, conn, capacity: int = 64):
        self.conn = conn
        self.buffer: queue.Queue = queue.Queue(maxsize=capacity)
        self.thread = threading.Thread(target=self._run, name="rlhf-vllm-sender", daemon=True)
        self.thread.start()

    def send(self, msg: tuple) -> None:
        self.buffer.put(msg)

    def flush(self, timeout: float) -> None:
        self.buffer.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (msg := self.buffer.get()) is not None:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError):
                return  # the trainer is gone
