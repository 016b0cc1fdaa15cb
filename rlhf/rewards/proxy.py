"""Reward functions the online loop can optimise: the proxy RM (default) or the gold judge directly.

Both take the post-processed batch and return one score per sequence (N,). Evaluation always uses gold.
"""

from __future__ import annotations

import torch

from rlhf.trainers.forward import sequence_scores


class ProxyReward:
    """Bradley-Terry reward model read at the last real response token (the EOS when present)."""

    def __init__(self, model: torch.nn.Module, chunk: int = 64):
        self.model = model.eval()
        self.chunk = chunk

    @torch.no_grad()
    def __call__(self, sequences, attn, positions, context: int, response_mask: torch.Tensor, texts: list[str]) -> torch.Tensor:
        last = response_mask.sum(1).clamp(min=1) - 1
        chunks = [slice(i, i + self.chunk) for i in range(0, len(sequences), self.chunk)]
        parts = [sequence_scores(self.model, sequences[c], attn[c], positions[c], context, last[c]) for c in chunks]
        return torch.cat(parts)


class GoldReward:
    """The gold judge as the RL reward (an upper-bound experiment: no proxy to over-optimise)."""

    def __init__(self, judge):
        self.judge = judge

    def __call__(self, sequences, attn, positions, context: int, response_mask: torch.Tensor, texts: list[str]) -> torch.Tensor:
        return torch.as_tensor(self.judge.score(texts), dtype=torch.float32)
