"""Weight snapshots: the trainer's full weights copied out between optimizer steps, for an engine to load.

Weights reach an engine in memory (docs/gpu.md, "Weight sync"; rlhf.generation.transfer: vLLM's weight-transfer API):
- the colocated engine reads the trainer's tensors directly (`weight_stream`: under ZeRO-3 one parameter gathered
  at a time, never the whole model at once);
- the async engine process gets a `SharedWeights` copy: one flat shared-memory buffer per dtype, passed through
  its queue by handle (torch shares the memory, nothing is pickled byte by byte), its buffers reused for the next
  versions once the engine is done with them. When the trainer's weights are on a GPU the buffers are page-locked
  (`page_lock`): the device-to-host copy on the learner's critical path then runs at DMA speed.
Files appear only for checkpoints (`write_snapshot`: the weights of batches still being sampled) and are read
back on resume (`read_snapshot`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Iterable, Iterator
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
    if _zero3(model.parameters()):
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


Entry = tuple[str, str, tuple[int, ...], int]  # (name, dtype name, shape, element count)


def _zero3(params) -> bool:
    """Some of `params` are ZeRO-3 partitions (DeepSpeed marks them with a ds_id)."""
    return any(hasattr(p, "ds_id") for p in params)


@contextlib.contextmanager
def weight_stream(model: torch.nn.Module) -> Iterator[tuple[list[Entry], Iterator[tuple[str, torch.Tensor]]]]:
    """(entries, pairs): what `full_weights` holds, known before anything is gathered, and its (name, tensor) pairs
    one at a time. Under ZeRO-3 each weight is gathered only while it is read (with its adapters, for a LoRA
    policy's merged weights): peak extra memory one weight and what the consumer keeps of it. A collective: every
    rank iterates all pairs, in order."""
    if not _zero3(model.parameters()):
        with full_weights(model) as state:
            yield _entries(state), iter(state.items())
        return
    if lora.is_lora(model):
        plan = lora.merge_plan(model)
    else:
        plan = [(name, t, None) for name, t in model.state_dict(keep_vars=True).items()]
    entries = []
    for name, t, layer in plan:
        dtype = "float32" if layer is not None else _dtype(t)  # merged weights are float32 (lora.merged_weight)
        entries.append((name, dtype, tuple(getattr(t, "ds_shape", t.shape)), getattr(t, "ds_numel", t.numel())))
    yield entries, _gathered_one_by_one(plan)


def _gathered_one_by_one(plan) -> Iterator[tuple[str, torch.Tensor]]:
    import deepspeed

    for name, t, layer in plan:
        params = [t, *(lora.layer_parameters(layer) if layer is not None else ())]
        with deepspeed.zero.GatheredParameters(params, enabled=_zero3(params)):
            yield name, lora.merged_weight(t, layer).detach()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's full parameters (ZeRO-3: their full size, not this rank's shard)."""
    return sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())


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
    def allocate(cls, entries: list[Entry]) -> SharedWeights:
        """Empty shared buffers laid out for `entries` (names, dtypes, shapes)."""
        layout, sizes = [], {}
        for name, dtype, shape, numel in entries:
            layout.append((name, dtype, sizes.get(dtype, 0), shape))
            sizes[dtype] = sizes.get(dtype, 0) + numel
        buffers = {d: torch.empty(n, dtype=getattr(torch, d)).share_memory_() for d, n in sizes.items()}
        return cls(buffers, layout)

    def page_lock(self) -> None:
        """Register the buffers with CUDA (cudaHostRegister), each once: copies from a GPU into pageable memory ran at
        11 GB/s on an H100, into page-locked memory at 54 (docs/gpu.md). A buffer CUDA refuses (e.g. a locked-memory
        limit) stays pageable: the sync is slower, not wrong. Only this process's mapping is locked."""
        for buffer in self.buffers.values():
            if buffer.numel() and buffer.data_ptr() not in _PAGE_LOCKED:  # each buffer asked once
                _page_lock(buffer)

    def fits(self, entries: list[Entry]) -> bool:
        return [(n, d, s) for n, d, _, s in self.layout] == [(n, d, s) for n, d, s, _ in entries]

    def fill(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> SharedWeights:
        """Copy (name, tensor) pairs (any device), in layout order, into the buffers; returns self."""
        for (_, view), (_, t) in zip(self.tensors(), pairs, strict=True):
            view.copy_(t)
        return self


_PAGE_LOCKED: dict[int, bool] = {}  # buffers this process asked CUDA to page-lock: data pointer -> whether it did


def _page_lock(buffer: torch.Tensor) -> None:
    cudart, ptr, size = torch.cuda.cudart(), buffer.data_ptr(), buffer.numel() * buffer.element_size()
    error = int(cudart.cudaHostRegister(ptr, size, 0))
    _PAGE_LOCKED[ptr] = not error
    # forgotten (and unregistered) when the buffer is freed; not at exit, when the CUDA context may already be gone
    weakref.finalize(buffer, _forget, cudart, ptr).atexit = False
    if error:
        message = f"CUDA could not page-lock {size / 2**30:.2f} GiB of shared memory (cudaError {error})"
        print(f"weight sync: {message}; copying into pageable memory instead", file=sys.stderr)


def _forget(cudart, ptr: int) -> None:
    if _PAGE_LOCKED.pop(ptr, False):
        cudart.cudaHostUnregister(ptr)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _entries(state: dict[str, torch.Tensor]) -> list[Entry]:
    """(name, dtype name, shape, element count) of each tensor: what a SharedWeights layout records."""
    return [(n, _dtype(t), tuple(t.shape), t.numel()) for n, t in state.items()]


def on_gpu(model: torch.nn.Module) -> bool:
    return next(model.parameters()).device.type == "cuda"


def shared_snapshot(model: torch.nn.Module, spare: SharedWeights | None = None) -> SharedWeights:
    """A copy of `model`'s full weights in shared memory, in `spare`'s buffers when they fit (a collective under
    ZeRO-3: every rank calls it; gathered one parameter at a time). Later optimizer steps cannot change the copy."""
    with weight_stream(model) as (entries, pairs):
        target = spare if spare is not None and spare.fits(entries) else SharedWeights.allocate(entries)
        if on_gpu(model):
            target.page_lock()
        return target.fill(pairs)


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
    return SharedWeights.allocate(_entries(state)).fill(state.items())
