"""How each algorithm turns a scored rollout into a loss: a thin adapter over rlhf/algorithms/*.

Every objective has the same two calls, so the loop never branches on an algorithm's name:
  prepare(rollout) -> (groups, metrics)   once per generated batch, no grad; `groups` tensors have a
                                          leading dim B (prompts) so micro-batches are sets of prompts
  loss(model, mb)  -> (loss, metrics)     once per micro-batch, with grad
Metrics are detached 0-dim tensors, left on the device: the loop reads a batch's metrics once (a read inside a
micro-step would make the host wait for the device's queue).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlhf.algorithms import bok, dpo, grpo, ppo, rloo
from rlhf.algorithms.common import kl_penalty, masked_whiten
from rlhf.config import TrainConfig
from rlhf.models.forward import response_logprobs, response_logprobs_and_values

Metrics = dict[str, torch.Tensor]  # detached 0-dim tensors, on the device


@dataclass
class Rollout:
    """One generated batch after post-processing and scoring. N = B*K rows, K samples of a prompt adjacent."""

    sequences: torch.Tensor  # (N, C+T) prompt (left-padded) + response (pad after the first EOS)
    attn: torch.Tensor  # (N, C+T)
    positions: torch.Tensor  # (N, C+T)
    response_mask: torch.Tensor  # (N, T) True on real response tokens, EOS included
    scores: torch.Tensor  # (N,) reward after the missing-EOS penalty
    logp: torch.Tensor  # (N, T) behaviour log-probs, 0 on padding: recomputed with the training forward, or
    # the engine's sampling log-probs where they are only reported (DPO, best-of-k; GRPO and RLOO with one
    # optimizer step per batch, whose losses take them from their own forward)
    ref_logp: torch.Tensor  # (N, T)
    values: torch.Tensor | None  # (N, T) PPO only
    context: int  # C
    k: int
    is_weight: torch.Tensor | None = None  # (N,) truncated importance weights of stale samples (train.tis_cap)
    # (N, T) AReaL's decoupled objective (train.decoupled_cap): per-token behaviour weights pi_prox / pi_behav, `logp`
    # being pi_prox; 0 on the tokens past the cap and on padding (rlhf.algorithms.decoupled)
    behav_weight: torch.Tensor | None = None

    def weighted(self, advantages: torch.Tensor) -> torch.Tensor:
        """Advantages (N,) or (N, T) times the sequence importance weights, when the run uses them."""
        if self.is_weight is None:
            return advantages
        return advantages * (self.is_weight[:, None] if advantages.dim() == 2 else self.is_weight)

    def decoupled(self) -> dict[str, torch.Tensor]:
        """The per-token behaviour weights as a `grouped` entry (micro-batches cut them as every (N, T) tensor),
        when the run uses the decoupled objective; else nothing."""
        return {} if self.behav_weight is None else {"behav_weight": self.behav_weight}

    def grouped(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Reshape (N, ...) tensors to (B, K, ...) so micro-batches select whole prompts."""
        return {name: t.view(-1, self.k, *t.shape[1:]) for name, t in self._model_input(tensors).items()}

    def picked(self, rows: torch.Tensor, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows (B, J) of each prompt (global row indices, e.g. its chosen and rejected sample) of (N, ...)
        tensors, as (B, J, ...): one index op a tensor a batch, where picking them in every micro-step was one a
        micro-step (and 3 to build the index)."""
        flat = rows.flatten()
        return {name: t[flat].view(*rows.shape, *t.shape[1:]) for name, t in self._model_input(tensors).items()}

    def _model_input(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        base = {"sequences": self.sequences, "attn": self.attn, "positions": self.positions, "mask": self.response_mask}
        return {**base, **tensors}


class Objective(Protocol):
    needs_values: bool  # PPO: the model is a policy + value wrapper and the rollout carries values
    needs_behaviour_logprobs: bool  # the loss uses them (ratios); else they are only reported

    def prepare(self, rollout: Rollout) -> tuple[dict[str, torch.Tensor], Metrics]: ...

    def loss(self, model: torch.nn.Module, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]: ...


def _named(prefix: str, stats: dict) -> dict[str, torch.Tensor]:
    """Algorithm stats (0-dim tensors) -> `prefix/name`, detached: still on the device (the loop reads a batch's
    metrics once, rlhf.trainers.readback)."""
    return {f"{prefix}/{k}": v.detach() if v.requires_grad else v for k, v in stats.items()}  # no op where none is due


def _flat(mb: dict[str, torch.Tensor], *names: str) -> list[torch.Tensor]:
    return [mb[n].flatten(0, 1) for n in names]


def _behaviour_weights(mb: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The micro-batch's decoupled behaviour weights (P*K, T) (Rollout.decoupled), or None: unweighted."""
    return mb["behav_weight"].flatten(0, 1) if "behav_weight" in mb else None


def _kl_and_stats(r: Rollout, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token KL to the reference (N, T), 0 on padding, and the sequence-level objective/* stats."""
    return _kl(r.logp, r.ref_logp, r.response_mask, r.scores, cfg)


def _kl(logp, ref_logp, mask, scores, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """_kl_and_stats of tensors: logp, ref_logp (N, T), mask (N, T) bool, scores (N,)."""
    kl = kl_penalty(logp, ref_logp, cfg.kl_estimator) * mask
    seq_kl = kl.sum(1)
    non_score = -cfg.kl_coef * seq_kl
    stats = {
        "objective/kl": seq_kl.mean(),
        "objective/non_score_reward": non_score.mean(),
        "objective/rlhf_reward": (scores + non_score).mean(),
    }
    return kl, stats


def one_step_per_batch(cfg: TrainConfig) -> bool:
    """True when each generated batch gets exactly one optimizer step (E = M = 1) and no importance weights: then
    every micro-batch's forward runs on the weights that were current when the batch was collected, so its
    log-probs, detached, ARE the behaviour log-probs, and the separate no-grad forward of step 5 is redundant
    (TRL's GRPO does the same when num_iterations is 1). Importance weights (train.tis_cap) and the decoupled
    objective's behaviour weights (train.decoupled_cap: pi_prox / pi_behav) need them before the update, so they keep
    the separate forward."""
    corrected = cfg.tis_cap is not None or cfg.decoupled_cap is not None
    return cfg.num_ppo_epochs == 1 and cfg.num_mini_batches == 1 and not corrected


@dataclass
class PPO:
    cfg: TrainConfig
    needs_values = True
    needs_behaviour_logprobs = True

    def prepare(self, r: Rollout):
        c = self.cfg
        kl, stats = _kl_and_stats(r, c)
        rewards, _ = ppo.token_rewards(r.scores, kl, r.response_mask, c.kl_coef)
        if c.whiten_rewards:
            rewards = masked_whiten(rewards, r.response_mask, shift_mean=False)
        advantages, returns = ppo.gae(rewards, r.values, r.response_mask, c.gamma, c.lam)
        # of the rollout's values, once a batch (CleanRL): not per micro-step, ~20 ops each
        stats["val/explained_variance"] = ppo.explained_variance(r.values, returns, r.response_mask)
        advantages = r.weighted(masked_whiten(advantages, r.response_mask))
        groups = r.grouped(
            old_logp=r.logp, old_values=r.values, advantages=advantages, returns=returns, **r.decoupled()
        )
        return groups, stats

    def loss(self, model, mb):
        seq, attn, pos, mask, old_logp, old_values, adv, ret = _flat(
            mb, "sequences", "attn", "positions", "mask", "old_logp", "old_values", "advantages", "returns"
        )
        context = seq.shape[1] - mask.shape[1]
        logp, values = response_logprobs_and_values(model, seq, attn, pos, context, self.cfg.temperature)
        pg_loss, pg_stats = ppo.policy_loss(logp, old_logp, adv, mask, self.cfg.cliprange, _behaviour_weights(mb))
        vf_loss, vf_stats = ppo.value_loss(values, old_values, ret, mask, self.cfg.cliprange_value)
        stats = _named("policy", pg_stats)
        stats.update(
            {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), "val/clipfrac": vf_stats["clipfrac"]}
        )
        return pg_loss + self.cfg.vf_coef * vf_loss, stats


@dataclass
class RLOO:
    """With one optimizer step per batch (one_step_per_batch) the KL-penalised rewards and their leave-one-out
    advantages are computed in `loss`, from the training forward's detached log-probs: a micro-batch holds whole
    prompts, so each sample's K-1 siblings are there. The same numbers as from a separate forward, one forward less.
    Under the decoupled objective (train.decoupled_cap) the loss is token-level (rloo.token_policy_loss says why)."""

    cfg: TrainConfig
    needs_values = False

    @property
    def needs_behaviour_logprobs(self) -> bool:
        return not one_step_per_batch(self.cfg)

    def prepare(self, r: Rollout):
        if not self.needs_behaviour_logprobs:  # the loss computes the rewards and reports objective/*
            return r.grouped(scores=r.scores, ref_logp=r.ref_logp), {}
        kl, stats = _kl_and_stats(r, self.cfg)
        rlhf_reward = r.scores - self.cfg.kl_coef * kl.sum(1)
        advantages = r.weighted(rloo.rloo_advantages(rlhf_reward, r.k))
        if self.cfg.decoupled_cap is not None:  # per-token ratios against pi_prox, per-token behaviour weights
            return r.grouped(old_logp=r.logp, advantages=advantages, **r.decoupled()), stats
        groups = r.grouped(old_logp_sum=(r.logp * r.response_mask).sum(1), advantages=advantages)
        return groups, stats

    def loss(self, model, mb):
        seq, attn, pos, mask = _flat(mb, "sequences", "attn", "positions", "mask")
        logp = response_logprobs(model, seq, attn, pos, seq.shape[1] - mask.shape[1], self.cfg.temperature)
        if self.cfg.decoupled_cap is not None:
            prox_logp, adv = _flat(mb, "old_logp", "advantages")
            weights = _behaviour_weights(mb)
            loss, stats = rloo.token_policy_loss(logp, prox_logp, adv, mask, self.cfg.cliprange, weights)
            return loss, {**_named("policy", stats), "loss/policy": loss.detach()}
        logp_sum, objective = (logp * mask).sum(1), {}
        if self.needs_behaviour_logprobs:
            old_sum, adv = _flat(mb, "old_logp_sum", "advantages")
        else:
            scores, ref_logp = _flat(mb, "scores", "ref_logp")
            kl, objective = _kl(logp.detach(), ref_logp, mask, scores, self.cfg)
            adv = rloo.rloo_advantages(scores - self.cfg.kl_coef * kl.sum(1), mb["mask"].shape[1])
            old_sum = logp_sum.detach()
        loss, stats = rloo.sequence_policy_loss(logp_sum, old_sum, adv, self.cfg.cliprange)
        return loss, {**_named("policy", stats), "loss/policy": loss.detach(), **objective}


@dataclass
class GRPO:
    """With one optimizer step per batch (one_step_per_batch) the ratio's denominator is the training forward's own
    detached log-probs (the ratio is exactly 1), and the objective/kl stats come from that forward too."""

    cfg: TrainConfig
    needs_values = False

    @property
    def needs_behaviour_logprobs(self) -> bool:
        return not one_step_per_batch(self.cfg)

    def prepare(self, r: Rollout):
        advantages = r.weighted(grpo.group_advantages(r.scores, r.k))
        if not self.needs_behaviour_logprobs:  # the loss reports objective/* from its own forward
            return r.grouped(ref_logp=r.ref_logp, advantages=advantages, scores=r.scores), {}
        _, stats = _kl_and_stats(r, self.cfg)
        return r.grouped(old_logp=r.logp, ref_logp=r.ref_logp, advantages=advantages, **r.decoupled()), stats

    def loss(self, model, mb):
        seq, attn, pos, mask, ref_logp, adv = _flat(
            mb, "sequences", "attn", "positions", "mask", "ref_logp", "advantages"
        )
        logp = response_logprobs(model, seq, attn, pos, seq.shape[1] - mask.shape[1], self.cfg.temperature)
        objective = {}
        if self.needs_behaviour_logprobs:
            (old_logp,) = _flat(mb, "old_logp")
        else:
            old_logp = logp.detach()
            _, objective = _kl(old_logp, ref_logp, mask, *_flat(mb, "scores"), self.cfg)
        loss, stats = grpo.grpo_loss(
            logp, old_logp, ref_logp, adv, mask, self.cfg.cliprange, self.cfg.kl_coef, _behaviour_weights(mb)
        )
        return loss, {**_named("policy", stats), "loss/policy": loss.detach(), **objective}


@dataclass
class OnlineDPO:
    """Best vs worst of k samples, ranked by reward; ties are dropped (the original trained on them)."""

    cfg: TrainConfig
    needs_values = False
    needs_behaviour_logprobs = False

    def prepare(self, r: Rollout):
        _, stats = _kl_and_stats(r, self.cfg)
        chosen, rejected, valid = dpo.select_pairs(r.scores, r.k)
        ref_sum = (r.ref_logp * r.response_mask).sum(1)
        groups = r.picked(torch.stack([chosen, rejected], 1), ref_sum=ref_sum)  # (B, 2, ...): chosen, rejected
        groups["valid"] = valid
        stats["objective/scores_margin"] = (r.scores[chosen] - r.scores[rejected]).mean()
        stats["objective/valid_pairs"] = valid.float().mean()
        return groups, stats

    def loss(self, model, mb):
        # each prompt's chosen row, then its rejected one: (2P, ...) as a view
        seq, attn, pos, mask, ref = _flat(mb, "sequences", "attn", "positions", "mask", "ref_sum")
        logp = response_logprobs(model, seq, attn, pos, seq.shape[1] - mask.shape[1], self.cfg.temperature)
        sums = (logp * mask).sum(1).view(-1, 2).T  # (2, P): chosen, rejected
        loss, stats = dpo.dpo_loss(*sums, *ref.view(-1, 2).T, mb["valid"], self.cfg.beta, self.cfg.loss_type)
        logps_chosen, logps_rejected = sums.detach().mean(1)
        out = {
            "rewards/chosen": stats["chosen_reward"],
            "rewards/rejected": stats["rejected_reward"],
            "rewards/accuracies": stats["accuracy"],
            "rewards/margins": stats["margin"],
            "logps/chosen": logps_chosen,
            "logps/rejected": logps_rejected,
            "loss/policy": loss.detach(),
        }
        return loss, out


@dataclass
class BestOfK:
    """SFT on the best of k samples: the paper's control for DPO seeing two samples per prompt."""

    cfg: TrainConfig
    needs_values = False
    needs_behaviour_logprobs = False

    def prepare(self, r: Rollout):
        _, stats = _kl_and_stats(r, self.cfg)
        best, valid = bok.select_best(r.scores, r.k)
        groups = r.picked(best[:, None])  # (B, 1, ...)
        groups["valid"] = valid
        stats["objective/valid_pairs"] = valid.float().mean()
        return groups, stats

    def loss(self, model, mb):
        seq, attn, pos, mask = _flat(mb, "sequences", "attn", "positions", "mask")
        logp = response_logprobs(model, seq, attn, pos, seq.shape[1] - mask.shape[1], self.cfg.temperature)
        loss, stats = bok.nll_loss(logp, mask, mb["valid"])
        chosen = (logp * mask).sum(1).mean().detach()
        return loss, {"logps/chosen": chosen, "loss/policy": loss.detach(), "loss/nll_per_token": stats["nll"]}


OBJECTIVES = {"ppo": PPO, "rloo": RLOO, "grpo": GRPO, "online_dpo": OnlineDPO, "bok": BestOfK}
