"""Synchronous generation with HF `generate` on the training model itself (shared weights, no copy)."""

from __future__ import annotations

import contextlib
import time
from collections import deque

import torch

from rlhf.generation.base import Generated, SamplingParams, pad_left, pad_right


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module):
    """Under ZeRO-3 each rank holds shards: gather the full weights for the duration of `generate`."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


class HFEngine:
    lookahead = 0

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.version = 0
        self._queue: deque = deque()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        self._queue.append((prompts, params))

    @torch.no_grad()
    def receive(self) -> Generated:
        prompts, p = self._queue.popleft()
        start = time.perf_counter()
        ids, mask = pad_left(prompts, self.pad_token_id)
        was_training = self.model.training
        self.model.eval()
        with gathered_for_generation(self.model):
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask.long(),
                do_sample=True,
                temperature=p.temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=p.max_new_tokens,
                num_return_sequences=p.k,
                eos_token_id=self.eos_token_id,
                pad_token_id=self.pad_token_id,
            )
        self.model.train(was_training)
        responses = out[:, ids.shape[1] :].tolist()
        return Generated(pad_right(responses, p.max_new_tokens, self.pad_token_id), self.version, time.perf_counter() - start)

    def seek(self, batch: int) -> None:
        pass  # samples come from the global torch RNG, which a checkpoint restores

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        # The engine samples from the training model itself: nothing to copy.
        self.version = version

    def close(self) -> None:
        self._queue.clear()
