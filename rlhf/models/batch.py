"""The batch layout every forward pass uses: `sequences = [left-padded prompt (C) | response (T)]`, (n, C+T).

Position ids come from the attention mask, so left padding does not shift positions. Rows are prompt-major:
the K samples of prompt b are rows b*K .. b*K+K-1. Validity comes from the position of the first EOS, never
from pad ids (pad may equal EOS, as in SmolLM2 and Pythia).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from rlhf.algorithms.common import truncate_after_eos


def pad_right(rows: list[list[int]], length: int, pad_id: int) -> torch.Tensor:
    """Token id lists -> (n, length) long, cut to `length` and right-padded with pad_id (on the CPU: I/O)."""
    cut = [list(r[:length]) for r in rows]
    padded = [r + [pad_id] * (length - len(r)) for r in cut]
    return torch.tensor(padded, dtype=torch.long) if padded else torch.full((0, length), pad_id, dtype=torch.long)


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists -> ids (n, C) and a bool mask (n, C) (on the CPU: I/O). Padded as Python lists, then
    one tensor: a copy into a tensor a row was 3 ops a row."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.long)
    starts = torch.tensor([width - len(r) for r in rows])
    return ids, torch.arange(width)[None, :] >= starts[:, None]


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

    def to(self, device: torch.device | str) -> ModelInput:
        """The same batch with every tensor on `device` (`to_device`)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return ModelInput(**{k: to_device(v, device) if torch.is_tensor(v) else v for k, v in values.items()})

    def texts(self, tokenizer) -> list[str]:
        """The responses as text, special tokens dropped (decode a host batch: on a device this reads it back)."""
        responses = self.sequences[:, self.context :].masked_fill(~self.response_mask, tokenizer.pad_token_id)
        return tokenizer.batch_decode(
            responses if responses.device.type == "cpu" else responses.cpu(), skip_special_tokens=True
        )

    def spans(self, k: int) -> list[tuple[int, int]]:
        """Per prompt (B): its prompt's tokens and its K responses' longest, as Python ints; of a host batch (the
        loop's assembled one), so reading them stops no device. Micro-batches take their shapes from them
        (`micro_batch_columns`) without reading the device."""
        prompt = self.attn[::k, : self.context].sum(1)
        longest = self.response_mask.sum(1).view(-1, k).amax(1)
        return [tuple(pair) for pair in host_list(torch.stack([prompt, longest], 1))]

    def response_ids(self) -> list[list[int]]:
        """Each response's real tokens (EOS included when there is one)."""
        responses, masks = self.sequences[:, self.context :].cpu(), self.response_mask.cpu()  # one copy, then I/O
        return [row[mask].tolist() for row, mask in zip(responses, masks)]


def assemble(prompts: list[list[int]], responses: torch.Tensor, k: int, pad_id: int, eos_id: int) -> ModelInput:
    """Prompts (B token lists) + raw sampled responses (B*K, T) -> model input, responses cut after the first
    EOS. The learner and the async engine's scorer both build their inputs here, so their scores agree.
    The result is on the responses' device."""
    prompt_ids, prompt_mask = (to_device(t, responses.device) for t in pad_left(prompts, pad_id))
    responses, response_mask, has_eos = truncate_after_eos(responses, eos_id, pad_id)
    attn, positions = attention_and_positions(prompt_mask.repeat_interleave(k, 0), response_mask)
    sequences = torch.cat([prompt_ids.repeat_interleave(k, 0), responses], dim=1)
    return ModelInput(prompt_ids, sequences, attn, positions, response_mask, has_eos, prompt_ids.shape[1])


