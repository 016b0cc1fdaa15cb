import math

import torch
from torch.testing import assert_close

from rlhf.algorithms.ppo import explained_variance, gae, policy_loss, token_rewards, value_loss

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def t(rows):
    return torch.tensor(rows, dtype=F64)


# --- token_rewards -------------------------------------------------------------------------------------------


def test_score_lands_on_last_real_token():
    # Row 0: EOS at 1 (mask T T F). Row 1: no EOS (all real) -> score at T-1. Row 2: EOS at position 0.
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    kl = t([[0.1, 0.2, 9.0], [0.3, 0.4, 0.5], [0.6, 7.0, 8.0]])  # 9, 7, 8 are padding: never read
    scores = t([1.0, 2.0, 3.0])
    rewards, non_score = token_rewards(scores, kl, mask, kl_coef=0.5)
    # non_score = -0.5 * kl on real tokens, 0 on padding.
    assert_close(non_score, t([[-0.05, -0.1, 0.0], [-0.15, -0.2, -0.25], [-0.3, 0.0, 0.0]]))
    # The score is added at the EOS (index 1), at T-1 without EOS, at 0 for an immediate EOS -- never past EOS.
    assert_close(rewards, t([[-0.05, -0.1 + 1.0, 0.0], [-0.15, -0.2, -0.25 + 2.0], [-0.3 + 3.0, 0.0, 0.0]]))


def test_token_rewards_ignore_nan_kl_at_padding():
    mask = torch.tensor([[True, False]])
    rewards, _ = token_rewards(t([1.0]), t([[0.2, NAN]]), mask, kl_coef=0.1)
    assert_close(rewards, t([[-0.02 + 1.0, 0.0]]))


# --- gae ---------------------------------------------------------------------------------------------------


