"""Weight snapshots: the trainer's full weights copied out between optimizer steps, for an engine to load.

Weights reach an engine in memory (docs/gpu.md, "Weight sync"):
- the colocated engine reads the trainer's tensors directly (`full_weights`, gathered under ZeRO-3);
- the async engine process gets a `SharedWeights` copy: one flat shared-memory buffer per dtype, passed through
  its queue by handle (torch shares the memory, nothing is pickled byte by byte), its buffers reused for the next
  versions once the engine is done with them.
Files appear only for checkpoints (`write_snapshot`: the weights of batches still being sampled) and are read
back on resume (`read_snapshot`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.io import atomic_dir
from rlhf.models import lora

WEIGHTS_FILE = "model.safetensors"


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module):
    """Under ZeRO-3 each rank holds shards: gather the full weights for the duration of the block.

    A collective: every training rank enters it, also those that do not send weights anywhere."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


@contextlib.contextmanager
def full_weights(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """{HF name: tensor} of `model`'s full weights, valid inside the block only (no copy: read them there).

    A LoRA policy gives its merged weights under the base model's names: what an engine or a plain transformers
    load expects."""
    with gathered_parameters(model):
        state = lora.merged_state_dict(model) if lora.is_lora(model) else model.state_dict()
        yield {name: t.detach() for name, t in state.items()}


@dataclass
class SharedWeights:
    """A model's weights in shared CPU memory, one flat buffer per dtype; picklable to another process without
    copying (torch passes the buffers' shared memory)."""

    buffers: dict[str, torch.Tensor]  # dtype name -> flat 1-D buffer
    layout: list[tuple[str, str, int, tuple[int, ...]]]  # (weight name, dtype name, offset, shape)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffers, in the model's state_dict order."""
        for name, dtype, offset, shape in self.layout:
            yield name, self.buffers[dtype][offset : offset + math.prod(shape)].view(shape)

    @classmethod
    def allocate(cls, state: dict[str, torch.Tensor]) -> SharedWeights:
        """Empty shared buffers laid out for `state`'s names, shapes and dtypes."""
        layout, sizes = [], {}
        for name, dtype, shape, numel in _entries(state):
            layout.append((name, dtype, sizes.get(dtype, 0), shape))
            sizes[dtype] = sizes.get(dtype, 0) + numel
        buffers = {d: torch.empty(n, dtype=getattr(torch, d)).share_memory_() for d, n in sizes.items()}
        return cls(buffers, layout)

    def fits(self, state: dict[str, torch.Tensor]) -> bool:
        return [(n, d, s) for n, d, _, s in self.layout] == [(n, d, s) for n, d, s, _ in _entries(state)]

    def fill(self, state: dict[str, torch.Tensor]) -> SharedWeights:
        """Copy `state` (any device) into the buffers; returns self."""
        for (_, view), t in zip(self.tensors(), state.values(), strict=True):
            view.copy_(t)
        return self


def _entries(state: dict[str, torch.Tensor]) -> list[tuple[str, str, tuple[int, ...], int]]:
    """(name, dtype name, shape, element count) of each tensor: what a SharedWeights layout records."""
    return [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel()) for n, t in state.items()]


def shared_snapshot(model: torch.nn.Module, spare: SharedWeights | None = None) -> SharedWeights:
    """A copy of `model`'s full weights in shared memory, in `spare`'s buffers when they fit (a collective under
    ZeRO-3: every rank calls it). Later optimizer steps cannot change the copy."""
    with full_weights(model) as state:
        target = spare if spare is not None and spare.fits(state) else SharedWeights.allocate(state)
        return target.fill(state)


def write_snapshot(weights: SharedWeights, folder: Path) -> Path:
    """Write `weights` as `folder`/model.safetensors, atomically: the folder appears only once it is complete."""
    from safetensors.torch import save_file

    with atomic_dir(folder) as tmp:
        # safetensors refuses views of one buffer: each tensor gets its own copy (checkpoints only)
        save_file({name: t.clone() for name, t in weights.tensors()}, str(tmp / WEIGHTS_FILE))
    return folder


def read_snapshot(folder: Path) -> SharedWeights:
    """Weights `write_snapshot` wrote, in shared memory."""
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / WEIGHTS_FILE))
    return SharedWeights.allocate(state).fill(state)
