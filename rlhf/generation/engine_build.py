"""Building an engine where it runs in a process of its own (the engine process, or a Ray actor): its `Scorer`
(the reward function and the reference log-probs, computed there as the learner computes them), loaded first, and
the VLLMEngine at the share of its GPU the scorer leaves (`engine_memory_share`). `build` is the one entry point;
rlhf.generation.engine_process and rlhf.generation.ray_engines call it once the engine's spec arrives."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import numpy as np
import torch

from rlhf.generation.base import EngineSpec
from rlhf.generation.vllm import VLLMEngine

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


def build(spec: EngineSpec, device: str) -> tuple[VLLMEngine, Scorer | None]:
    """The engine `spec` describes, on `device` as this process numbers it, and its scorer when it scores. The
    scorer loads first, and on a GPU its bytes come out of vLLM's share (engine_memory_share)."""
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
