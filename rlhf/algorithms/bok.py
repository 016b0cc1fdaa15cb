"""Online best-of-K SFT: maximise the likelihood of each prompt's highest-scoring sample.

Source: original `OnlineBoKTrainer` (§3.4, Best-of-2, the paper's control for online DPO), generalised to
K samples and with tied groups dropped (§6 item 18).
Shapes: B prompts, K samples per prompt, N = B*K sequences, rows prompt-major (row b*K + j); T tokens.
Stats are 0-dim detached float tensors (call `float(v)` to log them).
"""

from __future__ import annotations

import torch

from rlhf.algorithms.common import as_groups, masked_mean, masked_sum


def select_best(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global row index of each prompt's best sample; invalid when all K scores tie.

    Source: original §3.4 step 5, but a group whose K scores are all equal is dropped instead of
    training on its first sample. Among several tied best samples the first is taken (any is a best one).
    Shapes: scores (N,) -> best_idx (B,) long, valid (B,) bool.
    """
    grouped = as_groups(scores, k)
    group_start = torch.arange(grouped.size(0), device=scores.device) * k
    valid = grouped.amax(dim=1) > grouped.amin(dim=1)
    return group_start + grouped.argmax(dim=1), valid


def nll_loss(
    logp: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean over valid rows of the sequence-SUMMED negative log-likelihood: -mean_i sum_t log pi(y_it).

    Source: original §3.4 step 6 (tempered log-probs come from the caller). No valid row gives a zero
    loss still connected to `logp`. Stats: nll = per-token NLL over the valid rows' real tokens (comparable
    across lengths; 0 when none is valid).
    Shapes: logp (B, T), mask (B, T) bool, valid (B,) bool -> scalar loss, stats.
    """
    token_mask = mask & valid[:, None]
    sequence_nll = -masked_sum(logp, token_mask, dim=1)  # (B,)
    loss = masked_mean(sequence_nll, valid)
    with torch.no_grad():
        stats = {"nll": masked_mean(-logp, token_mask)}
    return loss, stats
