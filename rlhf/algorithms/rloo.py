"""REINFORCE Leave-One-Out (RLOO) with the original's sequence-level PPO-style clipping (token-level under AReaL's
decoupled objective).

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


def token_policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RLOO under AReaL's decoupled objective (train.decoupled_cap): a clipped surrogate per TOKEN, its ratio
    r_t = exp(logp_t - prox_logp_t) against the learner's weights when the update started, each sequence's
    leave-one-out advantage on all its tokens, times the behaviour weight w_t = pi_prox / pi_behav (0 on the tokens
    past the cap), mean over the real tokens: `ppo.policy_loss` with `weights`, as GRPO's policy term.

    Source: Fu et al. 2025 (AReaL), decoupled PPO objective; rlhf.algorithms.decoupled. Why per token rather than
    `sequence_policy_loss`'s one ratio per sequence: the decoupled objective weights, masks and clips single tokens.
    A sequence's ratio is the product of its tokens' ratios, clipped once: no per-token term is left for a behaviour
    weight to scale or a mask to remove, and weighting the whole sequence by the product of its tokens' weights is
    the per-sequence truncated importance sampling (train.tis_cap) this objective replaces.
    weights None: every token's weight is 1 (the token-level objective without a behaviour correction).
    Shapes: logp, prox_logp, weights (N, T), advantages (N,), mask (N, T) bool -> scalar loss, stats (as
    `ppo.policy_loss`: clipfrac, approxkl, ratio per real token).
    """
    token_advantages = advantages[:, None].expand_as(logp)
    return policy_loss(logp, prox_logp, token_advantages, mask, cliprange, weights)
