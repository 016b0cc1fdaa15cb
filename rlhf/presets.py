"""The trainers and generation engines, by name: the one place either list is written down.

A trainer is not a class hierarchy: it is one row here, (algorithm, engine). `train.engine` overrides the engine
of any preset, so asynchronous generation works for every algorithm, not only DPO. The config validates names
against these tables, `rlhf train --help` lists them, the Prefect flow makes one deployment per trainer, and the
loop picks its objective by `Preset.algorithm` (rlhf.trainers.objectives.OBJECTIVES has one entry per algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    public_name: str  # the original system's class name
    algorithm: str  # key of rlhf.trainers.objectives.OBJECTIVES
    engine: str  # key of ENGINES


@dataclass(frozen=True)
class EngineKind:
    """What a train.engine name means, said once: the config's checks, the engine's placement and the trainer's
    setup read these traits, never the name."""

    description: str
    vllm: bool  # a vLLM engine, built from an EngineSpec; else HF generate on the training model itself
    samples_ahead: bool  # in a process of its own, up to train.max_staleness batches ahead of training


ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind("HF generate on the training model itself, synchronous", vllm=False, samples_ahead=False),
    "vllm": EngineKind(
        "vLLM colocated with training, blocking: every batch sampled with the current weights",
        vllm=True,
        samples_ahead=False,
    ),
    "vllm_async": EngineKind(
        "vLLM in its own process, generating up to train.max_staleness batches ahead of training",
        vllm=True,
        samples_ahead=True,
    ),
}

PRESETS: dict[str, Preset] = {
    "ppo": Preset("PPOv2Trainer", "ppo", "hf"),
    "rloo": Preset("RLOOTrainer", "rloo", "hf"),
    "online_dpo": Preset("OnlineDPOTrainer", "online_dpo", "hf"),
    "online_dpo_single_vllm": Preset("OnlineDPOSingleVLLMTrainer", "online_dpo", "vllm"),
    "online_dpo_vllm": Preset("OnlineDPOVLLMTrainer", "online_dpo", "vllm_async"),
    "bok": Preset("OnlineBoKTrainer", "bok", "hf"),
    "grpo": Preset("GRPOTrainer", "grpo", "hf"),
}

# Algorithms that compare the samples of one prompt (k >= 2), and those whose advantages a truncated
# importance weight can scale (train.tis_cap) or whose clipped surrogate AReaL's decoupled objective weights per token
# (train.decoupled_cap).
GROUP_ALGORITHMS = ("online_dpo", "bok", "rloo", "grpo")
POLICY_GRADIENT_ALGORITHMS = ("ppo", "rloo", "grpo")


def resolve(trainer: str, engine_override: str | None) -> tuple[str, str]:
    """(algorithm, engine) for a trainer name and an optional engine override."""
    preset = PRESETS[trainer]
    return preset.algorithm, engine_override or preset.engine


def describe() -> str:
    """One line per trainer: `name (OriginalClass): algorithm on engine`, for --help texts."""
    return "\n".join(f"  {name:<23} {p.public_name:<27} {p.algorithm} on {p.engine}" for name, p in PRESETS.items())
