"""Stage `train`: online RL with the trainer preset named by train.trainer (rlhf/presets.py lists them)."""

from __future__ import annotations

from rlhf.config import Config
from rlhf.runtime import env_int, threads_alone


def run(cfg: Config) -> dict:
    from rlhf.trainers.early import start_engine_process

    # First: the engine placed, once for the run; one in its own process imports vLLM from now on, while this
    # process imports the trainer and loads models.
    started = start_engine_process(cfg)
    if started.process is None and env_int("WORLD_SIZE", 1, minimum=1) == 1:
        # Alone on the box (generation in this process, no other training process): every core it may use. Sync
        # online DPO on `tiny`: 36.5 -> 29.3 s with HF generate, 41.9 -> 32.4 s with vLLM colocated (2 cores).
        import torch

        torch.set_num_threads(threads_alone())
    try:
        from rlhf.trainers.loop import train

        final = train(cfg, started)
    finally:
        started.close()  # a no-op once the engine has closed its process; else it never built
    if final:
        print(
            f"train [{cfg.train.trainer}]: "
            + ", ".join(
                f"{k}={v:.4g}" for k, v in sorted(final.items()) if k.startswith(("first/", "final/objective/"))
            )
        )
    return final
