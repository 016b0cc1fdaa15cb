"""`rlhf report`: the pipeline's headline metrics as a short table (what `make run` prints at the end)."""

from __future__ import annotations

from rlhf.config import Config
from rlhf.io import read_json

HEADLINES = {
    "gold": ["accuracy"],
    "reward": ["agreement_heldout", "n_pairs"],
    "train": [
        "first/objective/scores",
        "final/objective/scores",
        "first/objective/gold",
        "final/objective/gold",
        "final/objective/kl",
    ],
    "eval": [
        "gold/win_rate_vs_sft",
        "gold/win_rate_vs_reference",
        "gold/sft_win_rate_vs_reference",
        "gold/policy",
        "gold/sft",
        "kl/policy_sft_mean",
        "proxy/policy",
        "proxy/sft",
    ],
}


def print_report(cfg: Config) -> int:
    rows = []
    for stage, keys in HEADLINES.items():
        path = cfg.path("metrics", f"{stage}.json")
        if not path.exists():
            rows.append((stage, "(not run)", ""))
            continue
        metrics = read_json(path)
        rows += [
            (stage, key, f"{metrics[key]:.4g}" if isinstance(metrics[key], float) else str(metrics[key]))
            for key in keys
            if key in metrics
        ]
    width = max(len(r[1]) for r in rows)
    print(f"profile {cfg.profile}, trainer {cfg.train.trainer}")
    for stage, key, value in rows:
        print(f"  {stage:<7} {key:<{width}}  {value}")
    return 0
