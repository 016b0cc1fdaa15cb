"""Sample, post-process, decode and (optionally) score, in batches: what the reward, generate and evaluate stages
and the benchmarks do with a policy outside the training loop."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rlhf.generation.base import Engine, SamplingParams
from rlhf.generation.hf import HFEngine
from rlhf.models.batch import ModelInput, assemble


@dataclass
class Sampled:
    batch: ModelInput  # prompts + responses cut after their first EOS, (B*K, C+T), on the model's device
    texts: list[str]  # the responses, decoded, special tokens dropped (B*K)
    scores: torch.Tensor | None  # (B*K,) what `score` returned, before any missing-EOS penalty


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str] | Sequence[list[int]],
    params: SamplingParams,
    batch_size: int,
    device: torch.device,
    score: Callable[[ModelInput, list[str]], torch.Tensor] | None = None,
    desc: str | None = None,
    engine: Engine | None = None,
) -> Iterator[Sampled]:
    """K samples per prompt from `model` (on `device`) with HF generate (the global torch RNG: seed it first), or
    with `engine` (rlhf.generation.factory.make_engine) when given.

    prompts: texts (tokenised here, as everywhere in the pipeline) or token id lists. Each batch comes back on
    `device`. score: a reward function (rlhf.rewards.proxy) applied to each batch. desc: a progress bar's label
    (None = no bar).
    """
    engine = engine or HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id, device)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=desc is None):
        chunk = list(prompts[i : i + batch_size])
        ids = tokenizer(chunk)["input_ids"] if isinstance(chunk[0], str) else chunk
        engine.submit(ids, params)
        batch = assemble(ids, engine.receive().responses, params.k, pad, eos).to(device)
        texts = batch.texts(tokenizer)
        yield Sampled(batch, texts, None if score is None else score(batch, texts))


@contextlib.contextmanager
def stage_engine(
    kind: str,
    folder: Path,
    tokenizer,
    prompts: Sequence[str] | Sequence[list[int]],
    max_new_tokens: int,
    device: torch.device,
    seed: int,
) -> Iterator[Engine | None]:
    """The engine a stage samples the model in `folder` with (its `engine` setting), closed on exit: "vllm" builds a
    vLLM engine on the folder; "hf" gives None, which `sample` reads as HF generate on the loaded model.
    prompts: those it will sample (texts or token id lists, as for `sample`), for the engine's context length."""
    if kind == "hf":
        yield None
        return
    from rlhf.generation.factory import local_spec, make_engine

    ids = tokenizer(list(prompts))["input_ids"] if isinstance(prompts[0], str) else prompts
    longest = max(map(len, ids)) + max_new_tokens
    engine = make_engine(local_spec("vllm", folder, tokenizer, device, seed=seed, max_model_len=longest))
    try:
        yield engine
    finally:
        engine.close()
