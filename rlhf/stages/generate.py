"""Stage `generate`: near-greedy responses of the trained policy and of the SFT policy on the eval prompts.

Output: data/generations (HF dataset, schema Generations: prompt_id, prompt, response, model).
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm import tqdm

from rlhf.algorithms.common import truncate_after_eos
from rlhf.config import Config
from rlhf.generation.base import SamplingParams
from rlhf.generation.hf import HFEngine

MODELS = {"policy": ("train", "policy"), "sft": ("sft",)}


def generate_texts(model, tokenizer, prompts: list[str], params: SamplingParams, batch_size: int, desc: str) -> list[str]:
    """One response per prompt (params.k = 1), decoded up to the first EOS."""
    engine = HFEngine(model, tokenizer.pad_token_id, tokenizer.eos_token_id)
    out: list[str] = []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc):
        engine.submit(tokenizer(prompts[i : i + batch_size])["input_ids"], params)
        tokens, mask, _ = truncate_after_eos(engine.receive().responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
        out += tokenizer.batch_decode(tokens.masked_fill(~mask, tokenizer.pad_token_id), skip_special_tokens=True)
    return out


def run(cfg: Config) -> dict:
    from rlhf.data.schemas import EvalPrompts, Generations, validate
    from rlhf.data.splits import load_split, save_splits
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    prompts = load_split(cfg.path("prepared"), "eval_prompts", EvalPrompts)
    params = SamplingParams(k=1, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature)
    frames = []
    for name, parts in MODELS.items():
        torch.manual_seed(cfg.seed)
        folder = cfg.path(*parts)
        texts = generate_texts(load_causal_lm(folder), load_tokenizer(folder), list(prompts["prompt"]), params, cfg.eval.batch_size, f"generate: {name}")
        frames.append(pd.DataFrame({"prompt_id": prompts["prompt_id"], "prompt": prompts["prompt"], "response": texts, "model": name}))
    generations = pd.concat(frames, ignore_index=True)
    validate(generations, Generations, "generations")
    save_splits({"eval": generations}, cfg.path("generations"))
    print(f"generate: {len(prompts)} eval prompts x {len(MODELS)} models -> {cfg.path('generations')}")
    return {"n": len(generations)}
