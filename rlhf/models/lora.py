"""LoRA through PEFT (train.lora): the policy trains low-rank adapters while its base weights stay the SFT's.

Three consequences the rest of the code relies on, each one function here:
- the reference model is the same module with its adapters switched off (`AdaptersOff`): no second copy;
- engines and the exported policy see merged weights under the base model's own names (`merged_state_dict`),
  computed without touching the trained module: PEFT's in-place merge/unmerge would leave the base weights a
  rounding error away from the SFT's after every sync, and a resumed run (whose checkpoint holds only the
  adapters) would then differ from an uninterrupted one;
- only the adapters train, so only they reach the optimizer and the checkpoints (`trainable_names`).
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf.config import LoraConfig

ADAPTER = "default"  # PEFT's name for the one adapter a model gets


def add_adapters(model: nn.Module, settings: LoraConfig, seed: int) -> nn.Module:
    """`model` wrapped by PEFT with fresh adapters (B = 0: the policy starts exactly at the SFT's outputs; A drawn
    from `seed`, so two runs with the same settings train the same adapters)."""
    import peft

    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=settings.target_modules,
        lora_dropout=0.0,  # the learner's log-probs must be the function the engine sampled from
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, config)


def is_lora(model: nn.Module) -> bool:
    """A PEFT-wrapped model (by its class's module: a run without LoRA never imports peft)."""
    return type(model).__module__.startswith("peft.")


class AdaptersOff:
    """The reference policy of a LoRA run: the policy's forward with its adapters disabled (the SFT's function).

    Not an nn.Module on purpose: the policy's weights must not be registered, placed or prepared a second time.
    """

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def __call__(self, **inputs):
        with self.policy.disable_adapter():
            return self.policy(**inputs)


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """{base model name: tensor}: what the model computes with its adapters, as plain weights W + scale * B @ A.
    The adapted weights are formed and kept in float32 (W may be bf16: DeepSpeed's bf16 weights): the engine rounds
    them once, to its own precision, when it loads them. Added in bf16, an update below bf16's step next to W would
    vanish from the engine's weights while the learner, which adds B @ A x on its own, keeps it.

    Reads the weights as they are: under ZeRO-3 call it inside a gather, or stream it (rlhf.generation.weights)."""
    return {name: merged_weight(t, layer).detach() for name, t, layer in merge_plan(model)}


def merge_plan(model: nn.Module) -> list[tuple[str, torch.Tensor, nn.Module | None]]:
    """(base model name, the base model's parameter or buffer, its LoRA layer or None) of every merged weight, in
    state_dict order, nothing read: a stream can gather each weight with its adapters (`layer_parameters`) alone."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {f"{name}.base_layer.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    plan = []
    for name, tensor in base.state_dict(keep_vars=True).items():
        if ".lora_" not in name:
            plan.append((name.replace(".base_layer.", "."), tensor, layers.get(name)))
    return plan


def layer_parameters(layer: nn.Module) -> list[torch.Tensor]:
    """The adapter weights a LoRA layer's merged weight reads besides its base weight."""
    return [layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight]


def merged_weight(tensor: torch.Tensor, layer: nn.Module | None) -> torch.Tensor:
    """W + scale * B @ A in float32 for a LoRA layer's base weight W; any other weight as it is."""
    return tensor if layer is None else tensor.float() + _delta(layer)


def _delta(module) -> torch.Tensor:
    """scale * B @ A of a LoRA layer, in float32 (PEFT's get_delta_weight returns it in the adapters' dtype)."""
    from peft.tuners.lora import Linear
    from peft.utils.other import transpose

    if isinstance(module, Linear) and not module.use_dora.get(ADAPTER, False):
        a, b = module.lora_A[ADAPTER].weight.float(), module.lora_B[ADAPTER].weight.float()
        return transpose(b @ a, module.fan_in_fan_out) * module.scaling[ADAPTER]
    return module.get_delta_weight(ADAPTER).float()


def trainable_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train: with LoRA the adapters (and a value model's weights), not the base."""
    return {name for name, p in model.named_parameters() if p.requires_grad}
