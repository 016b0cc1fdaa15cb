"""Rollout throughput: vLLM (CPU build) vs HF `generate` on the same prompts, samples and lengths.

Usage:
    .venv/bin/python -m rlhf.runtime python bench/engines.py --model smollm2      # the packaged SmolLM2-135M
    .venv/bin/python -m rlhf.runtime python bench/engines.py --model data/sft     # any saved policy folder
Needs data/prepared (prompts). Prints generated tokens/s of each engine and their ratio; writes
bench/metrics/engines_<model>.json (a DVC metrics file). Engine start-up is reported apart, not in tokens/s. Both
engines are warmed alike, on one batch of other prompts than the timed ones (first-call allocations, kernels).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from common import positive_int, run_main  # bench/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent


def model_folder(name: str) -> Path:
    """A safetensors folder vLLM can load: the packaged SmolLM2 is de-quantised and saved once."""
    if name != "smollm2":
        if not (Path(name) / "config.json").is_file():
            raise FileNotFoundError(f"{name}: model folder not found (a saved policy folder holds config.json)")
        return Path(name)
    folder = ROOT / ".cache" / "bench" / "smollm2"
    if not (folder / "config.json").exists():
        from rlhf.models.loading import load_smollm2, save_pretrained

        save_pretrained(*load_smollm2(), folder)
    return folder


def generated_tokens(responses, eos: int) -> int:
    """Tokens actually generated: up to and including the first EOS of each row."""
    from rlhf.algorithms.common import truncate_after_eos

    return int(truncate_after_eos(responses, eos, eos)[1].sum())


def run_engine(engine, batches, params, eos: int) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for batch in batches:
        engine.submit(batch, params)
        start = time.perf_counter()
        out = engine.receive()
        seconds += time.perf_counter() - start
        tokens += generated_tokens(out.responses, eos)
    return seconds, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 or a saved policy folder")
    ap.add_argument("--prompts", type=positive_int, default=64)
    ap.add_argument("--batch", type=positive_int, default=16, help="prompts per batch")
    ap.add_argument("--k", type=positive_int, default=2)
    ap.add_argument("--tokens", type=positive_int, default=32, help="max new tokens")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines' precision")
    ap.add_argument("--data", default=str(ROOT / "data" / "prepared"))
    args = ap.parse_args()
    folder = model_folder(args.model)  # a wrong name: refused before the imports

    import torch

    from rlhf import runtime
    from rlhf.data.schemas import EvalPrompts
    from rlhf.data.splits import load_split
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.factory import local_spec, make_engine
    from rlhf.generation.hf import HFEngine
    from rlhf.io import write_json
    from rlhf.models.loading import load_causal_lm, load_tokenizer

    runtime.configure()

    tokenizer = load_tokenizer(folder)
    texts = list(load_split(Path(args.data), "eval_prompts", EvalPrompts)["prompt"])[: args.prompts + args.batch]
    ids = tokenizer(texts)["input_ids"]
    warm_up, ids = ids[args.prompts :], ids[: args.prompts]  # not timed, and not among the timed prompts
    if len(warm_up) < args.batch:
        raise SystemExit(f"engines: --prompts {args.prompts} + --batch {args.batch} is more than the eval prompts")
    batches = [ids[i : i + args.batch] for i in range(0, len(ids), args.batch)]
    params = SamplingParams(k=args.k, max_new_tokens=args.tokens, temperature=0.7)
    eos = tokenizer.eos_token_id
    max_len = max(map(len, ids + warm_up)) + args.tokens

    torch.manual_seed(0)
    device = runtime.device()
    hf = HFEngine(load_causal_lm(folder, getattr(torch, args.dtype)).to(device), tokenizer.pad_token_id, eos, device)
    run_engine(hf, [warm_up], params, eos)
    hf_seconds, hf_tokens = run_engine(hf, batches, params, eos)
    work = ROOT / ".cache" / "bench" / "engine"
    limits = dict(seed=0, max_model_len=max_len, work_dir=work, dtype=args.dtype)
    engine = make_engine(local_spec("vllm", folder, tokenizer, device, **limits))
    try:
        run_engine(engine, [warm_up], params, eos)
        vllm_seconds, vllm_tokens = run_engine(engine, batches, params, eos)
    finally:
        engine.close()
    result = {
        "hf_tokens_per_second": hf_tokens / hf_seconds,
        "vllm_tokens_per_second": vllm_tokens / vllm_seconds,
        "vllm_start_seconds": engine.start_seconds,
        "hf_tokens": hf_tokens,
        "vllm_tokens": vllm_tokens,
    }
    result["vllm_over_hf"] = result["vllm_tokens_per_second"] / result["hf_tokens_per_second"]
    name = "smollm2" if args.model == "smollm2" else Path(args.model).name
    name += "" if args.dtype == "float32" else f"_{args.dtype}"
    print(
        f"\nrollouts of {folder.name}: {len(ids)} prompts x k={args.k} x <= {args.tokens} tokens, batches of "
        f"{args.batch} prompts, {args.dtype}, one thread each"
    )
    print(f"  HF generate  {result['hf_tokens_per_second']:9.1f} tokens/s  ({hf_tokens} tokens in {hf_seconds:.1f} s)")
    print(
        f"  vLLM         {result['vllm_tokens_per_second']:9.1f} tokens/s  ({vllm_tokens} tokens in "
        f"{vllm_seconds:.1f} s; start-up {engine.start_seconds:.1f} s)"
    )
    print(f"  vLLM / HF    {result['vllm_over_hf']:9.2f}x")
    write_json(ROOT / "bench" / "metrics" / f"engines_{name}.json", result)


if __name__ == "__main__":
    sys.exit(run_main(main))
