"""Stage `train`: online RL with the trainer preset named by train.trainer (rlhf/presets.py lists them)."""

from __future__ import annotations

from rlhf.config import Config


def run(cfg: Config) -> dict:
    from rlhf.trainers.early import start_engine_process

    # First: an engine in its own process imports vLLM while this process imports the trainer and loads models.
    engine_process = start_engine_process(cfg)
    try:
        from rlhf.trainers.loop import train

        final = train(cfg, engine_process)
    finally:
        if engine_process is not None:
            engine_process.close(at_once=True)  # a no-op once the engine has closed it; else it never built
    if final:
        print(
            f"train [{cfg.train.trainer}]: "
            + ", ".join(
                f"{k}={v:.4g}" for k, v in sorted(final.items()) if k.startswith(("first/", "final/objective/"))
            )
        )
    return final
