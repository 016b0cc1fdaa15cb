"""REINFORCE Leave-One-Out (RLOO) with the original's sequence-level PPO-style clipping.

Source: Kool et al. 2019 ("Buy 4 REINFORCE samples, get a baseline for free"); Ahmadian et al. 2024
("Back to basics"); original `MyRLOOTrainer` (§3.5) = TRL 0.9.4 `RLOOTrainer`.
Shapes: B prompts, K samples per prompt, N = B*K sequences, rows prompt-major (row b*K + j).
Stats are 0-dim detached float tensors (call `float(v)` to log them).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.common import as_groups
from rlhf.algorithms.ppo import policy_loss


def rloo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """A_i = R_i - mean of the other K-1 rewards of the same prompt (the leave-one-out baseline).

    Source: original §3.5 step 4 (no normalisation or whitening). R_i is the sequence reward
    (score - kl_coef * sum_t kl). Shapes: rewards (N,) -> (N,). Raises ValueError when k < 2 or N % k != 0.
    """
    grouped = as_groups(rewards, k)  # (B, K), one prompt per row
    baseline = (grouped.sum(dim=1, keepdim=True) - grouped) / (k - 1)
    advantages = grouped - baseline
    return advantages.reshape(-1)


def sequence_policy_loss(
    logp_sum: torch.Tensor, old_logp_sum: torch.Tensor, advantages: torch.Tensor, cliprange: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with ONE ratio per sequence: r_i = exp(sum_t logp - sum_t old_logp), mean over N.

    Source: original §3.5 step 5: L = mean_i max(-A_i r_i, -A_i clip(r_i, 1-eps, 1+eps)). Stats as
    `ppo.policy_loss` but per sequence: clipfrac, approxkl = 0.5 * mean((sum logp - sum old)^2), ratio.
    Shapes: logp_sum, old_logp_sum, advantages (N,) (sums over each sequence's real tokens) -> scalar loss.
    """
    # A sequence is a single "token" of the token-level loss, so reuse it with an all-real (N, 1) mask.
    every_sequence = torch.ones_like(logp_sum, dtype=torch.bool)[:, None]
    return policy_loss(logp_sum[:, None], old_logp_sum[:, None], advantages[:, None], every_sequence, cliprange)
