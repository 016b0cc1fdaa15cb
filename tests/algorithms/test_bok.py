import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algorithms.bok import nll_loss, select_best

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)


def test_select_best_global_rows_and_ties():
    # k=3, prompt-major: prompt 0 rows 0-2 (best row 1), prompt 1 rows 3-5 all tied, prompt 2 best row 8.
    best, valid = select_best(torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0, 5.0, 0.0, -1.0, 4.0]), k=3)
    assert_close(best[[0, 2]], torch.tensor([1, 8]))
    assert_close(valid, torch.tensor([True, False, True]))


def test_select_best_k2_penalised_tie_dropped_and_k1_rejected():
    best, valid = select_best(torch.tensor([-1.0, -1.0, 0.2, 0.7]), k=2)
    assert_close(best[1:], torch.tensor([3]))
    assert_close(valid, torch.tensor([False, True]))
    with pytest.raises(ValueError, match="k"):
        select_best(torch.zeros(2), k=1)


def test_nll_is_sequence_summed_mean_over_valid_rows():
    # Row 0: p = 1/2, 1/4 then padding -> NLL ln2 + 2 ln2 = 3 ln2 (2 tokens).
    # Row 1: p = 1/2 on one token (EOS at 0)        -> NLL ln2 (1 token).
    # Row 2: invalid (tied group), NaN everywhere   -> ignored.
    logp = torch.tensor([[-LN2, -2 * LN2, NAN], [-LN2, 123.0, NAN], [NAN, NAN, NAN]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    loss, stats = nll_loss(logp, mask, torch.tensor([True, True, False]))
    assert_close(loss, torch.tensor((3 * LN2 + LN2) / 2, dtype=F64))  # summed per sequence, not averaged
    assert_close(stats["nll"], torch.tensor((3 * LN2 + LN2) / 3, dtype=F64))  # per real token of valid rows
    loss.backward()
    # d loss / d logp = -1/2 on each real token of the 2 valid rows, 0 elsewhere.
    expected = torch.tensor([[-0.5, -0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert_close(logp.grad, expected)


def test_nll_no_valid_row_is_zero_with_grad():
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    loss, stats = nll_loss(logp, torch.tensor([[True, True]]), torch.tensor([False]))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert_close(logp.grad, torch.zeros(1, 2, dtype=F64))
    assert stats["nll"].item() == 0.0
