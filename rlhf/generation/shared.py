"""One vLLM engine for W training processes, as the paper ran it (3 training GPUs + 1 vLLM GPU).

Rank 0 holds the engine (colocated or async, in its own process: rlhf.generation.factory.placement); every rank
calls the Engine protocol in the same order, as the loop does anyway:
- submit: the ranks' prompts are gathered on rank 0 and sent as one batch, rank 0's prompts first, then rank 1's...
  (the engine seeds by position in the batch, so a run is reproducible for a given W);
- receive: rank 0 splits the generated batch by rank and scatters it: each rank gets the completions of exactly
  the prompts it submitted (their echo in Generated.prompts, which the loop checks);
- load_weights: rank 0 sends its weights; under ZeRO-3 every rank takes part in gathering them.
Objects travel over torch.distributed (gloo on CPU): prompts and completions are small next to the weights.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.generation.base import Engine, Generated, SamplingParams
from rlhf.generation.weights import weight_stream


class SharedEngine:
    """The Engine protocol on every rank over `engine`, which rank 0 holds (None on the other ranks)."""

    def __init__(self, engine: Engine | None, rank: int, world: int, lookahead: int):
        if (engine is None) != (rank != 0):
            raise ValueError("SharedEngine: rank 0, and only rank 0, holds the engine")
        self.engine, self.rank, self.world, self.lookahead = engine, rank, world, lookahead
        self._counts: deque[list[int]] = deque()  # per submitted batch: how many prompts each rank sent

    def seek(self, batch: int) -> None:
        if self.engine is not None:
            self.engine.seek(batch)

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        """This rank's prompts; the parts are the ranks' (gathered here), so a caller passes none."""
        if parts is not None:
            raise ValueError("SharedEngine.submit: each rank submits its own prompts; the parts are gathered here")
        parts = [None] * self.world if self.rank == 0 else None
        dist.gather_object(prompts, parts, dst=0)
        if self.engine is not None:
            counts = [len(part) for part in parts]
            self.engine.submit([p for part in parts for p in part], params, counts)
            self._counts.append(counts)

    def receive(self) -> Generated:
        parts = None
        if self.engine is not None:
            parts = self.engine.receive().split(self._counts.popleft())
        mine = [None]
        dist.scatter_object_list(mine, parts, src=0)
        return mine[0]

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        if self.engine is not None:
            self.engine.load_weights(model, version)
        else:
            with weight_stream(model) as (_, pairs):  # rank 0 gathers the weights: a collective under ZeRO-3
                deque(pairs, maxlen=0)

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        return self.engine.weights_in_flight(version) if self.engine is not None else {}

    def load_snapshot(self, folder: Path, version: int) -> None:
        if self.engine is not None:
            self.engine.load_snapshot(folder, version)

    def stats(self) -> dict[str, float]:
        return self.engine.stats() if self.engine is not None else {}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
