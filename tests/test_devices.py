"""GPU-correct by construction, checked on a CPU: with the training device elsewhere (`meta`, tests/device_guard.py)
every tensor entering a model, a loss or a reward must already be on it. A CPU run can't tell; these can: a
tensor left on the CPU next to a model on the device stops the run, naming the op and the line."""

import os

import pandas as pd
import pytest
import torch
from conftest import COMMAND_TIMEOUT, ci_config
from device_guard import DeviceMismatch, training_device_elsewhere

from rlhf.presets import PRESETS
from rlhf.trainers.loop import train

pytestmark = pytest.mark.slow

# Every HF preset, RLOO with truncated importance weights and GRPO with AReaL's decoupled objective (the HF engine
# returns its sampling log-probs, as the vLLM ones do, so DPO and best-of-k take the engines' log-probs path here too,
# and the behaviour weights are computed from them).
# With LoRA: the reference is the policy with adapters off, and the engines get merged weights.
HF = [(name,) for name, p in sorted(PRESETS.items()) if p.engine == "hf"] + [
    ("rloo", "train.tis_cap=2.0"),
    ("grpo", "train.decoupled_cap=5.0"),
    ("ppo", "train.lora.rank=4"),
]


def test_the_guard_catches_a_tensor_left_on_the_cpu():
    model = torch.nn.Linear(4, 2)
    with training_device_elsewhere() as audit:
        device = audit.device
        model.to(device)
        with pytest.raises(DeviceMismatch, match="linear mixes tensors on \\['cpu', 'meta'\\]"):
            model(torch.ones(3, 4))
        emb = torch.nn.Embedding(8, 4).to(device)
        with pytest.raises(DeviceMismatch, match="embedding"):  # meta alone returns garbage here, silently
            emb(torch.tensor([1, 2]))
        assert model(torch.ones(3, 4, device=device)).device == device and audit.on_device > 0


@pytest.mark.parametrize("settings", HF, ids="+".join)
def test_the_loop_keeps_every_tensor_on_the_training_device(ci_data, settings):
    trainer, *extra = settings
    with training_device_elsewhere() as audit:
        final = train(
            ci_config(ci_data, f"train.trainer={trainer}", "train.total_episodes=16", "train.save_every=1", *extra)
        )
    assert_ran_on_the_device(final, audit)


def assert_ran_on_the_device(final: dict, audit) -> None:
    """The run went to its end, and its models and batches were on the training device: 5,000-11,000 ops there
    (ci, 16 episodes); with the device setting ignored, 552 (transformers builds models on `meta` before loading).
    No copy from the host in the project's code waited for the device (on CUDA a blocking upload synchronises the
    stream): seen failing before the uploads were made non-blocking, at the batch's move (rlhf/models/batch.py),
    each epoch's prompt order (rlhf/trainers/loop.py) and the HF engine's prompts (rlhf/generation/hf.py)."""
    assert final["episodes"] == 16 and final["optimizer_steps"] > 0, final
    assert audit.on_device > 2500, audit.on_device
    ours = {site: n for site, n in audit.blocking_copies.items() if site.startswith("rlhf/")}
    assert not ours, ours


VLLM = [
    ("online_dpo_single_vllm",),
    ("rloo", "train.engine=vllm_async", "train.tis_cap=2.0"),
    ("online_dpo_single_vllm", "train.lora.rank=4"),
    ("online_dpo_vllm", "train.lora.rank=4"),
]


@pytest.mark.parametrize("settings", VLLM, ids="+".join)
def test_the_loop_with_a_vllm_engine_keeps_every_tensor_on_the_training_device(ci_data, settings):
    """The weight sync paths: colocated, vLLM in this process reads the weights moved to its device; async, they
    are copied into host memory for the engine process (checkpoints included)."""
    trainer, *extra = settings
    with training_device_elsewhere() as audit:
        final = train(
            ci_config(ci_data, f"train.trainer={trainer}", "train.total_episodes=16", "train.save_every=1", *extra)
        )
    assert_ran_on_the_device(final, audit)


