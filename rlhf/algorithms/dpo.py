"""Online DPO / IPO on best-vs-worst pairs of each prompt's K samples.

Source: Rafailov et al. 2023 (DPO), Azar et al. 2023 (IPO), Guo et al. 2024 (online AI feedback);
original `OnlineDPOTrainer` / `OnlineDPOVLLMTrainer` (§3.1-3.3), with tied pairs dropped (§6 item 18).
Shapes: B prompts, K samples per prompt, N = B*K sequences, rows prompt-major (row b*K + j).
Stats are 0-dim detached float tensors (call `float(v)` to log them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf.algorithms.common import as_groups, masked_mean, masked_means

LOSS_TYPES = ("sigmoid", "ipo")


def select_pairs(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best (argmax) and worst (argmin) sample of each prompt's group, as global row indices.

    Source: original §3.2 (best-vs-worst of K). A pair is valid only when best > worst: tied groups
    (e.g. two samples both given the missing-EOS penalty) carry no preference and must not be trained on.
    Shapes: scores (N,) -> chosen_idx (B,) long, rejected_idx (B,) long, valid (B,) bool.
    """
    grouped = as_groups(scores, k)
    best, worst = grouped.argmax(dim=1), grouped.argmin(dim=1)
    group_start = torch.arange(grouped.size(0), device=scores.device) * k
    valid = grouped.amax(dim=1) > grouped.amin(dim=1)  # False on ties (and on NaN scores)
    return group_start + best, group_start + worst, valid


def dpo_loss(
    chosen_logp: torch.Tensor,
    rejected_logp: torch.Tensor,
    ref_chosen_logp: torch.Tensor,
    ref_rejected_logp: torch.Tensor,
    valid: torch.Tensor,
    beta: float,
    loss_type: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO ("sigmoid") or IPO loss, averaged over valid pairs only.

    Source: original §3.1 step 7. With S = policy and R = reference sequence log-prob sums,
        h = (S_w - S_l) - (R_w - R_l)
        sigmoid: -log sigmoid(beta * h)        ipo: (h - 1 / (2 * beta))^2
    No valid pair gives a zero loss still connected to the inputs (a backward yields zero gradients).
    Stats over valid pairs (0 when none): chosen_reward = mean beta*(S_w - R_w), rejected_reward likewise,
    accuracy = fraction with chosen_reward > rejected_reward, margin = mean of their difference.
    Shapes: all inputs (B,) (valid bool) -> scalar loss, stats. Raises ValueError on an unknown loss_type.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    # Zero invalid pairs first, so NaN/inf in dropped pairs reaches neither the loss nor its gradient.
    chosen_logratio = torch.where(valid, chosen_logp, 0.0) - torch.where(valid, ref_chosen_logp, 0.0)
    rejected_logratio = torch.where(valid, rejected_logp, 0.0) - torch.where(valid, ref_rejected_logp, 0.0)
    h = chosen_logratio - rejected_logratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    else:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    loss = masked_mean(losses, valid)
    with torch.no_grad():
        chosen_reward, rejected_reward = beta * chosen_logratio, beta * rejected_logratio
        margin = chosen_reward - rejected_reward
        accuracy = (margin > 0).to(h.dtype)  # chosen_reward > rejected_reward
        named = {"chosen_reward": chosen_reward, "rejected_reward": rejected_reward, "accuracy": accuracy}
        stats = masked_means({**named, "margin": margin}, valid)
    return loss, stats
