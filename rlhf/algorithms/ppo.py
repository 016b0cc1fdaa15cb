"""PPO for language models: KL-shaped token rewards, GAE, clipped policy and value losses.

Source: Schulman et al. 2017 (PPO), Ziegler et al. 2019 / Huang et al. 2024 "N+ implementation details of
RLHF with PPO"; original `PPOv2Trainer` (§3.6) with its score off-by-one fixed.
Shapes: N sequences, T response tokens; masks are bool, True = real response token (EOS included).
Stats are 0-dim detached float tensors (call `float(v)` to log them).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.common import as_dtype, first_true_indices, masked_mean, masked_means, masked_var


def token_rewards(
    scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token RL reward: -kl_coef * kl on every real token, plus the score on the last real token.

    Source: original §3.6 step 3, but the score lands on the LAST REAL token (the EOS if present, else T-1);
    the original put it one past the EOS, where the policy never acts.
    Shapes: scores (N,), kl (N, T), mask (N, T) bool -> rewards (N, T), non_score_reward (N, T); both 0
    on padding.
    """
    non_score_reward = -kl_coef * torch.where(mask, kl, 0.0)
    # Last True position = T-1 minus the first True of the reversed row (masks are prefixes, but this holds anyway).
    # Every row has one (truncate_after_eos keeps the first token); not checked here: a read of the device.
    row_len = mask.size(1)
    last_real = row_len - 1 - first_true_indices(mask.flip(1))
    at_last = torch.arange(row_len, device=mask.device)[None, :] == last_real[:, None]
    rewards = non_score_reward + torch.where(at_last, as_dtype(scores, non_score_reward.dtype)[:, None], 0.0)
    return rewards, non_score_reward


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    Source: Schulman et al. 2016; original §3.6 step 5 (whitening is left to the caller:
    `common.masked_whiten(advantages, mask)`, as the original does).
        delta_t = r_t + gamma * V_{t+1} - V_t      (V after the last real token is 0: the episode ended)
        A_t     = delta_t + gamma * lam * A_{t+1}
        G_t     = A_t + V_t
    Call with detached tensors; masks are prefixes (a response up to its EOS), as every batch's are. Shapes:
    rewards, values (N, T), mask (N, T) bool -> advantages (N, T), returns (N, T); both 0 on padding, and padded
    rewards/values are never read.
    Unrolled, A_t = sum_{s >= t} (gamma * lam)^(s - t) * delta_s: one product with the (T, T) discount matrix, where a
    loop over T launched ~6 ops a token (318 at the TL;DR task's 53 tokens). Past the last real token every delta
    is 0, so padding adds nothing to earlier tokens.
    """
    rewards = torch.where(mask, rewards, 0.0)
    values = torch.where(mask, values, 0.0)  # so V_{t+1} = 0 just past the last real token
    deltas = rewards + gamma * torch.nn.functional.pad(values[:, 1:], (0, 1)) - values
    steps = torch.arange(rewards.size(1), device=rewards.device)
    lag = steps[:, None] - steps[None, :]  # [s, t] = s - t
    discount = torch.where(lag >= 0, (gamma * lam) ** lag.clamp(min=0).to(deltas.dtype), 0.0)
    advantages = torch.where(mask, deltas @ discount, 0.0)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over the real tokens: the share of the returns' variance the critic's
    values explain (1 all, 0 no better than their mean, < 0 worse).

    Source: CleanRL ppo.py (`explained_var`, once per batch, of the rollout's values). Shapes: values, returns (N, T),
    mask (N, T) bool -> () float.
    """
    var_returns = masked_var(returns, mask, unbiased=False)
    return 1 - masked_var(returns - values, mask, unbiased=False) / (var_returns + 1e-8)


MAX_LOG_RATIO = 20.0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cliprange: float,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO clipped surrogate: masked mean of max(-A * r, -A * clip(r, 1-eps, 1+eps)).

    Source: Schulman et al. 2017; original §3.6 step 6 (`L_pg`); TRL/cleanrl `pg_losses`, `pg_losses2`.
    r = exp(logp - old_logp) per token. Stats: clipfrac (fraction of real tokens where the clipped term is
    the max), approxkl = 0.5 * masked_mean((logp - old_logp)^2), ratio = masked mean of r.
    weights: None, or constant per-token weights (N, T) of the surrogate, the mean still over every real token:
    AReaL's decoupled objective, with old_logp = pi_prox and weights pi_prox / pi_behav, 0 on the tokens it masks
    (rlhf.algorithms.decoupled). The stats are of the unweighted terms, as AReaL's.
    Shapes: logp, old_logp, advantages (N, T), mask (N, T) bool -> scalar loss, stats.
    """
    # Zero padded inputs first: garbage (even inf/NaN) there can then reach neither the loss nor its gradient.
    log_ratio = torch.where(mask, logp, 0.0) - torch.where(mask, old_logp, 0.0)
    neg_advantages = torch.where(mask, -advantages, 0.0)
    # exp() overflows fp32 past a log-ratio of ~88: inf * 0 in the backward of the clipped branch is a NaN
    # gradient. Capped at MAX_LOG_RATIO (r ~ 5e8, far outside any clip range) the loss and gradient stay finite.
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    pg_losses = neg_advantages * ratio
    pg_losses_clipped = neg_advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    surrogate = torch.maximum(pg_losses, pg_losses_clipped)
    if weights is not None:
        surrogate = torch.where(mask, weights, 0.0) * surrogate
    loss = masked_mean(surrogate, mask)
    with torch.no_grad():
        clipped = (pg_losses_clipped > pg_losses).to(ratio.dtype)
        stats = masked_means({"clipfrac": clipped, "approxkl": 0.5 * log_ratio**2, "ratio": ratio}, mask)
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * masked_mean(max((V - G)^2, (clip(V, V_old - eps, V_old + eps) - G)^2)).

    Source: original §3.6 step 6 (`L_v`), averaged over real tokens only (the original also trained the
    value one past the EOS). Stats: clipfrac (fraction of real tokens where the clipped term is the max).
    Shapes: values, old_values, returns (N, T), mask (N, T) bool -> scalar loss, stats.
    """
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf_losses = (values - returns) ** 2
    vf_losses_clipped = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(vf_losses, vf_losses_clipped), mask)
    with torch.no_grad():
        stats = {"clipfrac": masked_mean((vf_losses_clipped > vf_losses).to(values.dtype), mask)}
    return loss, stats
