"""Synchronous generation with HF `generate` on the training model itself (shared weights, no copy).

Besides the tokens it returns each sampled token's log-prob under softmax(logits / T), the distribution it
sampled from (as the vLLM engines do), so objectives that only report behaviour log-probs (DPO, best-of-k)
skip a second forward over the batch.
"""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rlhf.generation.base import Generated, SamplingParams
from rlhf.generation.weights import gathered_parameters
from rlhf.models.batch import pad_left, pad_right


class _SampledLogprobs(LogitsProcessor):
    """Records log softmax(logits / T) of each sampled token, one step behind: at step s it sees the token
    sampled at step s-1 (the last column of input_ids), so only one (N, V) matrix is held at a time.

    `generate` runs user processors before its temperature warper and this one is given no others, so the
    scores it sees are the raw logits: the temperature is applied here, as the trainer's forward does.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.previous: torch.Tensor | None = None
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.columns.append(self.previous.gather(1, input_ids[:, -1:]))
        self.previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def result(self, responses: torch.Tensor) -> torch.Tensor:
        """(N, S) log-probs of the S sampled tokens (rows padded after EOS get meaningless values: mask them)."""
        if self.previous is None:
            return torch.zeros(responses.shape[0], 0)
        last = self.previous.gather(1, responses[:, -1:].to(self.previous.device))
        return torch.cat([*self.columns, last], dim=1).cpu()


class HFEngine:
    lookahead = 0

    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int, device: torch.device):
        self.model = model
        self.device = device  # the model's: prompts go there, responses come back to the CPU like any engine's
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.version = 0
        self._queue: deque = deque()

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        self._queue.append((prompts, params))

    @torch.no_grad()
    def receive(self) -> Generated:
        prompts, p = self._queue.popleft()
        start = time.perf_counter()
        ids, mask = (t.to(self.device) for t in pad_left(prompts, self.pad_token_id))
        was_training = self.model.training
        self.model.eval()
        recorder = _SampledLogprobs(p.temperature)
        with gathered_parameters(self.model):
            out = self.model.generate(
                logits_processor=LogitsProcessorList([recorder]),
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
        responses = out[:, ids.shape[1] :]
        logprobs = torch.zeros(responses.shape[0], p.max_new_tokens)
        logprobs[:, : responses.shape[1]] = recorder.result(responses)
        return Generated(
            pad_right(responses.tolist(), p.max_new_tokens, self.pad_token_id),
            self.version,
            time.perf_counter() - start,
            logprobs,
            prompts=prompts,
            sampled_here=True,
        )

    def seek(self, batch: int) -> None:
        pass  # samples come from the global torch RNG, which a checkpoint restores

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        # The engine samples from the training model itself: nothing to copy.
        self.version = version

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        return {}  # synchronous: nothing is sampled ahead

    def load_snapshot(self, folder: Path, version: int) -> None:
        raise RuntimeError("HFEngine samples from the training model: it has no snapshots to load")

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._queue.clear()
