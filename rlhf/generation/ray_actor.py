"""The engine inside a Ray actor (rlhf.generation.ray_engines runs E of them): a VLLMEngine and its scorer, built by
the engine process's own code, and the weights' form in Ray's object store."""

from __future__ import annotations

import os
import time
import warnings

import torch

from rlhf.generation.engine_process import EngineClock, Generate, Result, pin_to_core
from rlhf.generation.weights import SharedWeights


class EngineActor:
    """One engine in a Ray worker: a VLLMEngine and its scorer. Ray runs its calls one at a time, in order."""

    def __init__(self, core: int | None):
        pin_to_core(core)
        from rlhf.generation.engine_process import import_ahead

        import_ahead("cuda" if torch.cuda.is_available() else "cpu")  # while the trainer imports and loads
        self.engine = self.scorer = None
        self.clock = EngineClock()

    def build(self, spec) -> tuple[float, str, int, str]:
        """(start-up seconds, node IP, pid, node id) once the engine is built."""
        import ray

        from rlhf.generation.engine_build import build

        self.engine, self.scorer = build(spec, "cuda:0" if spec.device.startswith("cuda") else "cpu")
        self.clock.free()
        node = ray.get_runtime_context().get_node_id()
        return self.engine.start_seconds, ray.util.get_node_ip_address(), os.getpid(), node

    def load(self, box: list, version: int, in_flight: bool = False) -> tuple[int, float]:
        """Take weight version `version` ((version, seconds its fetch took)); box: [its ObjectRef], fetched here
        rather than by Ray before the call, so that the fetch (across nodes: one object store to another) is
        timed; in_flight: in the middle of a batch (`generate` with `until`, then `finish`)."""
        import ray

        self.clock.busy()
        start = time.perf_counter()
        packed = ray.get(box[0])
        fetched = time.perf_counter() - start
        self.clock.reload += self.engine.reload(unpack_weights(packed), version, in_flight)
        self.clock.free()
        return version, fetched

    def generate(self, work: Generate, first: int, until: int | None = None) -> Result | None:
        """sample_and_score's Result for this engine's slice of the batch; with `until` (an in-flight update), only
        its decode steps before `until`: the next calls are `load(..., in_flight=True)` and `finish`."""
        from rlhf.generation.engine_process import sample_and_score

        self.clock.busy()
        if until is None:
            result = sample_and_score(self.engine, self.scorer, work, self.clock, first)
        else:
            result = self.engine.begin(work.prompts, work.params, work.batch, first, until)
        self.clock.free()
        return result

    def finish(self, work: Generate) -> Result:
        """The rest of the batch `generate(..., until)` began, scored: its Result."""
        from rlhf.generation.engine_process import scored

        self.clock.busy()
        result = scored(self.engine.finish(), self.scorer, work, self.clock)
        self.clock.free()
        return result


def pack_weights(weights: SharedWeights) -> tuple:
    """(dtype name -> numpy buffer, layout): numpy has no bfloat16, so those buffers travel as int16."""
    arrays = {d: (b.view(torch.int16) if b.dtype == torch.bfloat16 else b).numpy() for d, b in weights.buffers.items()}
    return arrays, weights.layout


def unpack_weights(packed: tuple) -> SharedWeights:
    arrays, layout = packed
    with warnings.catch_warnings():  # the object store's arrays are read-only; vLLM only copies from them
        warnings.simplefilter("ignore", UserWarning)
        return SharedWeights({d: torch.from_numpy(a).view(getattr(torch, d)) for d, a in arrays.items()}, layout)
