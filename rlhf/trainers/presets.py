"""The public trainers of the original system as presets: a name -> (algorithm, generation engine).

A trainer is not a class hierarchy: it is one row here. `train.engine` overrides the engine of any preset,
so asynchronous generation works for every algorithm, not only DPO.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    public_name: str  # the original system's class name
    algorithm: str  # key of rlhf.trainers.objectives.OBJECTIVES
    engine: str  # hf | vllm (colocated, blocking) | vllm_async (own process, max_staleness updates stale)


PRESETS: dict[str, Preset] = {
    "ppo": Preset("PPOv2Trainer", "ppo", "hf"),
    "rloo": Preset("RLOOTrainer", "rloo", "hf"),
    "online_dpo": Preset("OnlineDPOTrainer", "online_dpo", "hf"),
    "online_dpo_single_vllm": Preset("OnlineDPOSingleVLLMTrainer", "online_dpo", "vllm"),
    "online_dpo_vllm": Preset("OnlineDPOVLLMTrainer", "online_dpo", "vllm_async"),
    "bok": Preset("OnlineBoKTrainer", "bok", "hf"),
    "grpo": Preset("GRPOTrainer", "grpo", "hf"),
}


def resolve(trainer: str, engine_override: str | None) -> tuple[str, str]:
    """(algorithm, engine) for a trainer name and an optional engine override."""
    preset = PRESETS[trainer]
    return preset.algorithm, engine_override or preset.engine
