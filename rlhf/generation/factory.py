"""The one engine factory: train.engine name -> an Engine (rlhf.generation.base) ready to sample."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from rlhf.generation.base import Engine, EngineSpec, Placement
from rlhf.presets import ENGINES

OWN_GPU_MEMORY, SHARED_GPU_MEMORY = 0.9, 0.3  # vLLM's share of a GPU it has to itself / shares with training


def placement(
    name: str, setting: str, memory: float | None, world: int, learner_device: torch.device, backend: str = "process"
) -> Placement:
    """train.engine_device `setting` resolved for engine `name` beside `world` training processes, rank 0 on
    `learner_device` (train.engine_gpu_memory_utilization `memory`: None = by whether the GPU is shared). With the
    Ray backend Ray picks the GPU (one of its own: "cuda:0" as the actor sees it) or the CPU."""
    # vLLM runs on a GPU or the CPU: rank 0's GPU, or the CPU for any other training device
    learner = f"cuda:{learner_device.index or 0}" if learner_device.type == "cuda" else "cpu"
    if backend == "ray":
        if not (setting.startswith("cuda") or (setting == "auto" and learner != "cpu")):
            return Placement("cpu", True, None)
        spare = spare_gpus(world, torch.cuda.device_count())
        shared = spare == (0,) and world > 0 and learner != "cpu"
        return Placement("cuda:0", True, memory or (SHARED_GPU_MEMORY if shared else OWN_GPU_MEMORY), spare, shared)
    ahead = ENGINES[name].samples_ahead
    if setting == "auto" and ahead and torch.cuda.device_count() > world:
        device = f"cuda:{world}"  # the paper's layout: W training GPUs and the next one for generation
    elif setting == "auto":
        device = learner
    else:
        device = "cuda:0" if setting == "cuda" else setting
    own_process = ahead or world > 1 or device != learner
    if device == "cpu":
        return Placement(device, own_process, None)
    shared = int(device.split(":")[1]) < world  # the training ranks hold cuda:0 .. cuda:W-1
    return Placement(device, own_process, memory or (SHARED_GPU_MEMORY if shared else OWN_GPU_MEMORY), None, shared)


def spare_gpus(world: int, gpus: int) -> tuple[int, ...]:
    """The GPUs a local Ray cluster gives its engines: those after the training ranks' cuda:0 .. W-1, else cuda:0,
    shared with training."""
    return tuple(range(world, gpus)) or (0,)


def check_runnable_here(c, gpus: int, cpus: int, ray_address: str | None, world: int = 1) -> None:
    """Refuse, in one line naming the setting, what this machine cannot run, before any process starts: train `c`
    (a TrainConfig) in `world` processes on a machine with `gpus` CUDA devices visible and `cpus` CPUs, on the Ray
    cluster at `ray_address` (None: a local one this run starts, with `cpus` CPUs and the GPUs the training
    processes leave, as `placement` gives them)."""
    if c.engine_device.startswith("cuda"):
        index = int(c.engine_device.partition(":")[2] or 0)
        if index >= gpus:
            seen = "no CUDA device" if gpus == 0 else f"{gpus} CUDA device(s), cuda:0 to cuda:{gpus - 1}"
            raise ValueError(f"train.engine_device: {c.engine_device}, but this machine has {seen}; use auto or cpu")
    if c.engine_backend == "ray" and ray_address is None and c.engine_resource is not None:
        raise ValueError(
            f"train.engine_resource: {c.engine_resource} marks engine nodes of a Ray cluster to join, and RAY_ADDRESS "
            'is not set (a local cluster has no custom resource): set RAY_ADDRESS (docs/scale-out.md, "Two nodes") '
            "or unset train.engine_resource"
        )
    if c.engine_backend == "ray" and ray_address is None:
        on_gpus = c.engine_device.startswith("cuda") or (c.engine_device == "auto" and gpus > 0)
        room, what = (len(spare_gpus(world, gpus)), "GPU") if on_gpus else (cpus, "CPU")
        if c.num_engines > room:
            raise ValueError(
                f"train.num_engines: {c.num_engines} Ray engines, each asking for a {what}, on a local cluster that "
                f"has {room} for them; use at most {room}, or join a larger cluster (RAY_ADDRESS, docs/scale-out.md)"
            )


def token_ids(tokenizer) -> dict[str, int]:
    """The eos and pad token ids every engine needs, from `tokenizer`; ValueError when it lacks one."""
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(
            f"the tokenizer needs eos and pad tokens (eos={tokenizer.eos_token_id}, pad={tokenizer.pad_token_id})"
        )
    return dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def local_spec(name: str, model_folder: Path, tokenizer, device: torch.device, **settings) -> EngineSpec:
    """The spec of vLLM engine `name` beside one process on `device` (a stage, a benchmark, a test); `settings`: the
    other EngineSpec fields. The trainer places its engine beside all its ranks instead (rlhf.trainers.early)."""
    where = placement(name, "auto", None, 1, device)
    return EngineSpec(name, str(model_folder), **token_ids(tokenizer), where=where, **settings)


def make_engine(spec: EngineSpec, process=None) -> Engine:
    """The vLLM engine `spec` describes, started from its model folder (version 0): a VLLMEngine in this process,
    or, where spec.where says it runs in its own, an AsyncEngine (rlhf.generation.async_engine) over `process`,
    the channel started earlier for it (start_engine: it imported vLLM meanwhile), else one started now.
    The HF engine needs no spec: rlhf.generation.hf.HFEngine samples from the training model itself."""
    if spec.name not in ENGINES or not ENGINES[spec.name].vllm:
        raise ValueError(f"train.engine: unknown vLLM engine {spec.name!r} (expected vllm or vllm_async)")
    if spec.dtype == "auto":  # bf16 where it is native (GPUs); on these CPUs float32 (docs/gpu.md)
        spec = replace(spec, dtype="bfloat16" if spec.device.startswith("cuda") else "float32")
    if not (Path(spec.model_folder) / "config.json").is_file():
        raise FileNotFoundError(
            f"{Path(spec.model_folder) / 'config.json'}: missing; the vLLM engine needs a saved HF model folder"
        )
    if ENGINES[spec.name].samples_ahead and spec.max_staleness < 1:
        raise ValueError(f"max_staleness must be >= 1 for the vllm_async engine, got {spec.max_staleness}")
    if not spec.where.own_process:
        from rlhf.generation.vllm import VLLMEngine

        memory = spec.where.gpu_memory_utilization
        ids = dict(eos_token_id=spec.eos_token_id, pad_token_id=spec.pad_token_id)
        common = dict(seed=spec.seed, max_model_len=spec.max_model_len, dtype=spec.dtype, **ids)
        return VLLMEngine(Path(spec.model_folder), gpu_memory_utilization=memory, device=spec.device, **common)
    from rlhf.generation.async_engine import AsyncEngine, start_engine

    process = process or start_engine(spec.where, spec.lookahead, spec.backend, spec.num_engines, spec.resource)
    return AsyncEngine(spec, process)
