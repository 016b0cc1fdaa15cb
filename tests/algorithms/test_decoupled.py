"""AReaL's decoupled objective (rlhf.algorithms.decoupled + ppo.policy_loss with weights), by hand on tiny tensors."""

import math

import torch
from torch.testing import assert_close

from rlhf.algorithms.decoupled import behaviour_weights
from rlhf.algorithms.ppo import policy_loss

F64 = torch.float64
NAN, INF = float("nan"), float("inf")
LN = math.log


def t(rows):
    return torch.tensor(rows, dtype=F64)


# Two sequences of 3 response tokens, the second with one padded position; 5 real tokens.
MASK = torch.tensor([[True, True, True], [True, True, False]])
PROX = t([[-1.0, -0.5, -2.0], [-0.2, -1.0, 0.0]])
# behaviour = prox - log w: the weights pi_prox / pi_behav are 2, 8, 0.5 and 1, 1.2; the padding holds garbage
BEHAV = PROX - t([[LN(2.0), LN(8.0), LN(0.5)], [0.0, LN(1.2), 0.0]])
BEHAV[1, 2] = NAN
CAP = 5.0


def test_weights_are_prox_over_behaviour_per_token_and_a_token_past_the_cap_is_masked():
    weights, stats = behaviour_weights(PROX, BEHAV, MASK, CAP)
    # 8 > cap: that token's weight is 0 (masked, not truncated to 5); its neighbours keep theirs; padding 0
    assert_close(weights, t([[2.0, 0.0, 0.5], [1.0, 1.2, 0.0]]))
    assert_close(stats["masked"], t(1 / 5))  # one of the 5 real tokens
    assert_close(stats["weight"], t((2.0 + 0.5 + 1.0 + 1.2) / 4))  # mean over the 4 kept tokens
    # k3 = w - 1 - log w per real token (the masked one included), mean over the 5
    k3 = [w - 1 - LN(w) for w in (2.0, 8.0, 0.5, 1.0, 1.2)]
    assert_close(stats["kl"], t(sum(k3) / 5))


def test_a_weight_exactly_at_the_cap_is_kept():
    weights, stats = behaviour_weights(t([[LN(5.0)]]), t([[0.0]]), torch.tensor([[True]]), CAP)
    assert_close(weights, t([[5.0]]))
    assert_close(stats["masked"], t(0.0))


def test_the_loss_is_the_weighted_surrogate_summed_over_real_tokens_divided_by_their_number():
    weights, _ = behaviour_weights(PROX, BEHAV, MASK, CAP)  # [[2, 0, 0.5], [1, 1.2, -]]
    # r = pi_theta / pi_prox: 1.5, 1, 0.5 and 1, 1.1; advantages 1, 2, -1 and -1, 0.5 (99 is padding)
    logp = PROX + t([[LN(1.5), 0.0, LN(0.5)], [0.0, LN(1.1), INF]])
    advantages = t([[1.0, 2.0, -1.0], [-1.0, 0.5, 99.0]])
    loss, stats = policy_loss(logp, PROX, advantages, MASK, 0.2, weights)
    # per token max(-A r, -A clip(r, 0.8, 1.2)):
    #   max(-1.5, -1.2) = -1.2   max(-2, -2) = -2   max(0.5, 0.8) = 0.8   max(1, 1) = 1   max(-0.55, -0.55) = -0.55
    # weighted: 2 * -1.2 + 0 * -2 + 0.5 * 0.8 + 1 * 1 + 1.2 * -0.55 = -1.66, over the 5 real tokens (the masked one
    # counts in the denominator)
    assert_close(loss, t(-1.66 / 5))
    assert_close(stats["clipfrac"], t(2 / 5))  # of the unweighted terms, as AReaL's clip_mask: tokens 0 and 2
    assert_close(stats["ratio"], t((1.5 + 1 + 0.5 + 1 + 1.1) / 5))


def test_equals_plain_ppo_when_the_engine_sampled_with_the_learners_weights():
    weights, stats = behaviour_weights(PROX, PROX, MASK, CAP)
    assert_close(weights, MASK.to(F64))  # 1 on every real token
    assert_close(stats["masked"], t(0.0))
    assert_close(stats["weight"], t(1.0))
    assert_close(stats["kl"], t(0.0))
    logp = PROX + t([[0.3, -0.1, 0.05], [0.2, -0.4, 0.0]])
    advantages = t([[1.0, -2.0, 0.5], [0.3, 1.0, 0.0]])
    plain, plain_stats = policy_loss(logp, PROX, advantages, MASK, 0.2)
    weighted, weighted_stats = policy_loss(logp, PROX, advantages, MASK, 0.2, weights)
    assert_close(weighted, plain)
    assert weighted_stats.keys() == plain_stats.keys()
    for key in plain_stats:
        assert_close(weighted_stats[key], plain_stats[key])


def test_a_masked_token_contributes_no_gradient_and_padding_none_either():
    weights, _ = behaviour_weights(PROX, BEHAV, MASK, CAP)
    logp = (PROX + 0.1).requires_grad_()
    advantages = t([[1.0, 2.0, -1.0], [-1.0, 0.5, 3.0]])
    loss, _ = policy_loss(logp, PROX, advantages, MASK, 0.2, weights)
    loss.backward()
    grad = logp.grad
    assert grad[0, 1] == 0.0 and grad[1, 2] == 0.0  # the masked token; padding
    # r = e^0.1 ~ 1.105, inside the clip range: d/dlogp of w * -A * r / 5 = -w * A * r / 5
    r = math.exp(0.1)
    assert_close(grad[0, 0], t(-2.0 * 1.0 * r / 5))
    assert_close(grad[1, 1], t(-1.2 * 0.5 * r / 5))


def test_a_huge_log_ratio_is_masked_and_nothing_overflows():
    prox, behav = t([[0.0, -0.1]]), t([[-500.0, -0.1]])  # pi_prox / pi_behav = e^500 on token 0
    weights, stats = behaviour_weights(prox, behav, torch.ones(1, 2, dtype=torch.bool), CAP)
    assert_close(weights, t([[0.0, 1.0]]))
    assert all(torch.isfinite(v) for v in stats.values())
    assert_close(stats["masked"], t(0.5))