def test_the_stages_put_their_models_and_batches_on_the_device(ci_data):
    """reward samples pairs and trains the RM on the device; generate and evaluate sample, score and compute KL
    there. (The reward stage as a whole needs real samples to find gold preferences, so its
    parts run here on the session's pairs.)"""
    from rlhf.data.schemas import PreferencePairs
    from rlhf.data.splits import load_split
    from rlhf.models.loading import encode_prompts, load_causal_lm, load_tokenizer, reward_model_from_causal
    from rlhf.stages import evaluate, generate, reward

    cfg = ci_config(ci_data)
    tokenizer = load_tokenizer(ci_data / "sft")
    pairs = load_split(ci_data / "reward" / "pairs", "train", PreferencePairs)
    for side in ("chosen", "rejected"):
        pairs[f"{side}_ids"] = tokenizer(list(pairs[side]), add_special_tokens=False)["input_ids"]
    pairs["prompt_ids"] = encode_prompts(tokenizer, list(pairs["prompt"]), cfg.data.chat_template)
    pairs = pairs[[len(c) > 0 and len(r) > 0 for c, r in zip(pairs["chosen_ids"], pairs["rejected_ids"])]]
    with training_device_elsewhere() as audit:
        device = audit.device
        prompts = list(load_split(ci_data / "prepared", "reward_prompts")["prompt"])[:8]
        sampled = reward.sample_pairs(cfg, load_causal_lm(ci_data / "sft").to(device), tokenizer, prompts, device)
        assert len(sampled) == len(prompts)
        rm = reward_model_from_causal(ci_data / "sft").to(device)
        reward.train_reward_model(cfg, rm, tokenizer, pd.DataFrame(pairs).reset_index(drop=True), device)
        reward.agreement(rm, tokenizer, pairs, 16, device)
        train(ci_config(ci_data, "train.total_episodes=8", "train.per_device_train_batch_size=2"))
        generate.run(cfg)
        metrics = evaluate.run(cfg)
    assert metrics["n_prompts"] == len(load_split(ci_data / "prepared", "eval_prompts")) and audit.on_device > 1000


def test_the_sft_stage_trains_on_the_device(ci_data, tmp_path):
    from rlhf.stages import sft

    data = tmp_path / "sft_run"
    data.mkdir()
    (data / "prepared").symlink_to(ci_data / "prepared")
    with training_device_elsewhere() as audit:
        metrics = sft.run(ci_config(data))
    assert "heldout_loss" in metrics and audit.on_device > 1000, (metrics, audit.on_device)  # meta holds no values


def test_the_async_engine_scores_and_computes_the_reference_on_its_device(ci_data):
    """The engine process's post-processing (rlhf.generation.engine_build.Scorer) run here on the guard device:
    the sampled responses arrive in host memory, the reward model and the reference run on the engine's device,
    and the results leave as numpy arrays, copied to the host first."""
    from dataclasses import replace

    from rlhf.generation.base import EngineSpec, ReferenceSpec, SamplingParams
    from rlhf.generation.engine_build import Scorer
    from rlhf.models.loading import load_tokenizer
    from rlhf.rewards.proxy import RewardSpec

    tokenizer = load_tokenizer(ci_data / "sft")
    reward = RewardSpec("proxy", str(ci_data / "reward" / "model"))
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    reference = ReferenceSpec(temperature=0.7)
    spec = EngineSpec("vllm_async", str(ci_data / "sft"), **ids, seed=0, max_model_len=64)
    spec = replace(spec, reward=reward, reference=reference)
    prompts = [tokenizer("the film was")["input_ids"], tokenizer("a")["input_ids"]]
    responses = torch.randint(4, 40, (4, 6))  # 2 prompts x k=2, in host memory as vLLM returns them
    with training_device_elsewhere() as audit:
        device = audit.device
        scores, refs = Scorer(spec, device)(prompts, responses, SamplingParams(2, 6, 0.7), parts=[1, 1])
    assert scores.shape == (4,) and refs.shape == (4, 6)


def test_a_local_ray_cluster_hands_engines_only_the_gpus_after_the_training_ranks(tmp_path):
    """Ray engines on GPUs (reasoned, no GPU here): the local cluster gets the spare GPUs of this node as Ray GPU
    resources, under the user's own CUDA_VISIBLE_DEVICES numbering, and this process keeps its view. Ray only
    counts GPUs, so a CPU box shows what an engine actor would be given."""
    import subprocess
    import sys

    script = tmp_path / "ray_gpus.py"
    script.write_text(
        "import os\n"
        "import ray\n"
        "from rlhf.generation.ray_engines import start_cluster\n"
        "start_cluster(gpus=(1, 2))  # 1 training rank on the first visible GPU: the engines get the next two\n"
        "seen = ray.remote(num_gpus=1, num_cpus=0)(lambda: os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "print(sorted(ray.get([seen.remote(), seen.remote()])), os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5,6"}
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['5', '6'] 4,5,6"  # physical GPUs 5 and 6; rank 0 keeps 4
