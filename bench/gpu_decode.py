"""`make gpu-check`'s "profile hf decode" (bench/gpu_profile.py plans it, bench/gpu_check.py runs it in a child
process): the HF engine's ms per decoding step on Pythia-1B at batch 64, dynamic vs static cache, and what each
repeats bit for bit on the card it runs on (docs/gpu.md, "The HF engine on a GPU")."""

from __future__ import annotations

import time

# Pythia-1B as published (GPTNeoXConfig of EleutherAI/pythia-1b) / a tiny one for the dry run
DECODE_1B = dict(hidden=2048, layers=16, heads=8, intermediate=8192, vocab=50304, batch=64, prompt=512, new=53)
DECODE_TINY = dict(hidden=64, layers=2, heads=2, intermediate=128, vocab=512, batch=4, prompt=16, new=8)


def _pythia(device, hidden: int, layers: int, heads: int, intermediate: int, vocab: int, prompt: int, new: int, **_):
    """A random GPT-NeoX in float32 (the learner's master weights) with Pythia's choices (rlhf.models.tiny's
    `pythia_config`, as the pipeline's models): parallel residual, rotary on a quarter of each head, untied
    embeddings."""
    import torch
    from transformers import GPTNeoXForCausalLM

    from rlhf.models.tiny import pythia_config

    sizes = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=intermediate
    )
    positions = max(2048, prompt + new)
    ids = dict(bos_token_id=0, eos_token_id=vocab - 1, pad_token_id=1)
    cfg = pythia_config(vocab_size=vocab, max_position_embeddings=positions, **sizes, **ids)
    torch.manual_seed(0)
    with torch.device(device):
        return GPTNeoXForCausalLM(cfg).eval()


def _compile_config(backend: str | None):
    """None: the engine's default (transformers compiles on a GPU only). A backend: compile with it on any device, as
    the dry run does on the CPU with `eager` (dynamo's tracing, no code generated), through transformers' own flag."""
    if backend is None:
        return None
    from transformers import CompileConfig

    config = CompileConfig(backend=backend, dynamic=False)
    config._compile_all_devices = True
    return config


def _call(engine, prompts: list[list[int]], new: int, device) -> tuple[float, object]:
    """Seconds of one engine call (receive reads the tokens back, so the device is done when it returns)."""
    import torch

    from rlhf.generation.base import SamplingParams

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    engine.submit(prompts, SamplingParams(k=1, max_new_tokens=new, temperature=0.7))
    gen = engine.receive()
    return time.perf_counter() - start, gen


def _decode_path(engine, prompts: list[list[int]], new: int, repeats: int, device) -> tuple[dict, object]:
    """One path's figures (`hf_decode`) and its first seeded call's output."""
    import statistics

    import torch

    figures = {"first_s": round(_call(engine, prompts, new, device)[0], 2)}
    _call(engine, prompts, new, device)
    seeded = []
    for _ in range(2):
        torch.manual_seed(0)
        seeded.append(_call(engine, prompts, new, device)[1])
    a, b = seeded
    figures["repeats"] = torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    full = statistics.median(_call(engine, prompts, new, device)[0] for _ in range(repeats))
    one = statistics.median(_call(engine, prompts, 1, device)[0] for _ in range(repeats))
    return {**figures, "ms": round((full - one) / (new - 1) * 1000, 3), "prefill_ms": round(one * 1000, 1)}, a


def hf_decode(device, batch: int, prompt: int, new: int, repeats: int, backend: str | None, **shape) -> dict:
    """The HF engine's ms per decoding step, dynamic vs static cache, at `batch` prompts of `prompt` random tokens
    (k = 1), sampling under bf16 autocast from float32 weights as the learner does. A step: (a call of `new` tokens -
    a call of 1, the prefill) / (new - 1), each the median of `repeats` calls after two warm-up calls (the static path
    compiles in the first, CUDA graphs record in the second: `*_first_s`). Also: a seeded call made twice samples the
    same tokens and log-probs bit for bit (`*_repeats`); the share of rows both paths sample alike from one seed; the
    graphs dynamo compiled (1: no recompilation across calls)."""
    import torch
    import torch._dynamo

    from rlhf.generation.hf import HFEngine

    model = _pythia(device, prompt=prompt, new=new, **shape)
    eos = model.config.eos_token_id
    prompts = torch.randint(2, eos, (batch, prompt), generator=torch.Generator().manual_seed(1)).tolist()
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    torch._dynamo.reset()
    figures, first = {}, {}
    for path in ("dynamic", "static"):
        engine = HFEngine(model, 1, eos, device, autocast, decode=path, compile_config=_compile_config(backend))
        got, first[path] = _decode_path(engine, prompts, new, repeats, device)
        figures |= {f"{path}_{k}": v for k, v in got.items()}
        engine.close()
    best = min(("dynamic", "static"), key=lambda p: figures[f"{p}_ms"])
    alike = (first["dynamic"].responses == first["static"].responses).all(dim=1).float().mean().item()
    figures |= {"faster": best, "best_ms": figures[f"{best}_ms"], "rows_alike": round(alike, 3)}
    return {**figures, "static_graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}
