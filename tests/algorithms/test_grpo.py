import math

import pytest
import torch
from torch.testing import assert_close

from rlhf.algorithms.grpo import group_advantages, grpo_loss

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
EPS = 1e-4


def test_group_advantages_by_hand_k3():
    # Prompt 0: [1, 2, 3] -> mean 2, unbiased std 1.
    # Prompt 1: [0, 0, 6] -> mean 2, deviations [-2, -2, 4], var (4+4+16)/2 = 12, std 2*sqrt(3).
    # Prompt 2: [5, 5, 5] -> all tied: zero advantage.
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0, 5.0, 5.0, 5.0], dtype=F64)
    s1 = 2 * math.sqrt(3)
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), -2 / (s1 + EPS), -2 / (s1 + EPS), 4 / (s1 + EPS), 0.0, 0.0, 0.0]
    assert_close(group_advantages(rewards, k=3), torch.tensor(expected, dtype=F64))
    assert_close(group_advantages(rewards, k=3, scale=False), torch.tensor([-1, 0, 1, -2, -2, 4, 0, 0, 0], dtype=F64))


def test_group_advantages_k2_and_bad_k():
    # [0, 1]: mean 0.5, deviations -/+0.5, unbiased var 0.5 -> std sqrt(0.5).
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=F64), k=2, eps=0.0)
    assert_close(adv, torch.tensor([-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5)], dtype=F64))
    with pytest.raises(ValueError, match="k"):
        group_advantages(torch.zeros(3), k=1)


def _batch():
    # Two sequences: lengths 2 and 1 (mask below), advantages +1 and -1.
    mask = torch.tensor([[True, True, False], [True, False, False]])
    logp = torch.tensor([[math.log(0.5), -1.0, 0.0], [-2.0, 0.0, 0.0]], dtype=F64)
    ref = logp.clone()
    ref[0, 0] = math.log(0.25)  # the only token where pi != ref: k3 = 1/2 - 1 + ln 2
    return logp, ref, torch.tensor([1.0, -1.0], dtype=F64), mask


def test_grpo_loss_on_policy_by_hand():
    logp, ref, adv, mask = _batch()
    logp.requires_grad_(True)
    loss, stats = grpo_loss(logp, logp.detach().clone(), ref, adv, mask, cliprange=0.2, kl_coef=0.1)
    k3 = 0.5 - 1 + math.log(2.0)
    # Ratio 1 everywhere: surrogate = -(A on each real token) averaged over 3 real tokens = -(1 + 1 - 1)/3.
    assert_close(loss, torch.tensor(-(1 + 1 - 1) / 3 + 0.1 * k3 / 3, dtype=F64))
    assert_close(stats["kl"], torch.tensor(k3 / 3, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(0.0, dtype=F64))
    assert_close(stats["approxkl"], torch.tensor(0.0, dtype=F64))
    assert set(stats) == {"clipfrac", "approxkl", "kl"}
    loss.backward()
    # Surrogate: d(-A r)/d logp = -A; k3: d/d logp = 1 - exp(ref - logp) = 1 - 1/2 on token (0,0), else 0.
    expected = torch.tensor([[-1 + 0.1 * 0.5, -1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64) / 3
    assert_close(logp.grad, expected)


def test_grpo_loss_clipping_active():
    # One token, A = +1, ratio 1.5 > 1.2: the clipped term -1.2 wins, so no policy gradient.
    logp = torch.tensor([[math.log(1.5)]], dtype=F64, requires_grad=True)
    zero = torch.zeros(1, 1, dtype=F64)
    loss, stats = grpo_loss(
        logp,
        zero,
        logp.detach().clone(),
        torch.tensor([1.0], dtype=F64),
        torch.ones(1, 1, dtype=torch.bool),
        cliprange=0.2,
        kl_coef=0.5,
    )
    assert_close(loss, torch.tensor(-1.2, dtype=F64))  # KL term is 0 (ref = logp)
    assert_close(stats["clipfrac"], torch.tensor(1.0, dtype=F64))
    loss.backward()
    assert_close(logp.grad, torch.zeros(1, 1, dtype=F64))


def test_grpo_loss_padding_changes_nothing():
    logp, ref, adv, mask = _batch()
    outs = []
    for garbage in (0.0, NAN, -INF):
        lp, r, old = logp.clone(), ref.clone(), logp.clone()
        lp[0, 2] = lp[1, 1] = garbage
        r[0, 2] = r[1, 2] = -garbage
        old[1, 2] = garbage
        lp.requires_grad_(True)
        loss, stats = grpo_loss(lp, old, r, adv, mask, cliprange=0.2, kl_coef=0.1)
        loss.backward()
        outs.append((loss.detach(), stats, lp.grad))
    for loss, stats, grad in outs[1:]:
        assert_close(loss, outs[0][0])
        assert_close(stats, outs[0][1])
        assert_close(grad, outs[0][2])


def test_grpo_behaviour_weights_scale_the_surrogate_not_the_kl_term():
    logp, ref, adv, mask = _batch()
    weights = torch.tensor([[2.0, 0.0, 0.0], [0.5, 0.0, 0.0]], dtype=F64)  # token (0, 1) masked by the cap
    loss, stats = grpo_loss(logp, logp.clone(), ref, adv, mask, cliprange=0.2, kl_coef=0.1, weights=weights)
    k3 = 0.5 - 1 + math.log(2.0)
    # Ratio 1: surrogate -(2 * 1 + 0 * 1 + 0.5 * -1) over the 3 real tokens; the k3 term unweighted, as before
    assert_close(loss, torch.tensor(-(2 * 1 + 0 * 1 + 0.5 * -1) / 3 + 0.1 * k3 / 3, dtype=F64))
    assert_close(stats["kl"], torch.tensor(k3 / 3, dtype=F64))