def test_gae_three_tokens_by_hand():
    gamma, lam = 0.9, 0.8
    rewards = t([[0.0, 0.0, 1.0]])
    values = t([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    # delta_2 = 1 - 0.7 (V_3 = 0); delta_1 = 0 + 0.9*0.7 - 0.6; delta_0 = 0 + 0.9*0.6 - 0.5.
    d2, d1, d0 = 1 - 0.7, gamma * 0.7 - 0.6, gamma * 0.6 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * d1 + (gamma * lam) ** 2 * d2
    assert_close(adv, t([[a0, a1, a2]]))
    assert_close(ret, t([[a0 + 0.5, a1 + 0.6, a2 + 0.7]]))


def test_gae_lambda_one_returns_are_discounted_reward_to_go():
    # With lam = 1 the values telescope away: G_t = sum_{s>=t} gamma^(s-t) r_s, whatever V is.
    gamma = 0.5
    rewards = t([[1.0, 2.0, 4.0]])
    _, ret = gae(rewards, t([[3.0, -1.0, 10.0]]), torch.ones(1, 3, dtype=torch.bool), gamma, 1.0)
    assert_close(ret, t([[1 + 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4, 4.0]]))


def test_gae_padding_is_excluded_and_value_after_last_token_is_zero():
    gamma, lam = 0.9, 0.8
    mask = torch.tensor([[True, True, False, False]])
    rewards = t([[0.0, 1.0, 5.0, 5.0]])
    padded_a = gae(rewards, t([[0.5, 0.6, 100.0, -3.0]]), mask, gamma, lam)
    padded_b = gae(t([[0.0, 1.0, NAN, INF]]), t([[0.5, 0.6, NAN, 7.0]]), mask, gamma, lam)
    # Two real tokens: delta_1 = 1 - 0.6 (nothing after the EOS), delta_0 = 0.9*0.6 - 0.5.
    d1, d0 = 1 - 0.6, gamma * 0.6 - 0.5
    expected_adv = t([[d0 + gamma * lam * d1, d1, 0.0, 0.0]])
    expected_ret = t([[d0 + gamma * lam * d1 + 0.5, d1 + 0.6, 0.0, 0.0]])
    for adv, ret in (padded_a, padded_b):
        assert_close(adv, expected_adv)
        assert_close(ret, expected_ret)


def _gae_plain_loop(rewards, values, lengths, gamma, lam):
    """Per-row, per-token python floats: the textbook recursion on each row's real tokens only."""
    out = []
    for r_row, v_row, n in zip(rewards, values, lengths):
        adv = [0.0] * len(r_row)
        running = 0.0
        for i in reversed(range(n)):
            next_v = v_row[i + 1] if i + 1 < n else 0.0
            running = r_row[i] + gamma * next_v - v_row[i] + gamma * lam * running
            adv[i] = running
        out.append(adv)
    return out


def test_gae_vectorised_matches_plain_loop():
    gen = torch.Generator().manual_seed(0)
    n_rows, row_len, gamma, lam = 4, 6, 0.97, 0.9
    rewards = torch.randn(n_rows, row_len, generator=gen, dtype=F64)
    values = torch.randn(n_rows, row_len, generator=gen, dtype=F64)
    lengths = [6, 1, 3, 5]
    mask = torch.arange(row_len)[None, :] < torch.tensor(lengths)[:, None]
    adv, ret = gae(rewards, values, mask, gamma, lam)
    expected = t(_gae_plain_loop(rewards.tolist(), values.tolist(), lengths, gamma, lam))
    assert_close(adv, expected)
    assert_close(ret, torch.where(mask, expected + values, 0.0))


# --- policy_loss -------------------------------------------------------------------------------------------


def _clip_case():
    # Four real tokens (cliprange 0.2) + one padded token holding garbage.
    #   tok0: A=+1, r=1.5 -> -1.5 vs -1.2 -> -1.2 (clipped)
    #   tok1: A=-1, r=1.5 ->  1.5 vs  1.2 ->  1.5 (unclipped)
    #   tok2: A=+1, r=0.5 -> -0.5 vs -0.8 -> -0.5 (unclipped)
    #   tok3: A=-1, r=0.5 ->  0.5 vs  0.8 ->  0.8 (clipped)
    old = t([[0.0, 0.0, 0.0, 0.0, 0.0]])
    logp = t([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5), 0.0]])
    adv = t([[1.0, -1.0, 1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    return logp, old, adv, mask


def test_policy_loss_clipping_active_by_hand():
    logp, old, adv, mask = _clip_case()
    logp.requires_grad_(True)
    loss, stats = policy_loss(logp, old, adv, mask, cliprange=0.2)
    assert_close(loss, torch.tensor((-1.2 + 1.5 - 0.5 + 0.8) / 4, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(2 / 4, dtype=F64))
    assert_close(
        stats["approxkl"], torch.tensor(0.5 * (2 * math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2) / 4, dtype=F64)
    )
    assert_close(stats["ratio"], torch.tensor((1.5 + 1.5 + 0.5 + 0.5) / 4, dtype=F64))
    assert not any(v.requires_grad for v in stats.values())
    loss.backward()
    # Clipped tokens get no gradient; unclipped: d(-A r)/d logp = -A r, divided by 4 real tokens.
    assert_close(logp.grad, t([[0.0, 1.5 / 4, -0.5 / 4, 0.0, 0.0]]))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    logp = t([[-1.0, -2.0, -3.0]])
    adv = t([[0.5, -2.0, 99.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = policy_loss(logp, logp.clone(), adv, mask, cliprange=0.2)
    assert_close(loss, torch.tensor(-(0.5 - 2.0) / 2, dtype=F64))  # ratio 1: no clipping
    assert_close(stats["clipfrac"], torch.tensor(0.0, dtype=F64))
    assert_close(stats["approxkl"], torch.tensor(0.0, dtype=F64))
    assert_close(stats["ratio"], torch.tensor(1.0, dtype=F64))


def test_policy_loss_padding_changes_nothing_even_nan():
    logp, old, adv, mask = _clip_case()
    results = []
    for garbage in (0.0, NAN, INF):
        lp = logp.clone()
        lp[0, 4] = garbage
        o, a = old.clone(), adv.clone()
        o[0, 4], a[0, 4] = -garbage, garbage
        lp.requires_grad_(True)
        loss, stats = policy_loss(lp, o, a, mask, cliprange=0.2)
        loss.backward()
        results.append((loss.detach(), stats, lp.grad))
    for loss, stats, grad in results[1:]:
        assert_close(loss, results[0][0])
        assert_close(stats, results[0][1])
        assert_close(grad, results[0][2])


# --- value_loss --------------------------------------------------------------------------------------------


def test_value_loss_by_hand():
    # eps 0.2, returns 0, old values 0.5.
    #   tok0: V=1.0 -> (1-0)^2 = 1   vs clip to 0.7 -> 0.49  -> max 1    (unclipped)
    #   tok1: V=0.0 -> 0              vs clip to 0.3 -> 0.09  -> max 0.09 (clipped)
    values = t([[1.0, 0.0, 50.0]]).requires_grad_(True)
    old = t([[0.5, 0.5, -50.0]])
    returns = t([[0.0, 0.0, 8.0]])
    mask = torch.tensor([[True, True, False]])
    loss, stats = value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert_close(loss, torch.tensor(0.5 * (1.0 + 0.09) / 2, dtype=F64))
    assert_close(stats["clipfrac"], torch.tensor(0.5, dtype=F64))
    loss.backward()
    # tok0: d/dV 0.5 * (V-G)^2 / 2 = (1 - 0) / 2; tok1 clipped: its max term is constant in V; pad: 0.
    assert_close(values.grad, t([[0.5, 0.0, 0.0]]))


def test_value_loss_padding_changes_nothing():
    mask = torch.tensor([[True, True, False]])
    a = value_loss(t([[1.0, 0.0, 50.0]]), t([[0.5, 0.5, 0.0]]), t([[0.0, 0.0, 0.0]]), mask, 0.2)
    b = value_loss(t([[1.0, 0.0, NAN]]), t([[0.5, 0.5, INF]]), t([[0.0, 0.0, -INF]]), mask, 0.2)
    assert_close(a[0], b[0])
    assert_close(a[1], b[1])


def test_an_overflowing_ratio_keeps_the_loss_and_its_gradient_finite():
    """A log-ratio of 100 is inf in fp32 once exponentiated; the clipped loss must not turn it into NaN gradients."""
    for advantage in (1.0, -1.0):
        logp = torch.tensor([[100.0, -1.0]], requires_grad=True)
        old = torch.tensor([[0.0, -1.0]])
        loss, stats = policy_loss(logp, old, torch.full((1, 2), advantage), torch.ones(1, 2, dtype=torch.bool), 0.2)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and torch.isfinite(stats["ratio"])
    # below the cap nothing changes: r = e^1 on the first token, clipped to 1.2 for a positive advantage
    logp = torch.tensor([[1.0, 0.0]])
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.2)
    assert_close(loss, torch.tensor(-(1.2 + 1.0) / 2))


def test_explained_variance_by_hand_and_padding_ignored():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 6.0, -99.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, False]])
    real = returns[mask]
    assert_close(explained_variance(returns, returns, mask), torch.tensor(1.0))  # perfect critic
    constant = torch.full_like(returns, float(real.mean()))
    assert_close(explained_variance(constant, returns, mask), torch.tensor(0.0), atol=1e-6, rtol=0)  # only the mean
    off = returns + torch.tensor([[1.0, -1.0, 0.0, 7.0], [0.0, 1.0, -1.0, 7.0]])  # residual variance 2/3 of 6 tokens
    expected = 1 - torch.tensor([1.0, -1.0, 0.0, 0.0, 1.0, -1.0]).var(unbiased=False) / real.var(unbiased=False)
    assert_close(explained_variance(off, returns, mask), expected)
