"""Which fitted reward head still ranks a trained policy's answers the way gold does? Issue 57 item 0's diagnosis.

The SmolLM2 profile's reward model is the SFT backbone's first 4 layers, mean-pooled over the response, with a
linear head fitted on gold-labelled pairs of SFT samples (reward.trainable: head). Its held-out agreement with gold
is measured on more SFT pairs; RL then scores a policy that drifts away from SFT. This script fits the same head
(rlhf.stages.reward's Bradley-Terry fit and L2 choice) on other features of the same backbone and scores:
- held-out: agreement with gold on the reward stage's held-out SFT pairs (what the stage reports);
- shift: agreement with gold on pairs (a trained policy's answer, SFT's answer) to the same eval prompt, from the
  finished runs given, where gold's scores differ by more than 0.02: how the head ranks what RL produces.
Features: the response's mean (`mean<L>`) or last (`last<L>`) hidden state after L layers, or both.

    .venv/bin/python -m rlhf.runtime python bench/rm_shift.py DATA_DIR [DATA_DIR ...]

Each DATA_DIR is a finished SmolLM2 run's data folder (sft/, reward/pairs, generations/eval, eval/results); the
first one's SFT model and pairs are used. Writes bench/metrics/rm_shift.json and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import ROOT, cpu_flags, run_main

LAYERS = (4, 8, 16, 30)
OUT = ROOT / "bench" / "metrics" / "rm_shift.json"


@torch.no_grad()
def features(model, tok, prompts: list[str], responses: list[str], batch: int = 32) -> dict[str, torch.Tensor]:
    """Per text, each feature (n, H): the response's mean and last hidden state after each of LAYERS layers."""
    out: dict[str, list[torch.Tensor]] = {}
    for i in range(0, len(prompts), batch):
        rows = [
            (
                tok(p, add_special_tokens=False).input_ids,
                tok(r, add_special_tokens=False).input_ids or [tok.eos_token_id],
            )
            for p, r in zip(prompts[i : i + batch], responses[i : i + batch])
        ]
        width = max(len(a) + len(b) for a, b in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id or 0)
        attn, response = torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width)
        for j, (a, b) in enumerate(rows):  # left-padded, as the loop's batches
            ids[j, width - len(a) - len(b) :] = torch.tensor(a + b)
            attn[j, width - len(a) - len(b) :], response[j, width - len(b) :] = 1, 1
        positions = (attn.cumsum(1) - 1).clamp(min=0)
        hidden = model(input_ids=ids, attention_mask=attn, position_ids=positions, output_hidden_states=True)
        for layer in LAYERS:
            h = hidden.hidden_states[layer]
            out.setdefault(f"mean{layer}", []).append((h * response[..., None]).sum(1) / response.sum(1, keepdim=True))
            out.setdefault(f"last{layer}", []).append(h[:, -1])
    return {k: torch.cat(v) for k, v in out.items()}


def shift_pairs(runs: list[Path]):
    """(prompt, policy answer, SFT answer, policy better by gold, source) for every kept policy of every run."""
    from datasets import load_from_disk

    rows = []
    for run in runs:
        generated = load_from_disk(str(run / "generations" / "eval")).to_pandas()
        scored = generated.merge(load_from_disk(str(run / "eval" / "results")).to_pandas(), on=["prompt_id", "model"])
        sft = scored[scored.model == "sft"].set_index("prompt_id")
        for name in sorted(set(scored.model) - {"sft", "reference"}):
            joined = scored[scored.model == name].set_index("prompt_id").join(sft, rsuffix="_sft")
            for row in joined.itertuples():
                if abs(row.gold - row.gold_sft) > 0.02:
                    rows.append((row.prompt, row.response, row.response_sft, row.gold > row.gold_sft, f"{run}:{name}"))
    return rows


def agreement(train: dict, test: dict, shift: dict, better: torch.Tensor, keys: list[str], seed: int) -> tuple:
    """Fit the head on the training pairs' feature differences (rlhf.stages.reward's fit), then its agreement with
    gold on the held-out pairs and on the shift pairs."""
    from rlhf.stages.reward import HEAD_L2, _bradley_terry_linear

    def diff(pair):
        return torch.cat([pair[0][k] - pair[1][k] for k in keys], 1)

    x = diff(train)
    scale = x.std(0).clamp(min=1e-6)
    z = x / scale
    order = torch.randperm(len(z), generator=torch.Generator().manual_seed(seed))
    val, fit = z[order[: len(z) // 5]], z[order[len(z) // 5 :]]
    accuracy = {l2: float(((val @ _bradley_terry_linear(fit, l2)) > 0).float().mean()) for l2 in HEAD_L2}
    w = _bradley_terry_linear(z, max(HEAD_L2, key=lambda c: (accuracy[c], c))) / scale
    held_out = float(((diff(test) @ w) > 0).float().mean())
    return held_out, float((((diff(shift) @ w) > 0) == better).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="finished SmolLM2 runs' data folders")
    args = ap.parse_args()
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf.io import write_json

    torch.set_num_threads(2)
    sft = str(args.runs[0] / "sft")
    tok, model = AutoTokenizer.from_pretrained(sft), AutoModelForCausalLM.from_pretrained(sft).eval()
    pairs = load_from_disk(str(args.runs[0] / "reward" / "pairs"))
    feats = {}
    for split in ("train", "test"):
        df = pairs[split].to_pandas()
        feats[split] = tuple(features(model, tok, list(df.prompt), list(df[c])) for c in ("chosen", "rejected"))
    rows = shift_pairs(args.runs)
    prompts = [r[0] for r in rows]
    feats["shift"] = tuple(features(model, tok, prompts, [r[i] for r in rows]) for i in (1, 2))
    better = torch.tensor([r[3] for r in rows])
    variants = [[f"{kind}{n}"] for kind in ("mean", "last") for n in LAYERS] + [
        [f"mean{n}", f"last{n}"] for n in LAYERS
    ]
    table = {}
    print(f"{'features':<16} {'held-out':>9} {'shift':>7}   ({len(rows)} shift pairs; {cpu_flags()})")
    for keys in variants:
        held_out, shift = agreement(feats["train"], feats["test"], feats["shift"], better, keys, seed=1234)
        table["+".join(keys)] = {"held_out": round(held_out, 3), "shift": round(shift, 3)}
        print(f"{'+'.join(keys):<16} {held_out:>9.3f} {shift:>7.3f}")
    write_json(OUT, {"runs": [str(r) for r in args.runs], "shift_pairs": len(rows), "agreement": table})
    print(f"rm_shift.py: wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
