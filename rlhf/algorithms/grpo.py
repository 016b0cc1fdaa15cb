"""Group Relative Policy Optimisation (GRPO): group-normalised sequence advantages, token-level clipped
surrogate and a k3 KL(pi || ref) loss term.

Source: Shao et al. 2024 (DeepSeekMath), TRL `GRPOTrainer`. Not in the original system.
Shapes: B prompts, K samples per prompt, N = B*K sequences, rows prompt-major (row b*K + j); T tokens.
Stats are 0-dim detached float tensors (call `float(v)` to log them).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.common import as_groups, kl_penalty, masked_mean
from rlhf.algorithms.ppo import policy_loss


def group_advantages(rewards: torch.Tensor, k: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """A_i = (R_i - mean of its group) / (std of its group + eps); only mean-centred when scale=False.

    Source: DeepSeekMath §4.1.2 (outcome supervision); TRL GRPO (unbiased std, eps 1e-4; `scale_rewards`).
    A group of equal rewards gets zero advantages. Shapes: rewards (N,) -> (N,).
    Raises ValueError when k < 2 or N % k != 0.
    """
    grouped = as_groups(rewards, k)
    advantages = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(dim=1, keepdim=True, unbiased=True) + eps)
    return advantages.reshape(-1)


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    kl_coef: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped surrogate with each sequence's advantage on all its tokens, plus kl_coef * k3 KL.

    Source: DeepSeekMath GRPO objective / TRL GRPO: loss = masked_mean(max(-A r, -A clip(r)) + kl_coef * k3_t), where
    k3_t = exp(ref - logp) - 1 - (ref - logp). Normalised over all real tokens of the batch (TRL's
    token-level "bnpo"/DAPO form) rather than the paper's per-sequence 1/|o_i| mean.
    Stats: clipfrac, approxkl (as `ppo.policy_loss`), kl = masked mean of k3.
    weights: None, or AReaL's decoupled behaviour weights (N, T) (rlhf.algorithms.decoupled; old_logp is then
    pi_prox): they weight the clipped surrogate only, as AReaL's loss (whose KL penalty sits in the reward) does;
    the k3 term stays a plain mean over the real tokens.
    Shapes: logp, old_logp, ref_logp (N, T), advantages (N,), mask (N, T) bool -> scalar loss, stats.
    """
    token_advantages = advantages[:, None].expand_as(logp)
    pg_loss, pg_stats = policy_loss(logp, old_logp, token_advantages, mask, cliprange, weights)
    # Zero padded positions before exp() in k3: garbage there must not overflow into the gradient.
    kl = kl_penalty(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0), "k3")
    kl_mean = masked_mean(kl, mask)
    # masked_mean is linear, so this equals the masked mean of the per-token sum (pg_t + kl_coef * kl_t).
    loss = pg_loss + kl_coef * kl_mean
    stats = {"clipfrac": pg_stats["clipfrac"], "approxkl": pg_stats["approxkl"], "kl": kl_mean.detach()}
    return loss, stats
