"""rlhf.trainers.objectives: GRPO and RLOO with one optimizer step per batch take their behaviour log-probs from
the training forward itself; the loss, its gradient and the logged objective/* numbers must equal those of the
separate no-grad forward (step 5 of the loop) they replace."""

from __future__ import annotations

import copy

import pytest
import torch

from rlhf.algorithms import rloo
from rlhf.config import ModelConfig, TrainConfig
from rlhf.models import tiny
from rlhf.models.batch import assemble, bucket, micro_batch_columns, trim_padding
from rlhf.models.forward import PolicyAndValueWrapper, response_logprobs, response_logprobs_and_values
from rlhf.trainers.objectives import OBJECTIVES, Rollout, one_step_per_batch

SMALL = ModelConfig(
    vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48, max_position_embeddings=32
)
K = 4


@pytest.fixture(scope="module")
def setting():
    tok = tiny.train_word_tokenizer(["the movie was great and the plot was bad , i liked it"], vocab_size=64)
    policy, ref = tiny.build_tiny_model(SMALL, tok, seed=0), tiny.build_tiny_model(SMALL, tok, seed=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, len(tok), (n,), generator=gen).tolist() for n in (3, 5, 4)]
    responses = torch.randint(4, len(tok), (len(prompts) * K, 6), generator=gen)
    responses[1, 2], responses[6, 0] = tok.eos_token_id, tok.eos_token_id  # two shorter responses
    inputs = assemble(prompts, responses, K, tok.pad_token_id, tok.eos_token_id)
    return policy, ref, inputs


def _rollout(policy, ref, inputs, behaviour: torch.Tensor) -> Rollout:
    rows = (inputs.sequences, inputs.attn, inputs.positions, inputs.context, 0.7)
    with torch.no_grad():
        ref_logp = response_logprobs(ref, *rows)
    mask = inputs.response_mask
    return Rollout(
        sequences=inputs.sequences,
        attn=inputs.attn,
        positions=inputs.positions,
        response_mask=mask,
        scores=torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.0, 0.2, 0.2, 0.9, 0.0]),
        logp=behaviour * mask,
        ref_logp=ref_logp * mask,
        values=None,
        context=inputs.context,
        k=K,
    )


def _loss_and_grads(objective, policy, rollout: Rollout):
    groups, stats = objective.prepare(rollout)
    policy.zero_grad()
    loss, step_stats = objective.loss(policy, groups)  # the whole batch as one micro-batch
    loss.backward()
    grads = [p.grad.clone() for p in policy.parameters() if p.grad is not None]
    return loss.detach(), grads, {**stats, **step_stats}


@pytest.mark.parametrize("trainer", ["grpo", "rloo"])
def test_one_step_per_batch_uses_the_training_forward_and_changes_no_number(setting, trainer):
    policy, ref, inputs = setting
    one_step = TrainConfig(trainer=trainer, k=K, kl_coef=0.3)
    two_steps = TrainConfig(trainer=trainer, k=K, kl_coef=0.3, num_ppo_epochs=2)
    assert one_step_per_batch(one_step) and not one_step_per_batch(two_steps)
    assert not one_step_per_batch(TrainConfig(trainer=trainer, k=K, tis_cap=2.0))  # the weights need them first
    fused, separate = OBJECTIVES[trainer](one_step), OBJECTIVES[trainer](two_steps)
    assert not fused.needs_behaviour_logprobs and separate.needs_behaviour_logprobs
    rows = (inputs.sequences, inputs.attn, inputs.positions, inputs.context, 0.7)
    with torch.no_grad():
        learner = response_logprobs(policy, *rows)  # what the loop's step 5 computes
    # The engine's sampling log-probs differ from the learner's (another kernel, or older weights): the fused
    # objective only reports them, so its loss must not move with them.
    engine = learner + 0.05 * torch.randn(learner.shape, generator=torch.Generator().manual_seed(1))
    loss_s, grads_s, stats_s = _loss_and_grads(separate, policy, _rollout(policy, ref, inputs, learner))
    loss_f, grads_f, stats_f = _loss_and_grads(fused, policy, _rollout(policy, ref, inputs, engine))
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-5, atol=1e-6)
    assert len(grads_f) == len(grads_s) > 0 and any(g.abs().sum() > 0 for g in grads_s)
    for a, b in zip(grads_f, grads_s):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for key in ("objective/kl", "objective/non_score_reward", "objective/rlhf_reward", "policy/approxkl"):
        assert stats_f[key] == pytest.approx(stats_s[key], rel=1e-4, abs=1e-6), key
    assert stats_s["objective/kl"] != pytest.approx(0.0, abs=1e-3)  # the reference differs: the KL term counts


