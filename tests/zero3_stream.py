"""Run by tests/test_weight_transfer.py in a process of its own (it starts torch.distributed): a tiny Llama, plain and
with LoRA adapters, partitioned by ZeRO-3 on one gloo rank is copied by shared_snapshot; prints, for each, the largest
parameter list GatheredParameters was given at once and whether the copy equals the unpartitioned model's (merged)
weights."""

import os

import deepspeed
import torch

from rlhf import runtime
from rlhf.config import LoraConfig, ModelConfig
from rlhf.generation import weights
from rlhf.models import lora, tiny


def snapshot_of(model, reference, sizes: list) -> str:
    """Partition `model` by ZeRO-3, copy it with shared_snapshot; compare with `reference`'s full (merged) weights."""
    expected = lora.merged_state_dict(reference) if lora.is_lora(reference) else reference.state_dict()
    deepspeed.zero.Init(module=model, config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1})
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned: nothing local outside a gather
    sizes.clear()
    copy = weights.shared_snapshot(model)
    same = [n for n, t in copy.tensors()] == list(expected) and all(
        torch.equal(t, expected[n]) for n, t in copy.tensors()
    )
    return f"largest gather {max(sizes)} of {len(list(model.parameters()))} parameters; equal {same}"


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("ZERO3_PORT", "29533"), LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    runtime.configure_torch()  # DeepSpeed's CPU accelerator and one thread, as every stage
    runtime.skip_deepspeed_shm_op()  # as a launched DeepSpeed run: no C++ build of an op that ZeRO never uses
    tok = tiny.train_word_tokenizer(["a b c d e f g"], vocab_size=32)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=32)
    sizes, gathered = [], deepspeed.zero.GatheredParameters

    class Recorded(gathered):
        def __init__(self, params, *args, **kwargs):
            sizes.append(1 if isinstance(params, torch.nn.Parameter) else len(list(params)))
            super().__init__(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = Recorded
    print(
        "plain:", snapshot_of(tiny.build_tiny_model(cfg, tok, seed=0), tiny.build_tiny_model(cfg, tok, seed=0), sizes)
    )
    adapted = [lora.add_adapters(tiny.build_tiny_model(cfg, tok, seed=0), LoraConfig(rank=2), seed=1) for _ in "ab"]
    for model in adapted:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p))  # B = 0 would merge to the base weights
    print("lora:", snapshot_of(adapted[0], adapted[1], sizes))
    torch.distributed.destroy_process_group()
