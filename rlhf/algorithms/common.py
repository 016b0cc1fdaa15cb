"""Masked reductions, response post-processing, log-probs and KL estimators shared by every algorithm.

Shape legend used in every docstring of this package:
    B prompts, K samples per prompt, N = B*K sequences, T response tokens, V vocabulary size.

Conventions:
- A mask is a bool tensor, True = a real response token (the EOS token counts as real).
- Groups are prompt-major: the K samples of prompt b sit in adjacent rows b*K .. b*K+K-1
  (prompts were `repeat_interleave`d), so `values.view(B, K)` puts one prompt per row.
- Masked reductions select with `torch.where`, never `x * mask`: a NaN or inf at a padded position
  would survive the product (nan * 0 = nan), while `where` never reads it.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over positions where `mask` is True.

    Shapes: x and mask the same shape (typically (N, T)); the result is a scalar when `dim` is None,
    otherwise `x` reduced over `dim` (e.g. (N,) for dim=1).
    """
    selected = torch.where(mask, x, 0.0)
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over positions where `mask` is True (scalar, or reduced over `dim`).

    An all-False mask (or row, with `dim`) gives 0 rather than NaN, so a loss over zero real items is a
    zero that still carries a grad_fn. Shapes as in `masked_sum`.
    """
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_means(named: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """`masked_mean` of several same-shape tensors over one mask, as 0-dim tensors by name: one stack, one reduction
    and one count for all (~8 ops, where a `masked_mean` each is 5: on a GPU a kernel each). For metrics: the
    reduction order may differ from `masked_mean`'s in the last bit.
    Shapes: each value and mask (N, T) (or any equal shapes) -> {name: ()}.
    """
    stacked = torch.where(mask, torch.stack(list(named.values())), 0.0)
    means = stacked.flatten(1).sum(1) / mask.sum().clamp(min=1)
    return dict(zip(named, means.unbind()))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all positions where `mask` is True (a scalar).

    Source: TRL `masked_var` (Bessel-corrected when `unbiased`, as the original whitens advantages), without its
    check of the count: reading it would make the host wait for the device. Too few positions (one when unbiased,
    none) give a variance of 0, so whitening them gives 0, not NaN.
    Shapes: x, mask (N, T) or any equal shapes.
    """
    count = mask.sum()
    centred = x - masked_mean(x, mask)
    return masked_sum(centred**2, mask) / (count - 1 if unbiased else count).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Whiten `x` with the mean and (unbiased) variance of its masked positions; 0 where `mask` is False.

    Source: TRL `masked_whiten` (PPO advantages use shift_mean=True; rewards shift_mean=False keeps the mean).
    Shapes: x, mask (N, T) -> (N, T).
    """
    # masked_mean then masked_var, their count and mean computed once (the same ops in the same order: the same bits)
    count = mask.sum()
    mean = masked_sum(x, mask) / count.clamp(min=1)
    centred = x - mean
    var = masked_sum(centred**2, mask) / (count - 1).clamp(min=1)
    whitened = centred * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0)


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row, or T if the row has none.

    Source: TRL `first_true_indices`. Shapes: bools (N, T) bool -> (N,) long.
    """
    row_len = bools.size(-1)
    positions = torch.arange(row_len, device=bools.device)
    # False positions are pushed past the row end, so the minimum is the first True (or >= T if none).
    candidates = torch.where(bools, positions, row_len)
    return candidates.min(dim=-1).values  # long, as the positions


def truncate_after_eos(
    responses: torch.Tensor, eos_token_id: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep each response up to and including its first EOS; pad everything after it.

    Source: original §2.2 steps 1-3 (TRL `truncate_response`). Validity comes from the position of the
    first EOS, never from pad ids, because pad may equal EOS (e.g. Pythia: both 0).
    Shapes: responses (N, T) long -> tokens (N, T) long, mask (N, T) bool (True up to and including the
    first EOS; all True without an EOS), has_eos (N,) bool.
    """
    eos_index = first_true_indices(responses == eos_token_id)  # T when there is no EOS
    positions = torch.arange(responses.size(1), device=responses.device)
    mask = positions[None, :] <= eos_index[:, None]
    tokens = torch.where(mask, responses, pad_token_id)
    has_eos = eos_index < responses.size(1)
    return tokens, mask, has_eos


def apply_missing_eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    """Replace (not offset) the score of every sample without an EOS by `penalty`.

    Source: original §2.2 step 5 (`non_eos_penalty`, `penalty_reward_value = -1`).
    Shapes: scores (N,), has_eos (N,) bool -> (N,).
    """
    return torch.where(has_eos, scores, torch.full_like(scores, penalty))


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`, without dispatching an op when it is in `dtype` already (a no-op `.to` is still one)."""
    return t if t.dtype == dtype else t.to(dtype)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) gathered at `tokens`: the tempered policy's log-prob per token.

    Source: original §2.2 step 6 (without its `+1e-7`). One fused log_softmax over the whole batch, then the gather:
    fewer kernels forward and backward than TRL's `selective_log_softmax` (z_y - logsumexp(z), whose logsumexp is
    5 kernels), 1.7x faster forward + backward at (8, 9, 512) and 2.2x at (64, 53, 512) on the CPU, and it keeps
    one (N, T, V) tensor for the backward, as logsumexp does. Low-precision logits are upcast.
    Shapes: logits (N, T, V), tokens (N, T) long -> (N, T) float (float32 or wider).
    """
    _check_temperature(temperature)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return (as_dtype(logits, dtype) / temperature).log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi.

    Source: Schulman, "Approximating KL divergence" (2020); OpenRLHF `compute_approx_kl`.
      k1 = log pi - log ref                      (unbiased, can be negative; the original's only form)
      k2 = 0.5 * (log pi - log ref)^2            (biased, low variance)
      k3 = exp(log ref - log pi) - 1 - (log ref - log pi)   (unbiased, always >= 0; GRPO)
    Padded positions are not masked here: callers mask. Shapes: logp, ref_logp (N, T) -> (N, T).
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if estimator == "k3":
        log_ratio = ref_logp - logp
        return torch.exp(log_ratio) - 1 - log_ratio
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {KL_ESTIMATORS}")


def as_groups(values: torch.Tensor, k: int) -> torch.Tensor:
    """View per-sequence values as one row per prompt, checking the group layout.

    Rows are prompt-major (row b*K + j is sample j of prompt b), so a plain view gives (B, K).
    Shapes: values (N,) -> (B, K). Raises ValueError if k < 2 (nothing to compare within a group),
    if `values` is not 1-D, or if N is not a multiple of k.
    """
    if k < 2:
        raise ValueError(f"k (samples per prompt) must be >= 2, got {k}")
    if values.dim() != 1:
        raise ValueError(f"expected per-sequence values of shape (N,), got shape {tuple(values.shape)}")
    if values.numel() % k != 0:
        raise ValueError(f"number of sequences N={values.numel()} is not a multiple of k={k}")
    return values.view(-1, k)
