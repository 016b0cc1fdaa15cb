"""The engine seam between the online loop and whoever samples completions.

The loop submits prompt batches and receives generated batches in order. `lookahead` is how many batches an
engine generates ahead of training: 0 = synchronous (every batch sampled with the current weights), N = async
(batch t may come from weights up to N updates old). Every batch carries the weight version that sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from rlhf.presets import ENGINES


@dataclass
class SamplingParams:
    k: int  # samples per prompt, adjacent in the output (prompt-major)
    max_new_tokens: int
    temperature: float


@dataclass(frozen=True)
class ReferenceSpec:
    """The reference policy in the engine process: the SFT model in the engine's model folder (version 0, which
    every trainer's reference is), computing as the learner's reference does."""

    temperature: float  # train.temperature: log-probs under softmax(logits / T)
    autocast_bf16: bool = False  # the learner trains under bf16 autocast: its reference computes under it too


@dataclass(frozen=True)
class Placement:
    """Where a vLLM engine runs (rlhf.generation.factory.placement). device: "cpu" or "cuda:<i>"; own_process: in a
    process of its own (vllm_async, or colocated beside several training processes, or on another device than
    training); gpu_memory_utilization: vLLM's share of the GPU (None on CPU); ray_gpus: Ray engines on GPUs, the GPUs
    of this node a local Ray cluster may give them (those after the training ranks'; rank 0's when there is none
    other); shares_gpu: on a GPU a training process uses too, so it is built after the learner placed its models
    (vLLM sizes its KV cache from the memory it finds free at start: built earlier, its budget would depend on how
    far the learner had got)."""

    device: str
    own_process: bool
    gpu_memory_utilization: float | None
    ray_gpus: tuple[int, ...] | None = None
    shares_gpu: bool = False


@dataclass(frozen=True)
class EngineSpec:
    """Everything that builds a vLLM engine (rlhf.generation.factory.make_engine), decided once. Picklable: an engine
    in its own process (or a Ray actor) receives it as it is and builds from it."""

    name: str  # train.engine: "vllm" (colocated, lookahead 0) or "vllm_async" (samples max_staleness batches ahead)
    model_folder: str  # the HF safetensors folder vLLM starts from: weight version 0
    eos_token_id: int
    pad_token_id: int
    seed: int
    max_model_len: int
    where: Placement = Placement("cpu", False, None)
    work_dir: Path | None = None  # an engine in its own process: checkpoints' copies of the weights in flight go here
    max_staleness: int = 1
    dtype: str = "float32"  # "auto": bf16 on a GPU, float32 on the CPU (factory.make_engine resolves it)
    reward: object = None  # a rlhf.rewards.proxy.RewardSpec: score batches in the engine's own process
    reference: ReferenceSpec | None = None  # and compute their reference log-probs there too
    score: str = "never"  # train.score_in_engine where it applies: never, auto or always
    backend: str = "process"  # an engine in its own process: "process", or Ray actors ("ray")
    num_engines: int = 1  # Ray actors sampling slices of each batch
    resource: str | None = None  # train.engine_resource: the custom Ray resource each actor also asks for
    # train.weight_updates in_flight: the decode step of a batch at which the engine takes the next weight version
    # (rlhf.generation.engine_process.in_flight_swap); None: weights change between batches only
    in_flight_step: int | None = None

    @property
    def device(self) -> str:
        return self.where.device

    @property
    def lookahead(self) -> int:
        return lookahead(self.name, self.max_staleness)


def lookahead(name: str, max_staleness: int) -> int:
    """How many batches engine `name` samples ahead of training: max_staleness for vllm_async, else 0."""
    return max_staleness if ENGINES[name].samples_ahead else 0


@dataclass
class Generated:
    responses: torch.Tensor  # (B*K, T) raw sampled tokens, right-padded with pad_token_id to T = max_new_tokens
    version: int  # weight version that sampled them (the first token's, under in-flight updates)
    seconds: float  # wall time the engine spent generating this batch
    logprobs: torch.Tensor | None = None  # (B*K, T) the engine's own sampling log-probs, when it has them
    scores: torch.Tensor | None = None  # (B*K,) reward before the missing-EOS penalty, when the engine scored them
    prompts: list[list[int]] | None = None  # the B prompts the engine sampled from, as it saw them (the loop checks)
    ref_logprobs: torch.Tensor | None = None  # (B*K, T) reference log-probs (0 on padding) if the engine computed them
    sampled_here: bool = False  # sampled by the learner's own process inside receive() (HF generate): no wait
    # (B*K, T) the weight version that sampled each token (vLLM's spans; in-flight updates change it mid-batch);
    # None: every token is `version`'s
    token_versions: torch.Tensor | None = None

    ROWS = ("responses", "logprobs", "scores", "ref_logprobs", "token_versions")  # the per-sample (B*K, ...) fields

    def to_wire(self) -> dict:
        """Every field, tensors as numpy arrays: what crosses a pipe or Ray's object store (from_wire undoes it)."""
        return {f.name: v.numpy() if isinstance(v := getattr(self, f.name), torch.Tensor) else v for f in fields(self)}

    @classmethod
    def from_wire(cls, wire: dict) -> Generated:
        """The Generated `to_wire` sent; arrays Ray's object store hands out read-only are copied (torch warns)."""
        tensor = lambda a: torch.from_numpy(a if a.flags.writeable else a.copy())  # noqa: E731
        return cls(**{k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in wire.items()})

    @classmethod
    def concat(cls, parts: list[Generated]) -> Generated:
        """Slices of one batch sampled side by side (Ray engines), in prompt order: rows and prompts joined, the
        batch's seconds the slowest slice's. Every slice must come from the same weight versions."""
        versions = tuple(p.version for p in parts)
        if len(set(versions)) != 1:  # every engine loads every version before the batches after it
            raise RuntimeError(f"a batch's slices were sampled with different weight versions {versions}")
        rows = {
            f: None if getattr(parts[0], f) is None else torch.cat([getattr(p, f) for p in parts]) for f in cls.ROWS
        }
        prompts = None if parts[0].prompts is None else [q for p in parts for q in p.prompts]
        return replace(parts[0], seconds=max(p.seconds for p in parts), prompts=prompts, **rows)

    def split(self, counts: list[int]) -> list[Generated]:
        """One Generated per part of the prompts, counts[r] prompts each, in order: part r's rows are the K samples
        of each of its prompts (rows are prompt-major), every per-sample field cut alike, as copies (not views)."""
        k = len(self.responses) // sum(counts)
        rows = [c * k for c in counts]
        cut = {}
        for f in self.ROWS:
            t = getattr(self, f)
            cut[f] = [None] * len(counts) if t is None else [part.clone() for part in torch.split(t, rows)]
        starts, prompts = [sum(counts[:r]) for r in range(len(counts))], self.prompts or []
        return [
            replace(self, prompts=prompts[s : s + c] or None, **{f: parts[r] for f, parts in cut.items()})
            for r, (s, c) in enumerate(zip(starts, counts))
        ]


