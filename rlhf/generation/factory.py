"""The one engine factory: train.engine name -> an Engine (rlhf.generation.base) ready to sample."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.generation.base import Engine, ReferenceSpec

OWN_GPU_MEMORY, SHARED_GPU_MEMORY = 0.9, 0.3  # vLLM's share of a GPU it has to itself / shares with training


@dataclass(frozen=True)
class Placement:
    """Where a vLLM engine runs. device: "cpu" or "cuda:<i>"; own_process: in a process of its own (vllm_async,
    or colocated beside several training processes, or on another device than training); gpu_memory_utilization:
    vLLM's share of the GPU (None on CPU); ray_gpus: Ray engines on GPUs, the GPUs of this node a local Ray cluster
    may give them (those after the training ranks'; rank 0's when there is none other); shares_gpu: on a GPU a
    training process uses too, so it is built after the learner placed its models (vLLM sizes its KV cache from the
    memory it finds free at start: built earlier, its budget would depend on how far the learner had got)."""

    device: str
    own_process: bool
    gpu_memory_utilization: float | None
    ray_gpus: tuple[int, ...] | None = None
    shares_gpu: bool = False


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
    if setting == "auto" and name == "vllm_async" and torch.cuda.device_count() > world:
        device = f"cuda:{world}"  # the paper's layout: W training GPUs and the next one for generation
    elif setting == "auto":
        device = learner
    else:
        device = "cuda:0" if setting == "cuda" else setting
    own_process = name == "vllm_async" or world > 1 or device != learner
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
    if c.engine_backend == "ray" and ray_address is None:
        on_gpus = c.engine_device.startswith("cuda") or (c.engine_device == "auto" and gpus > 0)
        room, what = (len(spare_gpus(world, gpus)), "GPU") if on_gpus else (cpus, "CPU")
        if c.num_engines > room:
            raise ValueError(
                f"train.num_engines: {c.num_engines} Ray engines, each asking for a {what}, on a local cluster that "
                f"has {room} for them; use at most {room}, or join a larger cluster (RAY_ADDRESS, docs/scale-out.md)"
            )


def lookahead(name: str, max_staleness: int) -> int:
    """How many batches engine `name` samples ahead of training: max_staleness for vllm_async, else 0."""
    return max_staleness if name == "vllm_async" else 0


def make_engine(
    name: str,
    model: torch.nn.Module,
    model_folder: Path,
    tokenizer,
    *,
    device: torch.device,
    seed: int,
    max_model_len: int,
    work_dir: Path,
    max_staleness: int = 1,
    dtype: str = "float32",
    reward=None,
    reference: ReferenceSpec | None = None,
    score: str = "never",
    where: Placement | None = None,
    process=None,
    backend: str = "process",
    num_engines: int = 1,
) -> Engine:
    """An engine for rlhf.presets.ENGINES `name`.

    hf: HF generate on `model` itself (the training model, on `device`: nothing to copy). vllm / vllm_async: a vLLM
    engine started from the HF safetensors folder `model_folder` (version 0, the weights `model` starts from),
    placed as `where` says (default: beside one training process on `device`). vllm_async samples up to
    `max_staleness` batches ahead in its own process, writing the weights of batches in flight to `work_dir` when
    a checkpoint asks; given `reward` (a rlhf.rewards.proxy.RewardSpec) it can score batches there too, as
    `score` says, and compute their reference log-probs given `reference` (rlhf.generation.async_engine). `process`:
    the channel to that engine started earlier (async_engine.start_engine: it has imported vLLM meanwhile); else
    one is started here: an engine process, or `num_engines` Ray actors with `backend` "ray".
    """
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(
            f"the tokenizer needs eos and pad tokens (eos={tokenizer.eos_token_id}, pad={tokenizer.pad_token_id})"
        )
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if name == "hf":
        from rlhf.generation.hf import HFEngine

        return HFEngine(model, device=device, **ids)
    if name not in ("vllm", "vllm_async"):
        raise ValueError(f"train.engine: unknown engine {name!r} (expected hf, vllm or vllm_async)")
    model_folder, work_dir = Path(model_folder), Path(work_dir)
    where = where or placement(name, "auto", None, 1, device)
    if dtype == "auto":  # bf16 where it is native (GPUs); on these CPUs float32 (docs/gpu.md)
        dtype = "bfloat16" if where.device.startswith("cuda") else "float32"
    if not (model_folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_folder / 'config.json'}: missing; the vLLM engine needs a saved HF model folder"
        )
    if name == "vllm_async" and max_staleness < 1:
        raise ValueError(f"max_staleness must be >= 1 for the vllm_async engine, got {max_staleness}")
    common = dict(seed=seed, max_model_len=max_model_len, dtype=dtype, **ids)
    scoring = dict(reward=reward, reference=reference)  # an engine in its own process only
    ahead = lookahead(name, max_staleness)
    if process is None and where.own_process:
        from rlhf.generation.async_engine import start_engine

        process = start_engine(where, ahead, backend, num_engines)
    return _vllm_engine(model_folder, common, where, ahead, work_dir, scoring, score, process)


def _vllm_engine(
    model_folder: Path,
    common: dict,
    where: Placement,
    ahead: int,
    work_dir: Path,
    scoring: dict,
    score: str,
    process=None,
):
    """VLLMEngine in this process, or in its own behind an AsyncEngine, as `where` says."""
    if not where.own_process:
        from rlhf.generation.vllm import VLLMEngine

        return VLLMEngine(
            model_folder, gpu_memory_utilization=where.gpu_memory_utilization, device=where.device, **common
        )
    from rlhf.generation.async_engine import AsyncEngine
    from rlhf.generation.engine_process import EngineSpec

    memory = where.gpu_memory_utilization
    spec = EngineSpec(str(model_folder), **common, **scoring, device=where.device, gpu_memory_utilization=memory)
    work_dir.mkdir(parents=True, exist_ok=True)
    score = score if spec.reward is not None else "never"
    return AsyncEngine(spec, work_dir, max_staleness=ahead, score=score, process=process)
