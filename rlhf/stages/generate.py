"""Stage `generate`: near-greedy responses of the trained policy, of the policies kept through training
(train.eval_checkpoints: `policy@<episode>`) and of the SFT policy on the eval prompts.

Output: data/generations (HF dataset, schema Generations: prompt_id, prompt, response, model).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch

from rlhf import runtime
from rlhf.config import Config
from rlhf.generation.base import SamplingParams
from rlhf.generation.sampling import sample, stage_engine
from rlhf.trainers.frontier import kept_policies


def models(cfg: Config) -> dict[str, tuple[Path, int]]:
    """The policies the eval stages compare, by name, with the episodes each was trained on: the trained policy,
    the SFT policy and those kept through training."""
    kept = {f"policy@{episode}": (folder, episode) for episode, folder in kept_policies(cfg.path("train"))}
    return {"policy": (cfg.path("train", "policy"), cfg.train.total_episodes), "sft": (cfg.path("sft"), 0), **kept}


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import Generations, validate
    from rlhf.data.splits import load_task_split, save_splits
    from rlhf.models.loading import encode_prompts, load_causal_lm, load_tokenizer

    prompts = load_task_split(cfg.path("prepared"), "eval_prompts", cfg.data.source)
    params = SamplingParams(k=1, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature)
    frames, device = [], runtime.device()
    names = models(cfg)
    for name, (folder, _) in names.items():
        torch.manual_seed(cfg.seed)
        tokenizer = load_tokenizer(folder)
        ids = encode_prompts(tokenizer, list(prompts["prompt"]), cfg.data.chat_template)
        with stage_engine(cfg.eval.engine, folder, tokenizer, ids, params.max_new_tokens, device, cfg.seed) as e:
            model = load_causal_lm(folder).to(device) if e is None else None  # vLLM loads the folder itself
            batches = sample(model, tokenizer, ids, params, cfg.eval.batch_size, device, desc=name, engine=e)
            texts = [text for s in batches for text in s.texts]
        frames.append(
            pd.DataFrame(
                {"prompt_id": prompts["prompt_id"], "prompt": prompts["prompt"], "response": texts, "model": name}
            )
        )
    generations = pd.concat(frames, ignore_index=True)
    validate(generations, Generations, "generations")
    save_splits({"eval": generations}, cfg.path("generations"))
    print(f"generate: {len(prompts)} eval prompts x {len(names)} models -> {cfg.path('generations')}")
    return {"n": len(generations)}
