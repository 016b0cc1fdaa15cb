"""AReaL's decoupled PPO objective for batches sampled by stale weights: per-token behaviour weights, masked past a cap.

Source: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning",
the decoupled PPO objective (§5); inclusionAI/AReaL `areal/utils/functional.py` `ppo_actor_loss_fn` with
`use_decoupled_loss` and `behav_imp_weight_cap`: the variant in which a token whose weight exceeds the cap is MASKED
(weight 0, still counted in the loss's denominator), not truncated to the cap.
Three policies:
    pi_behav   the engine's weights that sampled the tokens, possibly several versions old (its own log-probs)
    pi_prox    the learner's weights when the batch's update starts (the loop's step 5 forward): the centre of the
               trust region, the PPO ratio's denominator
    pi_theta   the weights being trained
    loss = sum over real tokens t of  w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps, 1 + eps))  / (number of real tokens)
    r_t = pi_theta / pi_prox,   w_t = pi_prox / pi_behav if it is <= cap, else 0
The clipped surrogate is `ppo.policy_loss` with `weights`; this module computes the weights.
Shapes: N sequences, T response tokens; masks are bool, True = real response token (EOS included).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.common import masked_mean
from rlhf.algorithms.ppo import MAX_LOG_RATIO


@torch.no_grad()
def behaviour_weights(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w_t = exp(prox_logp - behav_logp) on each real token; 0 where w_t > cap (masked) and on padding.

    Constants of the loss (no gradient): pi_prox is fixed for the batch's whole update. A masked token keeps its place
    in the loss's denominator (AReaL divides by the real tokens, `loss_mask`, not by the kept ones).
    Stats (0-dim, detached):
        masked  share of the real tokens whose weight exceeds the cap
        weight  mean w_t over the kept tokens (AReaL's `behave_imp_weight`)
        kl      mean over the real tokens of k3 = w_t - 1 - log w_t: an estimate of KL(pi_behav || pi_prox) per
                token from the engine's own samples; >= 0, and 0 when the engine sampled with the learner's weights
    Shapes: prox_logp, behav_logp (N, T), mask (N, T) bool -> weights (N, T), stats.
    """
    prox = torch.where(mask, prox_logp, 0.0)
    behav = torch.where(mask, behav_logp, 0.0)
    # exp() overflows fp32 past a log-ratio of ~88: capped at MAX_LOG_RATIO (w ~ 5e8, past any sensible cap) the
    # masking is the same and nothing is inf.
    log_ratio = (prox - behav).clamp(max=MAX_LOG_RATIO)
    weights = torch.exp(log_ratio)
    kept = mask & (weights <= cap)
    stats = {
        "masked": masked_mean((~kept).to(weights.dtype), mask),
        "weight": masked_mean(weights, kept),
        # Schulman's k3 (common.kl_penalty) of KL(pi_behav || pi_prox): samples from pi_behav, pi_prox as the reference
        "kl": masked_mean(weights - 1 - log_ratio, mask),
    }
    return torch.where(kept, weights, 0.0), stats
