"""train.learner_first_batches: the learner samples a run's first W batches itself while the async engine starts.

The engine's start-up (vLLM's imports and build: ~10 s on these CPUs, tens of seconds on a GPU) is the learner's
first wait. Meanwhile the learner can sample with HF generate on its own model (rlhf.generation.hf) and train on
those batches, on-policy (staleness 0). The engine samples from batch W on under the usual rule: batch t >= W from
weight version >= t - N; the versions before W - N are never sent to it. W is a setting, not a race with the
engine's start, so a run is as reproducible as without it (and resumes to the same result).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch

from rlhf.generation.base import Engine, Generated, SamplingParams
from rlhf.generation.hf import HFEngine


class LearnerFirst:
    """The Engine protocol: batches before `first` from `learner` (HF generate on the training model), the others
    from `engine` (an AsyncEngine, or a SharedEngine over one)."""

    def __init__(self, learner: HFEngine, engine: Engine, first: int):
        self.lookahead = engine.lookahead
        self.learner, self.engine, self.first = learner, engine, first
        self._next = 0  # the run's batch number of the next submit
        self._here: deque[bool] = deque()  # per batch submitted and not yet received: sampled by the learner
        self._last_here = False

    def _engine_needs(self, version: int) -> bool:
        """Whether the engine samples a batch with weight version `version` (batch version + N onwards)."""
        return version >= self.first - self.lookahead

    def seek(self, batch: int) -> None:
        self._next = batch
        self.engine.seek(max(batch, self.first))

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        here = self._next < self.first
        (self.learner if here else self.engine).submit(prompts, params, parts)
        self._here.append(here)
        self._next += 1

    def receive(self) -> Generated:
        self._last_here = self._here.popleft()
        return (self.learner if self._last_here else self.engine).receive()

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        self.learner.load_weights(model, version)
        if self._engine_needs(version):
            self.engine.load_weights(model, version)

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        return self.engine.weights_in_flight(version)  # only versions it was sent: those its batches need

    def load_snapshot(self, folder: Path, version: int) -> None:
        if self._engine_needs(version):  # else a batch the learner samples: no snapshot was kept
            self.engine.load_snapshot(folder, version)

    def stats(self) -> dict[str, float]:
        return {} if self._last_here else self.engine.stats()

    def close(self) -> None:
        self.learner.close()
        self.engine.close()
