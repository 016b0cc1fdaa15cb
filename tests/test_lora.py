"""train.lora (PEFT): merged weights, the adapters-off reference, what the optimizer holds, the exported policy.

Exact resume with LoRA is in test_resume.py; the colocated vLLM engine sampling a LoRA policy from its merged
weights in test_vllm_engines.py.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import ROOT, ci_config, rlhf_command
from peft import PeftModel
from safetensors import safe_open

from rlhf.config import LoraConfig, ModelConfig
from rlhf.generation.base import SamplingParams
from rlhf.generation.factory import local_spec, make_engine
from rlhf.models import loading, lora, tiny
from rlhf.trainers.loop import train
from rlhf.trainers.setup import setup

SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=64)
TEXTS = ["the movie was great and i loved it .", "a bad film , boring plot and awful acting !"]


def _randomise_adapters(model: torch.nn.Module) -> None:
    """Fresh adapters compute exactly the base model (B = 0): give B values so the checks below can fail."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)


def test_merged_weights_compute_the_adapted_policy_and_the_reference_is_the_base():
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    base = tiny.build_tiny_model(SMALL, tok, seed=0)
    ids = torch.tensor(tok(TEXTS[:1])["input_ids"])
    base_logits = base(input_ids=ids).logits.detach()
    policy = lora.add_adapters(tiny.build_tiny_model(SMALL, tok, seed=0), LoraConfig(rank=4), seed=1)
    torch.testing.assert_close(policy(input_ids=ids).logits, base_logits, rtol=0, atol=0)  # B = 0 at the start
    again = lora.add_adapters(tiny.build_tiny_model(SMALL, tok, seed=0), LoraConfig(rank=4), seed=1)
    assert all(torch.equal(a, b) for a, b in zip(policy.parameters(), again.parameters()))  # seeded adapters
    _randomise_adapters(policy)
    adapted = policy(input_ids=ids).logits.detach()
    assert (adapted - base_logits).abs().max() > 1e-2

    before = {k: v.clone() for k, v in policy.state_dict().items()}
    merged = lora.merged_state_dict(policy)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())  # nothing merged in place
    plain = tiny.build_tiny_model(SMALL, tok, seed=5)
    plain.load_state_dict(merged, strict=True)  # the base model's own names, every one of them
    torch.testing.assert_close(plain(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)
    reference = lora.AdaptersOff(policy)
    torch.testing.assert_close(reference(input_ids=ids).logits, base_logits, rtol=0, atol=0)
    assert lora.trainable_names(policy) == {n for n in before if ".lora_" in n}


@pytest.mark.slow
def test_a_lora_ppo_run_steps_adapters_and_value_only_and_exports_a_merged_policy(ci_data):
    cfg = ci_config(ci_data, "train.trainer=ppo", "train.lora.rank=4", "train.learning_rate=1e-2")
    run = setup(cfg)
    try:
        stepped = {id(p) for group in run.optimizer.param_groups for p in group["params"]}
        model = run.acc.unwrap_model(run.model)
        expected = {id(p) for n, p in model.named_parameters() if ".lora_" in n or n.startswith("value_model.")}
        assert stepped == expected  # no base weight of the policy reaches the optimizer
        assert isinstance(run.ref, lora.AdaptersOff) and run.ref.policy is run.policy  # no second copy
    finally:
        run.engine.close()
    train(cfg)

    policy = ci_data / "train" / "policy"
    with safe_open(policy / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any(".lora_" in n or ".base_layer." in n for n in names)
    exported = loading.load_causal_lm(policy)
    adapted = PeftModel.from_pretrained(loading.load_causal_lm(ci_data / "sft"), policy / "adapter")
    sft = loading.load_causal_lm(ci_data / "sft")
    ids = torch.tensor([[1, 17, 23, 42, 7]])
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=0, atol=1e-5)
        assert (exported(input_ids=ids).logits - sft(input_ids=ids).logits).abs().max() > 1e-3  # it trained

    tok = loading.load_tokenizer(policy)  # vLLM loads the exported folder as it is
    engine = make_engine(local_spec("vllm", policy, tok, torch.device("cpu"), seed=0, max_model_len=32))
    try:
        gen = engine.generate([ids[0].tolist()], SamplingParams(1, 6, 0.0), batch=0)
    finally:
        engine.close()
    hf = exported.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    produced = hf[0, ids.shape[1] :].tolist()
    assert gen.responses[0, : len(produced)].tolist() == produced


def _stage(stage: str, *settings: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        rlhf_command("--profile", "ci", stage, *settings), cwd=ROOT, capture_output=True, text=True, timeout=900
    )


@pytest.mark.slow
def test_smollm2_with_lora_trains_through_the_async_vllm_engine_at_micro_size(tmp_path):
    """The smollm2 code path (the packaged pretrained model, LoRA, vLLM in its own process) on `ci` sizes."""
    data: Path = tmp_path / "data"
    smol = [f"data_dir={data}", "model.source=smollm2", "sft.train=false", "sft.heldout_texts=8"]
    for stage in ("prepare", "gold", "sft"):
        assert (proc := _stage(stage, *smol)).returncode == 0, proc.stderr[-3000:]
    run = ["train.trainer=online_dpo_vllm", "train.reward=gold", "train.lora.rank=4", "train.total_episodes=24"]
    proc = _stage("train", *smol, *run, "tracking.wandb_mode=disabled")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((data / "metrics" / "train.json").read_text())
    assert metrics["episodes"] == 24 and all(math.isfinite(v) for v in metrics.values())
    assert metrics["final/async/weight_version"] == 1  # batch 2 of 3, sampled from synced (merged) weights
    config = json.loads((data / "train" / "policy" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    exported = loading.load_causal_lm(data / "train" / "policy")
    assert 134e6 < tiny.count_parameters(exported) < 135e6  # the whole merged model, not the adapter alone