def _short_responses():
    """3 prompts x K responses that all end by column 4 of 8: the last 3 columns are padding everywhere."""
    responses = torch.full((12, 8), 10)
    for row, length in enumerate([3, 5, 2, 4, 1, 5, 3, 2, 4, 4, 5, 1]):
        responses[row, length - 1] = 3  # EOS (the tiny tokenizer's id 3) ends the response there
    prompts = [[5, 6, 7], [8, 9, 10, 4, 5], [6, 7, 8, 9]]
    return assemble(prompts, responses, K, 0, 3)


@pytest.mark.parametrize("trainer", ["rloo", "grpo", "online_dpo", "bok"])
def test_a_micro_batch_without_its_padding_columns_gives_the_same_loss_and_gradients(setting, trainer):
    """The loop trims the columns that are padding in every row of a micro-batch (rlhf.models.batch.trim_padding):
    fewer tokens through the model, the same loss and gradients."""
    policy, ref, _ = setting
    short = _short_responses()
    assert short.response_mask.shape[1] == 8 and int(short.response_mask.sum(1).max()) == 5
    with torch.no_grad():
        learner = response_logprobs(policy, short.sequences, short.attn, short.positions, short.context, 0.7)
    objective = OBJECTIVES[trainer](TrainConfig(trainer=trainer, k=K, kl_coef=0.3, num_ppo_epochs=2))
    groups, _ = objective.prepare(_rollout(policy, ref, short, learner))
    first = {name: t[:1] for name, t in groups.items()}  # prompt 0 alone: 3 of the 5 prompt columns are padding
    spans = short.spans(K)  # per prompt: its tokens, its longest response (read on the host)
    assert spans == [(3, 5), (5, 5), (4, 5)] and all(isinstance(n, int) for pair in spans for n in pair)
    trimmed = trim_padding(first, 5 - 3, 5)
    assert trimmed["sequences"].shape[-1] == 3 + 5 and trimmed["mask"].shape[-1] == 5
    for mb, (prompt, response) in ((groups, (5, 5)), (first, spans[0])):
        cut = trim_padding(mb, 5 - prompt, response)
        assert cut["sequences"].shape[-1] < mb["sequences"].shape[-1]
        policy.zero_grad()
        full_loss, _ = objective.loss(policy, mb)
        full_loss.backward()
        full_grads = [p.grad.clone() for p in policy.parameters()]
        policy.zero_grad()
        cut_loss, _ = objective.loss(policy, cut)
        cut_loss.backward()
        torch.testing.assert_close(cut_loss, full_loss, rtol=1e-5, atol=1e-6)
        for a, b in zip((p.grad for p in policy.parameters()), full_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_micro_batches_take_a_few_bucketed_widths_that_hold_their_longest_rows():
    """A micro-batch keeps the columns its longest prompt and longest response reach, on a GPU rounded up to multiples
    of max(16, width / 4): a run's micro-batches take a few shapes (CUDA graphs, the allocator's reuse), not one
    each. On the CPU the exact cut."""
    assert [bucket(n, 53) for n in (1, 16, 17, 33, 49, 53)] == [16, 16, 32, 48, 53, 53]
    assert [bucket(n, 600) for n in (1, 150, 151, 599)] == [150, 150, 300, 600]
    assert {bucket(n, 8) for n in range(1, 9)} == {8}  # a narrow dimension is never cut
    spans = [(3, 20), (120, 40), (90, 5)]  # per prompt: tokens, longest response
    assert micro_batch_columns(spans, [0, 2], 600, 53, bucketed=True) == (600 - 150, 32)
    assert micro_batch_columns(spans, [1], 600, 53, bucketed=True) == (600 - 150, 48)
    groups = [[0], [1], [2], [0, 1], [1, 2]]
    widths = {micro_batch_columns(spans, g, 600, 53, bucketed=True) for g in groups}
    assert len(widths) <= 3 and all(600 - first >= 120 for first, _ in widths)
    exact = {micro_batch_columns(spans, g, 600, 53, bucketed=False) for g in groups}  # the CPU's: the exact cut
    assert exact == {(597, 20), (480, 40), (510, 5), (480, 40)}


@pytest.mark.parametrize("trainer", ["ppo", "rloo", "grpo"])
def test_the_decoupled_objective_weights_each_token_through_the_micro_batches(setting, trainer):
    """train.decoupled_cap: the rollout's per-token behaviour weights go into the objective's groups, are cut with a
    micro-batch's padding columns like every (N, T) tensor, and scale the policy term token by token (the mean stays
    over the real tokens: weights twice as large, a policy loss twice as large). With weights 1 (the engine sampled
    with the learner's weights) PPO and GRPO are their plain objectives; RLOO becomes token-level."""
    policy, ref, _ = setting
    inputs = _short_responses()  # prompt 0's micro-batch loses 2 prompt and 3 response columns to trim_padding
    decoupled = TrainConfig(trainer=trainer, k=K, kl_coef=0.0, decoupled_cap=5.0)
    plain = TrainConfig(trainer=trainer, k=K, kl_coef=0.0, num_ppo_epochs=2)  # the separate behaviour forward too
    assert not one_step_per_batch(decoupled) and OBJECTIVES[trainer](decoupled).needs_behaviour_logprobs
    rows = (inputs.sequences, inputs.attn, inputs.positions, inputs.context, 0.7)
    model, values = policy, None
    with torch.no_grad():
        prox = response_logprobs(policy, *rows)
        if trainer == "ppo":  # a critic: a copy of the reference with a scalar head (what scalar_head reads)
            critic = copy.deepcopy(ref)
            critic.score = torch.nn.Linear(SMALL.hidden_size, 1, bias=False)
            model = PolicyAndValueWrapper(policy, critic)
            prox, values = response_logprobs_and_values(model, *rows)
    mask = inputs.response_mask
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) * 2 * mask

    def policy_loss(cfg, behav_weight, mb=None):
        rollout = _rollout(policy, ref, inputs, prox)
        rollout.values, rollout.behav_weight = values, behav_weight
        groups, _ = OBJECTIVES[trainer](cfg).prepare(rollout)
        loss, stats = OBJECTIVES[trainer](cfg).loss(model, groups if mb is None else mb(groups))
        return stats["loss/policy"], groups

    ones, groups = policy_loss(decoupled, mask.float())
    assert groups["behav_weight"].shape == (3, K, mask.shape[1])
    twos, _ = policy_loss(decoupled, 2 * mask.float())
    torch.testing.assert_close(twos, 2 * ones)
    if trainer == "rloo":  # token-level: the sequence advantage on every token, the ratio per token
        adv = rloo.rloo_advantages(_rollout(policy, ref, inputs, prox).scores, K)
        expected, _ = rloo.token_policy_loss(response_logprobs(policy, *rows), prox, adv, mask, 0.2, None)
        torch.testing.assert_close(ones, expected.detach(), rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(ones, policy_loss(plain, None)[0], rtol=1e-5, atol=1e-6)
    # prompt 0 alone, its padding columns cut: the weights are cut with them, the loss is the same
    (prompt, response) = inputs.spans(K)[0]
    assert (inputs.context - prompt, response) == (2, 5)
    first = lambda g: {name: x[:1] for name, x in g.items()}  # noqa: E731
    full, _ = policy_loss(decoupled, weights, first)
    cut, _ = policy_loss(decoupled, weights, lambda g: trim_padding(first(g), inputs.context - prompt, response))
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-6)
