import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algorithms.common import (
    apply_missing_eos_penalty,
    as_groups,
    first_true_indices,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    truncate_after_eos,
)

NAN, INF = float("nan"), float("inf")
F64 = torch.float64

# Two rows: [1, 2, | pad] and [3, 4, 5]; padded position holds NaN, which must never be read.
X = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, 5.0]], dtype=F64)
MASK = torch.tensor([[True, True, False], [True, True, True]])


def test_masked_sum_and_mean_ignore_nan_at_padding():
    assert_close(masked_sum(X, MASK), torch.tensor(15.0, dtype=F64))  # 1+2+3+4+5
    assert_close(masked_mean(X, MASK), torch.tensor(3.0, dtype=F64))  # 15 / 5
    assert_close(masked_sum(X, MASK, dim=1), torch.tensor([3.0, 12.0], dtype=F64))
    assert_close(masked_mean(X, MASK, dim=1), torch.tensor([1.5, 4.0], dtype=F64))  # 3/2, 12/3


def test_masked_mean_of_nothing_is_zero_with_grad():
    x = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    out = masked_mean(x, torch.tensor([False, False]))
    out.backward()
    assert out.item() == 0.0
    assert_close(x.grad, torch.zeros(2, dtype=F64))


def test_masked_var_unbiased_and_biased():
    # Real values 1,2,3,4,5: mean 3, squared deviations 4+1+0+1+4 = 10.
    assert_close(masked_var(X, MASK), torch.tensor(10.0 / 4, dtype=F64))
    assert_close(masked_var(X, MASK, unbiased=False), torch.tensor(10.0 / 5, dtype=F64))


def test_masked_var_of_too_few_values_is_zero_and_whitens_to_zero():
    """One value (unbiased) or none: variance 0, not a ValueError (checking the count reads the device) nor a NaN."""
    one = torch.tensor([[True, False, False], [False, False, False]])
    assert_close(masked_var(X, one), torch.tensor(0.0, dtype=F64))
    assert_close(masked_var(X, one, unbiased=False), torch.tensor(0.0, dtype=F64))
    assert_close(masked_var(X, torch.zeros_like(one)), torch.tensor(0.0, dtype=F64))
    assert_close(masked_whiten(X, one), torch.zeros_like(X))


def test_masked_whiten():
    # mean 3, unbiased var 2.5 -> (x - 3) / sqrt(2.5 + 1e-8); padding -> 0.
    s = math.sqrt(2.5 + 1e-8)
    expected = torch.tensor([[-2 / s, -1 / s, 0.0], [0.0, 1 / s, 2 / s]], dtype=F64)
    assert_close(masked_whiten(X, MASK), expected)
    # shift_mean=False adds the mean 3 back on real tokens only.
    expected_kept = torch.tensor([[3 - 2 / s, 3 - 1 / s, 0.0], [3.0, 3 + 1 / s, 3 + 2 / s]], dtype=F64)
    assert_close(masked_whiten(X, MASK, shift_mean=False), expected_kept)


def test_first_true_indices():
    bools = torch.tensor([[False, True, True], [False, False, False], [True, False, True]])
    assert_close(first_true_indices(bools), torch.tensor([1, 3, 0]))
    assert first_true_indices(bools).dtype == torch.long


def test_truncate_after_eos_cases():
    eos, pad = 2, 0
    responses = torch.tensor(
        [
            [5, 2, 7, 2],  # EOS at 1: keep [5, 2], pad the rest (including the second EOS)
            [2, 5, 6, 7],  # EOS at position 0: only the EOS is real
            [5, 6, 7, 8],  # no EOS: unchanged, all real
        ]
    )
    tokens, mask, has_eos = truncate_after_eos(responses, eos, pad)
    assert_close(tokens, torch.tensor([[5, 2, 0, 0], [2, 0, 0, 0], [5, 6, 7, 8]]))
    assert_close(mask, torch.tensor([[True, True, False, False], [True, False, False, False], [True] * 4]))
    assert_close(has_eos, torch.tensor([True, True, False]))


