import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algorithms.rloo import rloo_advantages, sequence_policy_loss, token_policy_loss

F64 = torch.float64


def test_rloo_rewards_1_to_12_k4_prompt_major():
    # Rows 0-3 are prompt 0 (rewards 1..4), 4-7 prompt 1 (5..8), 8-11 prompt 2 (9..12).
    # A_i = R_i - (group sum - R_i) / 3, e.g. A_0 = 1 - (2+3+4)/3 = -2, A_5 = 6 - (5+7+8)/3 = -2/3.
    adv = rloo_advantages(torch.arange(1.0, 13.0, dtype=F64), k=4)
    group = [1 - (2 + 3 + 4) / 3, 2 - (1 + 3 + 4) / 3, 3 - (1 + 2 + 4) / 3, 4 - (1 + 2 + 3) / 3]
    assert_close(adv, torch.tensor(group * 3, dtype=F64))  # a constant shift per group cancels
    assert_close(adv[5], torch.tensor(6 - (5 + 7 + 8) / 3, dtype=F64))


def test_rloo_k2_is_the_difference_and_groups_sum_to_zero():
    adv = rloo_advantages(torch.tensor([3.0, 1.0, -1.0, -1.0], dtype=F64), k=2)
    assert_close(adv, torch.tensor([3.0 - 1.0, 1.0 - 3.0, 0.0, 0.0], dtype=F64))  # tie -> both 0


def test_rloo_rejects_bad_k():
    with pytest.raises(ValueError, match="k"):
        rloo_advantages(torch.zeros(4), k=1)
    with pytest.raises(ValueError, match="multiple"):
        rloo_advantages(torch.zeros(5), k=2)


def test_sequence_loss_uses_one_ratio_per_sequence():
    # Sequence log-prob sums moved by ln 1.5 and ln 0.5; cliprange 0.2.
    #   seq0: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped)
    #   seq1: A=+2, r=0.5 -> max(-1.0, -1.6) = -1.0 (unclipped)
    old = torch.tensor([-10.0, -20.0], dtype=F64)
    logp_sum = (old + torch.tensor([math.log(1.5), math.log(0.5)], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, 2.0], dtype=F64)
    loss, stats = sequence_policy_loss(logp_sum, old, adv, cliprange=0.2)
    assert_close(loss, torch.tensor((-1.2 - 1.0) / 2, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(0.5, dtype=F64))
    assert_close(stats["approxkl"], torch.tensor(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 2, dtype=F64))
    assert_close(stats["ratio"], torch.tensor((1.5 + 0.5) / 2, dtype=F64))
    loss.backward()
    # seq0 clipped: no gradient; seq1: d(-A r)/d logp_sum = -A r = -2 * 0.5, over N = 2.
    assert_close(logp_sum.grad, torch.tensor([0.0, -1.0 / 2], dtype=F64))


def test_sequence_loss_on_policy_is_minus_mean_advantage():
    s = torch.tensor([-3.0, -4.0, -5.0], dtype=F64)
    loss, stats = sequence_policy_loss(s, s.clone(), torch.tensor([1.0, -2.0, 4.0], dtype=F64), cliprange=0.2)
    assert_close(loss, torch.tensor(-(1.0 - 2.0 + 4.0) / 3, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(0.0, dtype=F64))


def test_the_decoupled_loss_is_token_level_with_each_sequences_advantage_on_its_tokens():
    # Sequence 0: 2 real tokens, ratios 1.5 and 1 against pi_prox; sequence 1: 1 real token (then padding), ratio 0.5.
    # A = +1, +2; behaviour weights 0.5, 0 (masked) and 2. Per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   max(-1.5, -1.2) = -1.2   max(-1, -1) = -1   max(-1.0, -1.6) = -1.0
    # weighted: 0.5 * -1.2 + 0 * -1 + 2 * -1.0 = -2.6, over the 3 real tokens
    mask = torch.tensor([[True, True], [True, False]])
    prox = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=F64)
    logp = (prox + torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 7.0]], dtype=F64)).requires_grad_(True)
    weights = torch.tensor([[0.5, 0.0], [2.0, 0.0]], dtype=F64)
    adv = torch.tensor([1.0, 2.0], dtype=F64)
    loss, stats = token_policy_loss(logp, prox, adv, mask, 0.2, weights)
    assert_close(loss, torch.tensor(-2.6 / 3, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(1 / 3, dtype=F64))
    loss.backward()
    # token (0, 0) clipped, (0, 1) masked, (1, 1) padding: no gradient; (1, 0): -w A r / 3 = -2 * 2 * 0.5 / 3
    assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-2.0 / 3, 0.0]], dtype=F64))
