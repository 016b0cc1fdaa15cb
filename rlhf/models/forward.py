"""Forward passes over the batch layout of rlhf.models.batch: log-probs of the sampled tokens, values, rewards.

Every function takes the model and tensors on the model's device and returns tensors on it. Shapes: n rows,
C prompt columns, T response columns, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf.algorithms.common import as_dtype, logprobs_from_logits
from rlhf.models.batch import ModelInput, row_chunks


def response_logprobs(
    model: nn.Module,
    sequences: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    context: int,
    temperature: float,
) -> torch.Tensor:
    """Log-probs (n, T) of the sampled response tokens under the tempered policy softmax(logits / T).

    Only the last T+1 positions go through the LM head (transformers' `logits_to_keep`, as TRL's GRPO does): the
    prompt's logits, (n, C, vocab) floats, were computed and thrown away. 3% of a SmolLM2 forward and backward on
    the AVX2 box (8 x (73 + 96) tokens, LoRA: 17.4 vs 17.9 s); on a GPU, mostly that memory."""
    keep = sequences.shape[1] - context + 1
    out = model(input_ids=sequences, attention_mask=attn, position_ids=positions, use_cache=False, logits_to_keep=keep)
    # the logits at positions C-1 .. C+T-2 predict the response tokens (counted from the end: a model that ignored
    # logits_to_keep would still be read right)
    return logprobs_from_logits(out.logits[:, -keep:-1], sequences[:, context:], temperature)  # upcast there


@torch.no_grad()
def reference_logprobs(model: nn.Module, inputs: ModelInput, temperature: float, chunk: int = 64) -> torch.Tensor:
    """`response_logprobs` of a frozen model over a whole generated batch, `chunk` rows per forward; (N, T),
    0 on padding. The learner and the async engine both compute the reference here, so their numbers agree."""
    rows = row_chunks(chunk, inputs.sequences, inputs.attn, inputs.positions)
    logps = [response_logprobs(model, *r, inputs.context, temperature) for r in rows]
    return cat_rows(logps) * inputs.response_mask


def cat_rows(chunks: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' rows as one tensor: the one chunk itself when there is one (a cat would copy it: a kernel)."""
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def sequence_kl(
    policy: nn.Module, reference: nn.Module, batch: ModelInput, temperature: float, rows: slice = slice(None)
) -> torch.Tensor:
    """KL(policy || reference) of each sampled sequence of the batch's `rows`, estimated on the sample itself: its
    response tokens' log pi(y) - log pi_ref(y), both at `temperature`, summed; (n,). The evaluate stage's KL."""
    inputs = (batch.sequences[rows], batch.attn[rows], batch.positions[rows], batch.context, temperature)
    diff = response_logprobs(policy, *inputs) - response_logprobs(reference, *inputs)
    return (diff * batch.response_mask[rows]).sum(1)


def response_logprobs_and_values(
    wrapper: nn.Module,
    sequences: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    context: int,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a PolicyAndValueWrapper: log-probs (n, T) of the response tokens and the value of the
    state before each of them (n, T). The LM head sees the last T+1 positions only (as in `response_logprobs`)."""
    keep = sequences.shape[1] - context + 1
    logits, values = wrapper(input_ids=sequences, attention_mask=attn, position_ids=positions, logits_to_keep=keep)
    logp = logprobs_from_logits(logits[:, -keep:-1], sequences[:, context:], temperature)
    return logp, values[:, context - 1 : -1]


def scalar_head(model: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-position scalar (n, L) of a sequence-classification model (backbone + `score` head)."""
    backbone = model.base_model(input_ids=sequences, attention_mask=attn, position_ids=positions, use_cache=False)
    return as_dtype(model.score(backbone.last_hidden_state).squeeze(-1), torch.float32)


def sequence_scores(
    model: nn.Module,
    sequences: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    context: int,
    last_index: torch.Tensor,
) -> torch.Tensor:
    """Reward-model score of each sequence (n,): the `score` head on its pooled hidden state (`pooled_hidden`), in
    the units the reward stage calibrated it to (`reward_normalization`)."""
    pooled = pooled_hidden(model, sequences, attn, positions, context, last_index)
    scores = as_dtype(model.score(pooled).squeeze(-1), torch.float32)
    if (norm := reward_normalization(model)) is None:
        return scores
    mean, std = norm
    return (scores - mean) / std


def pooled_hidden(
    model: nn.Module,
    sequences: torch.Tensor,
    attn: torch.Tensor,
    positions: torch.Tensor,
    context: int,
    last_index: torch.Tensor,
) -> torch.Tensor:
    """The backbone's last hidden state pooled over each response (n, H), as the model's config says
    (`reward_pooling`): "last" (the default) = at the last real response token (the EOS when there is one), index
    `last_index` (n,) from the response's start; "mean" = the mean over the response tokens up to it. The head
    is linear: scoring the mean state is the mean of the per-token scores."""
    hidden = model.base_model(input_ids=sequences, attention_mask=attn, position_ids=positions, use_cache=False)
    hidden = hidden.last_hidden_state
    if reward_pooling(model) == "mean":
        steps = torch.arange(hidden.shape[1] - context, device=hidden.device)
        in_response = (steps[None, :] <= last_index[:, None]).to(hidden.dtype)[..., None]
        return (hidden[:, context:] * in_response).sum(1) / in_response.sum(1)
    return hidden[torch.arange(len(hidden), device=hidden.device), context + last_index]


def reward_pooling(model: nn.Module) -> str:
    """ "last" or "mean": how a reward model reads a sequence's score (rlhf.models.loading.reward_model_from_causal);
    models from elsewhere (a hub RM) read the last token."""
    return getattr(_reward_config(model), "reward_pooling", "last")


def reward_normalization(model: nn.Module) -> tuple[float, float] | None:
    """(mean, std) of the raw head's scores on the SFT samples the reward model was fitted on, saved in its config
    by the reward stage (`reward.normalize`): scores are read as (raw - mean) / std, so the SFT policy's samples
    score 0 +- 1 whatever the fit's offset and scale. None for models from elsewhere (a hub RM) and earlier ones."""
    norm = getattr(_reward_config(model), "reward_normalization", None)
    return None if norm is None else (float(norm[0]), float(norm[1]))


def _reward_config(model: nn.Module):
    """The reward model's config, where the reward stage saves how it is read (a DeepSpeed engine wraps the model)."""
    return model.module.config if hasattr(model, "module") else model.config


class PolicyAndValueWrapper(nn.Module):
    """Policy + value model as one module, so one optimizer (and one DeepSpeed engine) steps both.

    The value model starts from the reward model (the original's choice). Only the policy is exported.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep: int = 0):
        """-> (policy logits (n, L', V) of the last `logits_to_keep` positions (0: all L), values (n, L)); a plain
        tuple, which DeepSpeed's hooks walk safely."""
        values = scalar_head(self.value_model, input_ids, attention_mask, position_ids)
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_to_keep,
        )
        return out.logits, values


def unwrap_policy(model: nn.Module) -> nn.Module:
    """The policy inside a PolicyAndValueWrapper, or the model itself."""
    return model.policy if isinstance(model, PolicyAndValueWrapper) else model
