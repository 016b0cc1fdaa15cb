"""The engine seam between the online loop and whoever samples completions.

The loop submits prompt batches and receives generated batches in order. `lookahead` is how many batches an
engine generates ahead of training: 0 = synchronous (every batch sampled with the current weights), N = async
(batch t may come from weights up to N updates old). Every batch carries the weight version that sampled it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    k: int  # samples per prompt, adjacent in the output (prompt-major)
    max_new_tokens: int
    temperature: float


@dataclass
class Generated:
    responses: torch.Tensor  # (B*K, T) raw sampled tokens, right-padded with pad_token_id to T = max_new_tokens
    version: int  # weight version that sampled them
    seconds: float  # wall time the engine spent generating this batch
    logprobs: torch.Tensor | None = None  # (B*K, T) the engine's own sampling log-probs, when it has them
    scores: torch.Tensor | None = None  # (B*K,) reward before the missing-EOS penalty, when the engine scored them


class Engine(Protocol):
    """Engines with lookahead > 0 (the async engine) also have `weights_in_flight()` and `load_snapshot()`,
    which a checkpoint and a resume use to put back the batches that were being sampled ahead."""

    lookahead: int

    def seek(self, batch: int) -> None:
        """The next submitted batch is run batch number `batch` (engines that seed per batch seed from it)."""

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Queue one batch of prompts (token ids, no padding)."""

    def receive(self) -> Generated:
        """The oldest submitted batch, generated."""

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Make the engine sample from `model`'s current weights from now on, tagged `version`."""

    def close(self) -> None:
        """Release processes and memory; safe to call twice."""


def pad_right(rows: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    out = torch.full((len(rows), length), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        row = row[:length]
        out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> ids (n, C) and a bool mask (n, C)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = True
    return ids, mask
