import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algorithms.dpo import dpo_loss, select_pairs

F64 = torch.float64
NAN = float("nan")


def test_select_pairs_best_vs_worst_global_rows():
    # k=3, prompt-major: prompt 0 = rows 0-2, prompt 1 = rows 3-5 (all tied).
    chosen, rejected, valid = select_pairs(torch.tensor([0.1, 0.9, 0.5, 0.3, 0.3, 0.3]), k=3)
    assert_close(chosen[:1], torch.tensor([1]))
    assert_close(rejected[:1], torch.tensor([0]))
    assert_close(valid, torch.tensor([True, False]))
    assert chosen.dtype == rejected.dtype == torch.long


def test_select_pairs_k2_second_wins_and_penalised_tie_dropped():
    # Prompt 0: rows 0,1 -> row 1 better. Prompt 1: rows 2,3 -> row 2 better. Prompt 2: both -1 (no EOS).
    chosen, rejected, valid = select_pairs(torch.tensor([1.0, 2.0, 5.0, -1.0, -1.0, -1.0]), k=2)
    assert_close(chosen[:2], torch.tensor([1, 2]))
    assert_close(rejected[:2], torch.tensor([0, 3]))
    assert_close(valid, torch.tensor([True, True, False]))  # the original would train row 4 as "chosen"


def test_select_pairs_rejects_k1():
    with pytest.raises(ValueError, match="k"):
        select_pairs(torch.zeros(3), k=1)


def _pairs():
    # Pair 0: S_w - S_l = 1, R_w - R_l = -1 -> h = 2.  Pair 1: h = 0.  Pair 2: invalid, full of NaN.
    chosen = torch.tensor([-1.0, -3.0, NAN], dtype=F64, requires_grad=True)
    rejected = torch.tensor([-2.0, -3.0, NAN], dtype=F64, requires_grad=True)
    ref_chosen = torch.tensor([-1.5, -2.0, NAN], dtype=F64)
    ref_rejected = torch.tensor([-0.5, -2.0, NAN], dtype=F64)
    valid = torch.tensor([True, True, False])
    return chosen, rejected, ref_chosen, ref_rejected, valid


def test_dpo_sigmoid_by_hand():
    chosen, rejected, ref_c, ref_r, valid = _pairs()
    loss, stats = dpo_loss(chosen, rejected, ref_c, ref_r, valid, beta=0.5, loss_type="sigmoid")
    # -log sigmoid(0.5 * 2) = log(1 + e^-1); -log sigmoid(0) = ln 2; mean over the 2 valid pairs.
    assert_close(loss, torch.tensor((math.log(1 + math.exp(-1)) + math.log(2)) / 2, dtype=F64))
    # Implicit rewards beta*(S - R): chosen [0.5*0.5, 0.5*-1] , rejected [0.5*-1.5, 0.5*-1].
    assert_close(stats["chosen_reward"], torch.tensor((0.25 - 0.5) / 2, dtype=F64))
    assert_close(stats["rejected_reward"], torch.tensor((-0.75 - 0.5) / 2, dtype=F64))
    assert_close(stats["accuracy"], torch.tensor(0.5, dtype=F64))  # pair 0 strictly better, pair 1 equal
    assert_close(stats["margin"], torch.tensor((1.0 + 0.0) / 2, dtype=F64))
    loss.backward()
    # d/dS_w [-log sigmoid(beta h)] = -beta * (1 - sigmoid(beta h)); /2 pairs; invalid pair gets 0 (not NaN).
    sig1 = 1 / (1 + math.exp(-1))
    expected = torch.tensor([-0.5 * (1 - sig1) / 2, -0.5 * 0.5 / 2, 0.0], dtype=F64)
    assert_close(chosen.grad, expected)
    assert_close(rejected.grad, -expected)


def test_dpo_ipo_by_hand():
    chosen, rejected, ref_c, ref_r, valid = _pairs()
    loss, _ = dpo_loss(chosen, rejected, ref_c, ref_r, valid, beta=0.25, loss_type="ipo")
    # target 1/(2*0.25) = 2: (2 - 2)^2 = 0 and (0 - 2)^2 = 4 -> mean 2.
    assert_close(loss, torch.tensor((0.0 + 4.0) / 2, dtype=F64))


def test_dpo_no_valid_pair_is_zero_with_grad():
    chosen, rejected, ref_c, ref_r, _ = _pairs()
    loss, stats = dpo_loss(chosen, rejected, ref_c, ref_r, torch.zeros(3, dtype=torch.bool), 0.1, "sigmoid")
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert_close(chosen.grad, torch.zeros(3, dtype=F64))
    assert all(v.item() == 0.0 for v in stats.values())


def test_dpo_unknown_loss_type_is_named():
    chosen, rejected, ref_c, ref_r, valid = _pairs()
    with pytest.raises(ValueError, match="'hinge'"):
        dpo_loss(chosen, rejected, ref_c, ref_r, valid, 0.1, "hinge")
