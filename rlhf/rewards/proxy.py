"""Reward functions the online loop can optimise: the proxy RM (default) or the gold judge directly.

Both take the post-processed batch (`ModelInput`, on any device) and its response texts and return one score per
sequence (N,): the proxy RM on its own device, the gold judge on the CPU. Evaluation always uses gold. A
`RewardSpec` names a reward function without loading it, so the async engine's process can build its own copy and
score batches while the learner trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from rlhf.models.batch import ModelInput
from rlhf.models.forward import sequence_scores


class ProxyReward:
    """Bradley-Terry reward model read at the last real response token (the EOS when present)."""

    needs_texts = False  # reads token ids only: the async engine's process skips decoding for it

    def __init__(self, model: torch.nn.Module, device: torch.device | None = None, chunk: int = 64):
        """device: where `model` lives (default: where its parameters are)."""
        self.model = model
        model.eval()  # (a DeepSpeed engine's eval() returns None)
        self.device = device if device is not None else next(model.parameters()).device
        self.chunk = chunk

    def placed(self, place, device: torch.device) -> ProxyReward:
        """The same reward with its model put on the training device by `place` (a move, or a DeepSpeed wrap)."""
        return ProxyReward(place(self.model), device, self.chunk)

    @torch.no_grad()
    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        batch = batch.to(self.device)
        last = batch.response_mask.sum(1).clamp(min=1) - 1
        s, a, p = batch.sequences, batch.attn, batch.positions
        chunks = [slice(i, i + self.chunk) for i in range(0, len(s), self.chunk)]
        return torch.cat([sequence_scores(self.model, s[c], a[c], p[c], batch.context, last[c]) for c in chunks])


class GoldReward:
    """The gold judge as the RL reward (an upper-bound experiment: no proxy to over-optimise)."""

    needs_texts = True

    def __init__(self, judge):
        self.judge = judge

    def placed(self, place, device: torch.device) -> GoldReward:
        return self  # scikit-learn on the CPU: texts in, scores out

    def __call__(self, batch: ModelInput, texts: list[str]) -> torch.Tensor:
        return torch.as_tensor(self.judge.score(texts), dtype=torch.float32)


@dataclass(frozen=True)
class RewardSpec:
    """train.reward as a picklable recipe: "proxy" reads the reward model in `folder`, "gold" the judge."""

    kind: Literal["proxy", "gold"]
    folder: str

    def build(self):
        if self.kind == "gold":
            from rlhf.rewards.gold import GoldJudge

            return GoldReward(GoldJudge.load(Path(self.folder)))
        from rlhf.models.loading import load_reward_model

        return ProxyReward(load_reward_model(Path(self.folder)).requires_grad_(False))
