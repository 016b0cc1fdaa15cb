"""Stage `train`: online RL with the trainer preset named by train.trainer (rlhf/presets.py lists them)."""

from __future__ import annotations

from rlhf.config import Config


def run(cfg: Config) -> dict:
    from rlhf.trainers.loop import train

    final = train(cfg)
    if final:
        print(
            f"train [{cfg.train.trainer}]: "
            + ", ".join(
                f"{k}={v:.4g}" for k, v in sorted(final.items()) if k.startswith(("first/", "final/objective/"))
            )
        )
    return final