class Engine(Protocol):
    """What the loop calls on an engine: rlhf.generation.hf.HFEngine, rlhf.generation.vllm.VLLMEngine and
    rlhf.generation.async_engine.AsyncEngine implement all of it."""

    lookahead: int  # batches generated ahead of training: 0 = synchronous

    def seek(self, batch: int) -> None:
        """The next submitted batch is run batch number `batch` (engines that seed per batch seed from it)."""

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        """Queue one batch of prompts (token ids, no padding). parts: how many of them each training rank sent
        (rlhf.generation.shared); an engine that scores the batch does so part by part, as each rank would."""

    def receive(self) -> Generated:
        """The oldest submitted batch, generated."""

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Make the engine sample from `model`'s current weights from now on, tagged `version`."""

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        """Snapshot folders of the versions still sampling batches ahead of `version` (a checkpoint keeps them);
        empty for a synchronous engine."""

    def load_snapshot(self, folder: Path, version: int) -> None:
        """Queue weights a checkpoint kept (`weights_in_flight`), tagged `version`: a resume puts back the
        batches that were being sampled ahead. Never called on a synchronous engine."""

    def stats(self) -> dict[str, float]:
        """Timing metrics (`timing/*`) of the batch last received and the last weight sync."""

    def close(self) -> None:
        """Release processes and memory; safe to call twice."""
