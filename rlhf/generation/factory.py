"""The one engine factory: train.engine name -> an Engine (rlhf.generation.base) ready to sample."""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf.generation.base import Engine


def make_engine(
    name: str,
    model: torch.nn.Module,
    model_folder: Path,
    tokenizer,
    *,
    device: torch.device,
    seed: int,
    max_model_len: int,
    work_dir: Path,
    max_staleness: int = 1,
    dtype: str = "float32",
    reward=None,
    score: str = "never",
) -> Engine:
    """An engine for rlhf.presets.ENGINES `name`.

    hf: HF generate on `model` itself (the training model, on `device`: nothing to copy). vllm / vllm_async: a vLLM
    engine started from the HF safetensors folder `model_folder` (version 0, the weights `model` starts from);
    `work_dir` receives the weight snapshots (one folder per version, old ones deleted). vllm_async samples up
    to `max_staleness` batches ahead in its own process; given `reward` (a rlhf.rewards.proxy.RewardSpec) it
    can score batches there too, as `score` says (rlhf.generation.async_engine).
    """
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ValueError(
            f"the tokenizer needs eos and pad tokens (eos={tokenizer.eos_token_id}, pad={tokenizer.pad_token_id})"
        )
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if name == "hf":
        from rlhf.generation.hf import HFEngine

        return HFEngine(model, device=device, **ids)
    model_folder, work_dir = Path(model_folder), Path(work_dir)
    if dtype == "auto":  # bf16 where it is native (GPUs); on these CPUs float32 (docs/gpu.md)
        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    if not (model_folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{model_folder / 'config.json'}: missing; the vLLM engine needs a saved HF model folder"
        )
    work_dir.mkdir(parents=True, exist_ok=True)
    common = dict(seed=seed, max_model_len=max_model_len, work_dir=work_dir, dtype=dtype, **ids)
    if name == "vllm":
        from rlhf.generation.vllm import VLLMEngine

        return VLLMEngine(model_folder, **common)
    if name == "vllm_async":
        from rlhf.generation.async_engine import AsyncEngine

        if max_staleness < 1:
            raise ValueError(f"max_staleness must be >= 1 for the vllm_async engine, got {max_staleness}")
        return AsyncEngine(model_folder, max_staleness=max_staleness, reward=reward, score=score, **common)
    raise ValueError(f"train.engine: unknown engine {name!r} (expected hf, vllm or vllm_async)")
