"""Where the math task (issue 18) starts: SmolLM2-135M-Instruct's exact-match accuracy on generated word problems,
greedy, with and without its chat template, by difficulty.

Usage:
    .venv/bin/python -m rlhf.runtime python bench/math_baseline.py [--problems 300] [--max-new-tokens 128]
Problems: rlhf.data.math (seed 99: other problems than the pipeline's, whose seed is params.yaml's); answers read
by rlhf.rewards.rule. The metrics file holds the figures of the instruction as it was then ("Solve the problem. End
with 'The answer is N.'"); the pipeline's evaluate stage measures the profile's own SFT policy.
Prints the accuracy table and a few outputs; writes bench/metrics/math_baseline.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from common import cpu_flags, positive_int, run_main  # bench/ is sys.path[0]
from engines import model_folder

ROOT = Path(__file__).resolve().parent.parent


def prompts_for(tokenizer, questions: list[str], chat: bool) -> list[list[int]]:
    """Token ids: the task's prompts (question + instruction) in the tokenizer's chat template, as the pipeline
    encodes them, or in a plain "Question: ... Answer:" frame."""
    from rlhf.data.math import INSTRUCTION
    from rlhf.models.loading import encode_prompts

    if chat:
        return encode_prompts(tokenizer, [f"{q} {INSTRUCTION}" for q in questions], "auto")
    return tokenizer([f"Question: {q} {INSTRUCTION}\nAnswer:" for q in questions])["input_ids"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=positive_int, default=300)
    ap.add_argument("--max-new-tokens", type=positive_int, default=128)
    args = ap.parse_args()

    import torch

    from rlhf.data.math import problems
    from rlhf.generation.base import SamplingParams
    from rlhf.generation.factory import local_spec, make_engine
    from rlhf.io import write_json
    from rlhf.models.loading import load_tokenizer
    from rlhf.rewards.rule import rule_score

    folder = model_folder("smollm2")
    tok = load_tokenizer(folder)
    df = problems(args.problems, seed=99)
    results = {}
    for chat in (False, True):
        ids = prompts_for(tok, df["prompt"].tolist(), chat)
        longest = max(map(len, ids)) + args.max_new_tokens
        engine = make_engine(local_spec("vllm", folder, tok, torch.device("cpu"), seed=0, max_model_len=longest))
        try:
            engine.submit(ids, SamplingParams(k=1, max_new_tokens=args.max_new_tokens, temperature=0.0))
            responses = engine.receive().responses
        finally:
            engine.close()
        texts = tok.batch_decode(responses, skip_special_tokens=True)
        correct = [rule_score(t, a) for t, a in zip(texts, df["answer"])]
        name = "chat_template" if chat else "raw_prompt"
        results[name] = {"accuracy": sum(correct) / len(correct)}
        for level in (1, 2, 3):
            picked = [c for c, d in zip(correct, df["difficulty"]) if d == level]
            results[name][f"accuracy_difficulty_{level}"] = sum(picked) / len(picked)
        print(f"\n{name}: accuracy {results[name]['accuracy']:.3f}; examples:")
        for q, a, t in list(zip(df["prompt"], df["answer"], texts))[:3]:
            print(f"  Q: {q}  (answer {a})\n  A: {t.strip()[:200]!r}")
    print(f"\nSmolLM2-135M-Instruct, greedy, {args.problems} problems (CPU: {cpu_flags()})")
    print(f"{'prompt':<16}{'all':>8}{'level 1':>9}{'level 2':>9}{'level 3':>9}")
    for name, r in results.items():
        cells = [r["accuracy"], *(r[f"accuracy_difficulty_{lv}"] for lv in (1, 2, 3))]
        print(f"{name:<16}" + "".join(f"{c:>9.3f}" for c in cells))
    write_json(ROOT / "bench" / "metrics" / "math_baseline.json", {**results, "cpu_flags": cpu_flags()})


if __name__ == "__main__":
    sys.exit(run_main(main))
