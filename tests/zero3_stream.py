"""Run by tests/test_weight_transfer.py in a process of its own (it starts torch.distributed): a tiny Llama partitioned
by ZeRO-3 on one gloo rank is copied by shared_snapshot; prints the largest parameter list GatheredParameters was
given at once and whether the copy equals the unpartitioned model's weights."""

import os

import deepspeed
import torch

from rlhf.config import ModelConfig
from rlhf.generation import weights
from rlhf.models import tiny

if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("ZERO3_PORT", "29533"), LOCAL_RANK="0")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    tok = tiny.train_word_tokenizer(["a b c d e f g"], vocab_size=32)
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=32)
    reference, model = tiny.build_tiny_model(cfg, tok, seed=0), tiny.build_tiny_model(cfg, tok, seed=0)
    deepspeed.zero.Init(module=model, config_dict_or_path={"zero_optimization": {"stage": 3}, "train_batch_size": 1})
    assert all(p.numel() == 0 for p in model.parameters())  # partitioned: nothing local outside a gather
    sizes, gathered = [], deepspeed.zero.GatheredParameters

    class Recorded(gathered):
        def __init__(self, params, *args, **kwargs):
            sizes.append(1 if isinstance(params, torch.nn.Parameter) else len(list(params)))
            super().__init__(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = Recorded
    copy = weights.shared_snapshot(model)
    same = [n for n, t in copy.tensors()] == list(reference.state_dict()) and all(
        torch.equal(t, reference.state_dict()[n]) for n, t in copy.tensors()
    )
    print(f"largest gather {max(sizes)} of {len(list(model.parameters()))} parameters; equal {same}")
    torch.distributed.destroy_process_group()
