"""The train stage's first step: the process of an engine that runs in its own (the async engine), started
before the trainer imports anything heavy.

On these CPUs the engine takes ~11 s to start (~7 s of it importing vLLM) and the trainer ~6 s to import its
libraries and load its models: started first, the engine does its imports while the trainer does its own, and
the first batch waits for the difference only. So this module imports no trainer code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf.config import Config
from rlhf.generation.base import Placement, lookahead
from rlhf.generation.factory import placement
from rlhf.presets import ENGINES, resolve
from rlhf.runtime import env_int


def launch() -> tuple[int, int, torch.device]:
    """(rank, world size, rank's device) from the launcher's environment, before the Accelerator exists."""
    rank, world = env_int("RANK", 0), env_int("WORLD_SIZE", 1, minimum=1)
    local = env_int("LOCAL_RANK", 0)
    return rank, world, torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")


def engine_placement(cfg: Config) -> tuple[str, Placement | None]:
    """(train.engine as the trainer resolves it, where its vLLM engine runs beside this launch's training processes;
    None for the HF engine, which samples from the training model itself). The one place the trainer's engine is
    placed, once per run: by this stage's early start, or by the trainer's setup when nothing started it."""
    name = resolve(cfg.train.trainer, cfg.train.engine)[1]
    if not ENGINES[name].vllm:
        return name, None
    _, world, device = launch()
    c = cfg.train
    return name, placement(name, c.engine_device, c.engine_gpu_memory_utilization, world, device, c.engine_backend)


@dataclass(frozen=True)
class EarlyStart:
    """What the train stage's first step decided and started, handed to the trainer (rlhf.trainers.setup), which
    builds on it rather than placing the engine again."""

    engine: str  # train.engine as the trainer resolves it
    where: Placement | None  # engine_placement's; None: the HF engine
    process: object = None  # the engine's channel (start_engine), on the rank that holds it in its own process

    def close(self) -> None:
        """Stop the process if no engine took it over; a no-op once the engine has closed it."""
        if self.process is not None:
            self.process.close(at_once=True)


def holds_own_process(where: Placement | None) -> bool:
    """This rank holds an engine in a process of its own (rank 0: vllm_async, or vllm beside several training
    processes or on another device)."""
    return where is not None and where.own_process and launch()[0] == 0


def start_engine_process(cfg: Config) -> EarlyStart:
    """The engine placed, and its channel (rlhf.generation.async_engine.start_engine: its process, or its Ray
    actors) importing vLLM from now on where this rank holds it in a process of its own."""
    name, where = engine_placement(cfg)
    if not holds_own_process(where):
        return EarlyStart(name, where)
    from rlhf.generation.async_engine import start_engine

    c = cfg.train
    channel = start_engine(where, lookahead(name, c.max_staleness), c.engine_backend, c.num_engines, c.engine_resource)
    return EarlyStart(name, where, channel)
