"""Forward passes over prompt+response sequences: log-probs of the sampled tokens, values, reward scores.

Layout used everywhere: `sequences = [left-padded prompt (C) | response (T)]`, shape (n, C+T). Position ids
come from the attention mask, so left padding does not shift positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlhf.algorithms.common import entropy_from_logits, logprobs_from_logits, truncate_after_eos
from rlhf.generation.base import pad_left


@dataclass
class ModelInput:
    """A generated batch as model input (step 3 of the loop). N = B*K rows, prompt-major."""

    prompt_ids: torch.Tensor  # (B, C) left-padded prompts
    sequences: torch.Tensor  # (N, C+T) prompt + response, pad after the response's first EOS
    attn: torch.Tensor  # (N, C+T) long
    positions: torch.Tensor  # (N, C+T)
    response_mask: torch.Tensor  # (N, T) bool, EOS included
    has_eos: torch.Tensor  # (N,) bool
    context: int  # C

    def texts(self, tokenizer) -> list[str]:
        """The responses as text, special tokens dropped."""
        responses = self.sequences[:, self.context :].masked_fill(~self.response_mask, tokenizer.pad_token_id)
        return tokenizer.batch_decode(responses, skip_special_tokens=True)


def assemble(prompts: list[list[int]], responses: torch.Tensor, k: int, pad_id: int, eos_id: int) -> ModelInput:
    """Prompts (B token lists) + raw sampled responses (B*K, T) -> model input, responses cut after the first
    EOS. The learner and the async engine's scorer both build their inputs here, so their scores agree."""
    prompt_ids, prompt_mask = pad_left(prompts, pad_id)
    responses, response_mask, has_eos = truncate_after_eos(responses, eos_id, pad_id)
    attn, positions = attention_and_positions(prompt_mask.repeat_interleave(k, 0), response_mask)
    sequences = torch.cat([prompt_ids.repeat_interleave(k, 0), responses], dim=1)
    return ModelInput(prompt_ids, sequences, attn, positions, response_mask, has_eos, prompt_ids.shape[1])


def attention_and_positions(prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C) and (n, T) bool masks -> attention mask (n, C+T) long and position ids (n, C+T)."""
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return attn, positions


def response_logits(model: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, context: int) -> torch.Tensor:
    """Logits that predict each response token: positions C-1 .. C+T-2. Shape (n, T, V)."""
    out = model(input_ids=sequences, attention_mask=attn, position_ids=positions, use_cache=False)
    return out.logits[:, context - 1 : -1].float()


def response_logprobs(
    model: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, context: int, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (n, T) of the sampled response tokens under the tempered policy (and entropy, if asked)."""
    logits = response_logits(model, sequences, attn, positions, context)
    logp = logprobs_from_logits(logits, sequences[:, context:], temperature)
    entropy = entropy_from_logits(logits, temperature) if with_entropy else None
    return logp, entropy


def response_logprobs_and_values(
    wrapper: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, context: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of a PolicyAndValueWrapper: log-probs (n, T) of the response tokens and the value of the
    state before each of them (n, T)."""
    logits, values = wrapper(input_ids=sequences, attention_mask=attn, position_ids=positions)
    logp = logprobs_from_logits(logits[:, context - 1 : -1].float(), sequences[:, context:], temperature)
    return logp, values[:, context - 1 : -1]


def scalar_head(model: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Per-position scalar (n, L) of a sequence-classification model (backbone + `score` head)."""
    hidden = model.base_model(input_ids=sequences, attention_mask=attn, position_ids=positions, use_cache=False).last_hidden_state
    return model.score(hidden).squeeze(-1).float()


def sequence_scores(model: nn.Module, sequences: torch.Tensor, attn: torch.Tensor, positions: torch.Tensor, context: int, last_index: torch.Tensor) -> torch.Tensor:
    """Reward-model score read at the last real response token (the EOS when there is one). Shape (n,)."""
    values = scalar_head(model, sequences, attn, positions)
    return values[torch.arange(len(values)), context + last_index]


class PolicyAndValueWrapper(nn.Module):
    """Policy + value model as one module, so one optimizer (and one DeepSpeed engine) steps both.

    The value model starts from the reward model (the original's choice). Only the policy is exported.
    """

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    def forward(self, input_ids, attention_mask, position_ids):
        """-> (policy logits (n, L, V), values (n, L)); a plain tuple, which DeepSpeed's hooks walk safely."""
        values = scalar_head(self.value_model, input_ids, attention_mask, position_ids)
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).logits
        return logits, values