def test_truncate_after_eos_when_pad_equals_eos():
    # Pythia-like: pad id == EOS id == 0. The first 0 is a real EOS; later zeros are padding.
    responses = torch.tensor([[5, 6, 0, 0], [5, 0, 9, 9], [5, 6, 7, 8]])
    tokens, mask, has_eos = truncate_after_eos(responses, eos_token_id=0, pad_token_id=0)
    assert_close(tokens, torch.tensor([[5, 6, 0, 0], [5, 0, 0, 0], [5, 6, 7, 8]]))
    assert_close(mask.sum(1), torch.tensor([3, 2, 4]))  # up to and including the first 0
    assert_close(has_eos, torch.tensor([True, True, False]))


def test_apply_missing_eos_penalty_replaces_score():
    scores = torch.tensor([0.5, 2.0, -3.0])
    out = apply_missing_eos_penalty(scores, torch.tensor([True, False, False]), penalty=-1.0)
    assert_close(out, torch.tensor([0.5, -1.0, -1.0]))  # replaced, not offset (2 - 1 would be 1)


def test_logprobs_from_logits_by_hand():
    # One position, vocabulary of 2, logits [0, ln 3] -> p = [1/4, 3/4].
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]], dtype=F64)
    tokens = torch.tensor([[1, 0]])
    assert_close(logprobs_from_logits(logits, tokens, 1.0), torch.tensor([[math.log(0.75), math.log(0.25)]], dtype=F64))
    # Temperature 2 halves the logits: exp -> [1, sqrt 3], p(1) = sqrt3 / (1 + sqrt3).
    p1 = math.sqrt(3) / (1 + math.sqrt(3))
    assert_close(logprobs_from_logits(logits, tokens, 2.0), torch.tensor([[math.log(p1), math.log(1 - p1)]], dtype=F64))


def test_logprobs_upcast_bf16_and_reject_bad_temperature():
    logits = torch.zeros(2, 3, 4, dtype=torch.bfloat16)  # uniform over 4 tokens
    out = logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long), 0.7)
    assert out.dtype == torch.float32
    assert_close(out, torch.full((2, 3), -math.log(4.0)))
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long), 0.0)


def test_logprobs_gradient_flows():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], dtype=F64, requires_grad=True)
    logprobs_from_logits(logits, torch.tensor([[1]]), 1.0).sum().backward()
    # d log p_1 / d z = onehot(1) - p = [-1/4, 1/4].
    assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]], dtype=F64))


def test_kl_estimators_by_hand():
    # pi(y) = 1/2, ref(y) = 1/4: log ratio logp - ref = ln 2.
    logp = torch.tensor([[math.log(0.5)]], dtype=F64)
    ref = torch.tensor([[math.log(0.25)]], dtype=F64)
    ln2 = math.log(2.0)
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([[ln2]], dtype=F64))
    assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([[0.5 * ln2**2]], dtype=F64))
    # k3: ref - logp = -ln 2 -> exp = 1/2 -> 1/2 - 1 + ln 2.
    assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([[0.5 - 1 + ln2]], dtype=F64))
    # Equal distributions give 0 for every estimator.
    for name in ("k1", "k2", "k3"):
        assert_close(kl_penalty(logp, logp, name), torch.zeros(1, 1, dtype=F64))


def test_kl_unknown_estimator_is_named():
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_as_groups_layout_and_errors():
    # Prompt-major: rows 0..2 belong to prompt 0, rows 3..5 to prompt 1.
    assert_close(as_groups(torch.arange(6), 3), torch.tensor([[0, 1, 2], [3, 4, 5]]))
    with pytest.raises(ValueError, match="k"):
        as_groups(torch.arange(6), 1)
    with pytest.raises(ValueError, match="multiple"):
        as_groups(torch.arange(7), 2)
    with pytest.raises(ValueError, match="shape"):
        as_groups(torch.zeros(2, 2), 2)
