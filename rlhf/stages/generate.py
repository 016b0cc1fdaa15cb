"""Stage `generate`: near-greedy responses of the trained policy, of the policies kept through training
(train.eval_checkpoints: `policy@<episode>`) and of the SFT policy on the eval prompts.

Output: data/generations (HF dataset, schema Generations: prompt_id, prompt, response, model). eval.processes
models sample at once, each in its own process (rlhf.runtime.map_in_processes), each seeded alike: the same texts.
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


def processes(cfg: Config, device: torch.device) -> int:
    """How many models generate and evaluate work on at once (eval.processes): one on a GPU, whose memory the
    models' engines would share."""
    return cfg.eval.processes if device.type == "cpu" else 1


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import Generations, validate
    from rlhf.data.splits import load_task_split, save_splits

    prompts = load_task_split(cfg.path("prepared"), "eval_prompts", cfg.data.source)
    names = models(cfg)
    jobs = [(cfg, name, folder, list(prompts["prompt"])) for name, (folder, _) in names.items()]
    responses = runtime.map_in_processes(_responses, jobs, processes(cfg, runtime.device()))
    frames = [
        pd.DataFrame({"prompt_id": prompts["prompt_id"], "prompt": prompts["prompt"], "response": texts, "model": name})
        for name, texts in zip(names, responses)
    ]
    generations = pd.concat(frames, ignore_index=True)
    validate(generations, Generations, "generations")
    save_splits({"eval": generations}, cfg.path("generations"))
    print(f"generate: {len(prompts)} eval prompts x {len(names)} models -> {cfg.path('generations')}")
    return {"n": len(generations)}


def _responses(job: tuple[Config, str, Path, list[str]]) -> list[str]:
    """The near-greedy responses of the model `name` saved in `folder` to the prompts (texts), in order."""
    from rlhf.models.loading import encode_prompts, load_causal_lm, load_tokenizer

    cfg, name, folder, prompts = job
    params = SamplingParams(k=1, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature)
    device = runtime.device()
    torch.manual_seed(cfg.seed)  # a model's samples must not depend on how much randomness the others used
    tokenizer = load_tokenizer(folder)
    ids = encode_prompts(tokenizer, prompts, cfg.data.chat_template)
    with stage_engine(cfg.eval.engine, folder, tokenizer, ids, params.max_new_tokens, device, cfg.seed) as e:
        model = load_causal_lm(folder).to(device) if e is None else None  # vLLM loads the folder itself
        batches = sample(model, tokenizer, ids, params, cfg.eval.batch_size, device, desc=name, engine=e)
        return [text for s in batches for text in s.texts]