def attention_and_positions(
    prompt_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C) and (n, T) bool masks -> attention mask (n, C+T) long and position ids (n, C+T)."""
    attn = torch.cat([prompt_mask, response_mask], dim=1).long()
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return attn, positions


MIN_BUCKET = 16  # columns: below this, a shorter shape saves less than a new shape costs (a graph, an allocation)
BUCKETS = 4  # shapes per dimension at most: a micro-batch's prompt and response widths each round up to 1/4 steps


def bucket(columns: int, width: int) -> int:
    """`columns` rounded up to the next of a few fixed widths of a dimension `width` wide: multiples of
    max(MIN_BUCKET, width / BUCKETS), capped at `width`. E.g. width 53: 16, 32, 48, 53; width 600: 150 ... 600."""
    step = max(MIN_BUCKET, math.ceil(width / BUCKETS))
    return min(width, math.ceil(columns / step) * step)


def micro_batch_columns(
    spans: list[tuple[int, int]], prompts: Iterable[int], context: int, T: int, bucketed: bool
) -> tuple[int, int]:
    """(first column, response columns) a micro-batch of `prompts` (indices into `spans`, ModelInput.spans) keeps:
    the prompt columns its longest prompt reaches and the response columns its longest response reaches; `bucketed`
    (on a GPU), each rounded up to a bucket (`bucket`), so a run's micro-batches take a few shapes instead of one
    each. On the CPU the exact cut: no graphs to replay there, and the results stay those of the exact cut."""
    prompt = max(spans[i][0] for i in prompts)
    response = max(max(spans[i][1] for i in prompts), 1)
    if bucketed:
        prompt, response = bucket(prompt, context), bucket(response, T)
    return context - prompt, response


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`. To an accelerator without waiting: a blocking copy from the host makes PyTorch synchronise
    the CUDA stream (the host waits for every kernel queued), while CUDA stages a non-blocking one from pageable host
    memory at once, so the host tensor may go. Back to the host blocking, so the values are there when read. A
    tensor already there is returned as it is: `.to` would still be an op dispatched (~20 a batch on the CPU)."""
    device = torch.device(device)
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def row_chunks(chunk: int, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """The tensors' rows `chunk` at a time, as tuples of views; the tensors themselves when one chunk holds all their
    rows, as it does in training (a slice is an op dispatched, ~3 a forward). Shapes: each (n, ...)."""
    n = len(tensors[0])
    if n <= chunk:
        return [tensors]
    return [tuple(t[i : i + chunk] for t in tensors) for i in range(0, n, chunk)]


def host_list(t: torch.Tensor) -> list:
    """A host tensor's values as Python numbers: the loop's bookkeeping, kept on the CPU (prompt and micro-batch
    order, lengths). Refuses a device tensor: reading one would make the host wait for the device's queue."""
    if t.device.type != "cpu":
        raise ValueError(f"host_list: a tensor on {t.device}; the loop reads device tensors once per batch only")
    return t.tolist()


def trim_padding(mb: dict[str, torch.Tensor], first: int, t: int) -> dict[str, torch.Tensor]:
    """A micro-batch without the columns that are padding in every row: the prompt's columns before `first` and the
    response's columns from `t` on (`micro_batch_columns` finds them on the host). The forward computes the same
    numbers for the real tokens (causal attention, explicit positions, masked losses), on fewer tokens: a micro-batch
    of short answers no longer pays for the longest answer of the whole batch, or for max_new_tokens.

    mb: the loop's per-prompt tensors (rlhf.trainers.objectives), "sequences", "attn", "positions" (P, K, C+T) and
    "mask" (P, K, T) bool; every other 3-dim tensor whose last dim is T is per response token and is cut alike;
    tensors of other shapes pass unchanged."""
    T = mb["mask"].shape[-1]
    C = mb["attn"].shape[-1] - T
    out = {}
    for name, x in mb.items():
        if name in ("sequences", "attn", "positions") and (first, t) != (0, T):  # a slice is an op even when whole
            out[name] = x[..., first : C + t]
        elif x.dim() == 3 and x.shape[-1] == T and t != T:
            out[name] = x[..., :t]
        else:
            out[name] = x
    return out
