"""The GPU paths' logic, checked on the CPU (docs/gpu.md): what a GPU run does differently is decided by small
functions, tested here with the numbers of real GPU layouts. Where a test needs a GPU object (a CUDA device's
properties, vLLM on CUDA), a stand-in named as such takes its place; everything else is the real code."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch

from rlhf.config import LoraConfig, ModelConfig
from rlhf.generation import engine_build, engine_process
from rlhf.generation.base import EngineSpec, Placement, ReferenceSpec
from rlhf.generation.engine_build import MIN_KV_CACHE_BYTES, engine_memory_share
from rlhf.models import loading, lora, tiny
from rlhf.rewards.proxy import ProxyReward, RewardSpec
from rlhf.runtime import visible_gpus

GIB = 2**30
H100 = 80 * GIB
SMALL = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=64)
TEXTS = ["the movie was great and i loved it .", "a bad film , boring plot and awful acting !"]


# --- which GPU a child process sees ------------------------------------------------------------------------


def test_a_childs_gpu_is_mapped_through_the_parents_visible_devices():
    assert visible_gpus([4], parent="2,3,4,5,6") == "6"  # not physical GPU 4, a training GPU
    assert visible_gpus([3, 4], parent="2,3,4,5,6") == "5,6"
    assert visible_gpus([1], parent="GPU-aaaa, GPU-bbbb") == "GPU-bbbb"  # UUIDs, as schedulers set them
    with pytest.raises(ValueError, match=r"cuda:5: this process sees 5 GPU\(s\)"):
        visible_gpus([5], parent="2,3,4,5,6")


def test_a_childs_gpu_is_the_bare_index_when_the_parent_sees_every_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_gpus([4]) == "4"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3")
    assert visible_gpus([1]) == "6"  # read from this process's environment by default


def test_the_engine_process_sees_its_gpu_through_the_trainers_list_and_pins_no_core_there(monkeypatch):
    pinned, threads = [], []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: pinned.append(cores))
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,4,5,6")  # what the engine process inherits from the trainer
    assert engine_process.see_only("cuda:4") == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert pinned == [] and threads == []  # a GPU engine keeps the scheduler's choice of cores
    if len(os.sched_getaffinity(0)) > 1:
        assert engine_process.see_only("cpu") == "cpu"
        assert pinned == [{max(os.sched_getaffinity(0))}] and threads == [1]  # on the CPU: a core of its own


# --- the engine's GPU memory -------------------------------------------------------------------------------

# Pythia's parameter counts (the paper's policies; their reward models are the same size)
PYTHIA = {"410m": 405_334_016, "1b": 1_011_781_632, "2.8b": 2_775_208_960}


@pytest.mark.parametrize("size", PYTHIA)
def test_the_scorers_bytes_come_out_of_vllms_share_of_an_h100(size):
    params = PYTHIA[size]
    scorer = 2 * params * 2  # reward model + reference, loaded in bf16 (the training precision)
    weights = params * 2  # the bf16 engine's copy of the policy
    share = engine_memory_share(H100, 0.9, scorer, weights)
    assert share == pytest.approx(0.9 - scorer / H100)
    assert share * H100 + scorer == pytest.approx(0.9 * H100)  # the process stays within 90% of the card
    if size == "2.8b":  # in fp32 the scorer alone would have been 22 GB on top of vLLM's 72 GB: over the 80 GB card
        assert 0.9 * H100 + 2 * params * 4 > H100
        assert share == pytest.approx(0.771, abs=1e-3)


def test_a_share_too_small_for_the_weights_and_a_cache_is_refused_naming_the_setting():
    params = PYTHIA["2.8b"]
    with pytest.raises(ValueError, match="train.engine_gpu_memory_utilization: 0.1 of the engine's 80.0 GiB"):
        engine_memory_share(H100, 0.1, 2 * params * 2, params * 2)
    assert engine_memory_share(H100, 0.1, 0, H100 * 0.1 - MIN_KV_CACHE_BYTES) == pytest.approx(0.1)


def test_the_engine_process_loads_its_scorer_first_and_gives_vllm_what_is_left(monkeypatch):
    """Stand-ins for what needs a GPU: the CUDA device's properties and vLLM's CUDA engine; a scorer that holds 9 GiB
    (its real loading is tested below)."""
    order = []

    class ScorerHolding9GiB:
        nbytes = 9 * GIB

        def __init__(self, spec, device):
            order.append("scorer")

    class VLLMOnAGpu:
        def __init__(self, folder, eos, pad, seed, max_len, dtype, memory, device):
            order.append(("engine", memory, device))

    monkeypatch.setattr(engine_build, "Scorer", ScorerHolding9GiB)
    monkeypatch.setattr(engine_build, "VLLMEngine", VLLMOnAGpu)
    monkeypatch.setattr(engine_build, "folder_parameters", lambda folder: PYTHIA["1b"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100))
    where = Placement("cuda:1", True, 0.9)
    spec = EngineSpec("vllm_async", "unused", 0, 0, 0, 64, where=where, reward=object(), dtype="bfloat16")
    engine_build.build(spec, "cuda:0")
    assert order == ["scorer", ("engine", pytest.approx(0.9 - 9 / 80), "cuda:0")]


def test_the_scorer_holds_its_models_in_the_training_precision(tmp_path):
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, tmp_path / "policy")
    rm = loading.reward_model_from_causal(tmp_path / "policy")
    loading.save_pretrained(rm, tok, tmp_path / "rm")
    scorers = {}
    for bf16 in (False, True):
        spec = EngineSpec(
            "vllm_async", str(tmp_path / "policy"), tok.eos_token_id, tok.pad_token_id, 0, 64,
            reward=RewardSpec("proxy", str(tmp_path / "rm"), bf16=bf16), reference=ReferenceSpec(1.0, bf16),
        )  # fmt: skip
        scorers[bf16] = engine_build.Scorer(spec, torch.device("cpu"))
    assert {p.dtype for p in scorers[True].ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in scorers[True].reward_fn.model.parameters()} == {torch.bfloat16}
    assert scorers[True].nbytes * 2 == scorers[False].nbytes > 0


def test_the_reward_model_computes_under_the_runs_autocast(tmp_path):
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, tmp_path / "policy")
    loading.save_pretrained(loading.reward_model_from_causal(tmp_path / "policy"), tok, tmp_path / "rm")
    from rlhf.models.batch import assemble

    ids = tok(TEXTS, add_special_tokens=True)["input_ids"]
    batch = assemble(ids, torch.tensor([[5, 6, tok.eos_token_id], [7, 8, 9]]), 1, tok.pad_token_id, tok.eos_token_id)
    for bf16 in (False, True):
        reward = RewardSpec("proxy", str(tmp_path / "rm"), bf16=bf16).build()
        assert isinstance(reward, ProxyReward)
        seen: list[bool] = []
        reward.model.score.register_forward_hook(
            lambda m, i, o, seen=seen: seen.append(torch.is_autocast_enabled("cpu"))
        )
        scores = reward(batch, [])
        assert seen == [bf16] and scores.dtype == torch.float32 and scores.shape == (2,)


# --- LoRA's merged weights ---------------------------------------------------------------------------------


def test_lora_updates_below_bf16s_step_reach_the_merged_weights():
    """DeepSpeed's bf16 keeps the base weights and the adapters in bf16; the learner adds B @ A x on its own, so an
    update much smaller than W's bf16 step still changes its outputs. The merged weights must carry it."""
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    policy = lora.add_adapters(tiny.build_tiny_model(SMALL, tok, seed=0), LoraConfig(rank=4), seed=1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 1e-4)  # scale * B @ A ~ 1e-4: far below bf16's step (2**-8 relative) next to W ~ 0.02
    policy.to(torch.bfloat16)
    merged = lora.merged_state_dict(policy)
    base = policy.get_base_model()
    checked = 0
    for name, module in base.named_modules():
        if isinstance(module, lora_linear()):
            w = module.base_layer.weight
            a, b = module.lora_A["default"].weight.float(), module.lora_B["default"].weight.float()
            exact = w.float() + module.scaling["default"] * (b @ a)
            torch.testing.assert_close(merged[f"{name}.weight"], exact, rtol=0, atol=1e-9)
            assert (
                merged[f"{name}.weight"] != w.float()
            ).float().mean() > 0.9  # the update is there, nearly everywhere
            checked += 1
    assert checked == 7 * SMALL.num_layers  # train.lora's default: every linear layer but the output head


def lora_linear():
    from peft.tuners.lora import Linear

    return Linear


# --- vLLM's settings on a GPU ------------------------------------------------------------------------------


def test_vllm_compiles_and_captures_cuda_graphs_on_a_gpu_and_runs_eagerly_on_the_cpu(monkeypatch, tmp_path):
    """A stand-in for vLLM's LLM records what the engine asks of it (vLLM's CUDA engine cannot exist here)."""
    import vllm

    from rlhf.generation.vllm import VLLMEngine

    asked = {}

    class LLMOnAnyDevice:
        def __init__(self, **kwargs):
            asked[kwargs.get("gpu_memory_utilization", "cpu")] = kwargs

        def init_weight_transfer_engine(self, request: dict) -> None:
            pass  # the weight-transfer API's handshake: tested on the real engine (test_vllm_engines.py)

        def update_weight_version(self, version: str) -> None:
            pass  # the label vLLM gives each token it samples: tested on the real engine (test_async_engines.py)

    monkeypatch.setattr(vllm, "LLM", LLMOnAnyDevice)
    tok = tiny.train_word_tokenizer(TEXTS, vocab_size=64)
    loading.save_pretrained(tiny.build_tiny_model(SMALL, tok, seed=0), tok, tmp_path / "policy")
    VLLMEngine(tmp_path / "policy", 1, 0, 0, 64, "bfloat16", 0.9, "cuda:0")
    VLLMEngine(tmp_path / "policy", 1, 0, 0, 64, "float32", None, "cpu")
    assert asked[0.9]["enforce_eager"] is False and "kv_cache_memory_bytes" not in asked[0.9]
    assert asked["cpu"]["enforce_eager"] is True and asked["cpu"]["kv_cache_memory_bytes"] > 0


def test_an_engine_on_a_gpu_the_learner_uses_is_built_after_the_learners_models(monkeypatch):
    """vLLM sizes its KV cache from the memory free when it starts: on a GPU it shares with training, it starts once
    the learner's models are placed. A stand-in GPU count (2 GPUs) for torch.cuda.device_count."""
    from rlhf.generation.factory import placement
    from rlhf.trainers import setup

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    gpu0 = torch.device("cuda", 0)
    assert placement("vllm_async", "auto", None, 1, gpu0).device == "cuda:1"  # the paper's layout: its own GPU
    assert not placement("vllm_async", "auto", None, 1, gpu0).shares_gpu
    assert placement("vllm_async", "cuda:0", None, 1, gpu0).shares_gpu
    assert placement("vllm_async", "auto", None, 2, gpu0).shares_gpu  # 2 training GPUs: none left for the engine
    assert placement("vllm_async", "auto", None, 2, gpu0, "ray").shares_gpu
    assert not placement("vllm_async", "cpu", None, 1, gpu0).shares_gpu

    made = []
    monkeypatch.setattr(setup, "make_engine", lambda spec, process: made.append(spec.where) or "engine")
    for device in ("cuda:0", "cuda:1"):
        where = placement("vllm_async", device, None, 1, gpu0)
        early = setup._start_engine_early(EngineSpec("vllm_async", "sft", 1, 0, 0, 64, where=where), None)
        assert (early, made[-1:]) == ((None, []) if where.shares_gpu else ("engine", [where]))


# --- what this machine cannot run --------------------------------------------------------------------------


def test_settings_this_machine_cannot_run_are_refused_before_any_process_starts():
    from rlhf.config import TrainConfig
    from rlhf.generation.factory import check_runnable_here

    def refused(gpus: int, cpus: int = 2, address: str | None = None, world: int = 1, **settings) -> str:
        with pytest.raises(ValueError) as raised:
            check_runnable_here(TrainConfig(trainer="online_dpo_vllm", **settings), gpus, cpus, address, world)
        assert "\n" not in str(raised.value)
        return str(raised.value)

    assert "has no CUDA device; use auto or cpu" in refused(0, engine_device="cuda")
    assert "has 2 CUDA device(s), cuda:0 to cuda:1" in refused(2, engine_device="cuda:2")
    check_runnable_here(TrainConfig(trainer="online_dpo_vllm", engine_device="cuda:1"), 2, 2, None)
    ray = dict(engine_backend="ray", num_engines=8)
    assert "8 Ray engines, each asking for a CPU, on a local cluster that has 2" in refused(0, **ray)
    assert "each asking for a GPU, on a local cluster that has 3" in refused(8, world=5, **ray)
    check_runnable_here(TrainConfig(trainer="online_dpo_vllm", **ray), 0, 2, "10.0.0.1:6379")  # a cluster's own count
    check_runnable_here(TrainConfig(trainer="online_dpo_vllm", **ray), 9, 2, None)  # 8 spare GPUs
    # engines asking for a custom resource: only a joined cluster's nodes can have it (tests/test_two_node_ray.py)
    marked = dict(engine_backend="ray", engine_resource="engine")
    assert "train.engine_resource: engine marks engine nodes of a Ray cluster to join, and RAY_ADDRESS is not set" in (
        refused(0, **marked)
    )
    check_runnable_here(TrainConfig(trainer="online_dpo_vllm", **marked), 0, 2, "10.0.0.1:6379")


def test_the_cli_refuses_a_cuda_engine_device_without_cuda_in_one_line(tmp_path):
    from conftest import run_cli

    settings = ["--trainer", "online_dpo_vllm", f"data_dir={tmp_path}", "train.engine_device=cuda"]
    out = run_cli("--profile", "ci", "train", *settings, timeout=120)
    expected = "train.engine_device: cuda, but this machine has no CUDA device; use auto or cpu"
    assert out.returncode == 1 and out.stderr.strip() == f"rlhf train: error: {expected}", out.stderr
    assert not (tmp_path / "train").exists()


# --- the async weight sync's page-locked buffers ----------------------------------------------------------------


class CudaRuntimeStandIn:
    """Stands in for torch.cuda.cudart() (no GPU here): records cudaHostRegister / cudaHostUnregister calls and
    answers cudaErrorMemoryAllocation (2) to every registration when told to refuse."""

    def __init__(self, refuse: bool = False):
        self.registered, self.unregistered, self.refuse = [], [], refuse

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size))
        return 2 if self.refuse else 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def _two_dtype_model():
    tok = tiny.train_word_tokenizer(TEXTS, 64)
    model = tiny.build_tiny_model(SMALL, tok, seed=0)
    model.lm_head.to(torch.bfloat16)  # a second dtype: a second shared buffer
    return model


def _same_weights(copy, model) -> bool:
    return all(torch.equal(t, model.state_dict()[name]) for name, t in copy.tensors())


def test_a_gpu_models_shared_weights_are_page_locked_once_each_and_unlocked_when_freed(monkeypatch):
    import gc

    from rlhf.generation import weights

    cudart = CudaRuntimeStandIn()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(weights, "on_gpu", lambda model: True)  # stands in for a model on a GPU
    model = _two_dtype_model()
    copy = weights.shared_snapshot(model)
    buffers = {(b.data_ptr(), b.numel() * b.element_size()) for b in copy.buffers.values()}
    assert len(buffers) == 2 and set(cudart.registered) == buffers and len(cudart.registered) == 2
    assert weights.shared_snapshot(model, copy) is copy and len(cudart.registered) == 2  # a reused spare: not again
    assert _same_weights(copy, model)
    del copy
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(ptr for ptr, _ in buffers)


def test_a_cpu_models_shared_weights_are_never_page_locked(monkeypatch):
    from rlhf.generation import weights

    def no_cuda():
        raise AssertionError("a CPU model's sync asked for the CUDA runtime")

    monkeypatch.setattr(torch.cuda, "cudart", no_cuda)
    model = _two_dtype_model()
    assert _same_weights(weights.shared_snapshot(model), model)


def test_memory_cuda_refuses_to_lock_stays_pageable_with_one_line_and_the_copy_is_right(monkeypatch, capsys):
    import gc

    from rlhf.generation import weights

    cudart = CudaRuntimeStandIn(refuse=True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(weights, "on_gpu", lambda model: True)  # stands in for a model on a GPU
    model = _two_dtype_model()
    copy = weights.shared_snapshot(model)
    weights.shared_snapshot(model, copy)
    assert len(cudart.registered) == 2  # each buffer asked once, not again at every sync
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("could not page-lock" in line and "pageable" in line for line in lines)
    assert _same_weights(copy, model)
    del copy
    gc.collect()
    assert cudart.unregistered == []  # nothing was registered


# --- what a GPU step costs: the phase timers and the optimizer --------------------------------------------------


def test_the_loops_clock_times_phases_on_the_gpus_timeline_and_waits_once(monkeypatch):
    """Kernels run asynchronously: a phase's time is only its own if it is the device's. Each mark records a CUDA
    event (no wait: waiting at every mark drained the device's queue five times an iteration); reading the phases
    waits once, for the last event. StandInEvent takes the place of torch.cuda.Event (no GPU here): its timestamps
    are the device's, 0.5 s a phase, whatever the host's clock says."""
    from rlhf.trainers.loop import Clock

    waited, recorded = [], []

    class StandInEvent:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            self.at = 0.5 * len(recorded)  # the device reaches each event 0.5 s after the one before
            recorded.append(self)

        def synchronize(self):
            waited.append(self)

        def elapsed_time(self, end):  # milliseconds, as CUDA's
            return (end.at - self.at) * 1000

    monkeypatch.setattr(torch.cuda, "Event", StandInEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: waited.append(d))
    clock = Clock(torch.device("cuda", 1))
    clock.mark("scoring")
    clock.mark("update")
    assert waited == [] and len(recorded) == 3  # the start and one event per mark, no wait
    assert clock.seconds == {"scoring": 0.5, "update": 0.5} and clock.total() == 1.0
    assert all(w is recorded[-1] for w in waited) and waited  # reading waited for the last event only

    def no_gpu(*args, **kwargs):
        raise AssertionError("a CPU run must not touch CUDA")

    monkeypatch.setattr(torch.cuda, "synchronize", no_gpu)
    monkeypatch.setattr(torch.cuda, "Event", no_gpu)
    for device in (torch.device("cpu"), torch.device("meta"), None):
        clock = Clock(device)
        clock.mark("x")
        assert set(clock.seconds) == {"x"} and clock.total() >= clock.seconds["x"] >= 0


def test_adamw_is_fused_on_a_gpu_and_the_default_on_the_cpu():
    """The fused kernel spares the 4 bytes per parameter the default path allocates at every step (docs/gpu.md); on
    the CPU the default path is kept, bit for bit. torch.device("cuda") is only a name here: no GPU is touched."""
    from rlhf.runtime import adamw

    torch.manual_seed(0)
    weights = [torch.randn(8, 4) for _ in range(3)]
    grads = [torch.randn_like(w) for w in weights]

    def three_steps(make_optimizer) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        params = [w.clone().requires_grad_() for w in weights]
        opt = make_optimizer(params)
        for _ in range(3):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
        return params, opt

    runs = {}
    for name, device in (("cpu", "cpu"), ("cuda", torch.device("cuda", 0))):
        runs[name], opt = three_steps(functools.partial(adamw, device=device, lr=0.1, weight_decay=0.0))
        assert bool(opt.defaults["fused"]) == (name == "cuda")
    reference, _ = three_steps(functools.partial(torch.optim.AdamW, lr=0.1, weight_decay=0.0))
    assert all(torch.equal(a, b) for a, b in zip(runs["cpu"], reference))  # the CPU's results are unchanged
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(runs["cuda"], reference))  # the same update


def test_the_trainers_optimizer_is_fused_on_the_training_device():
    from rlhf.config.loader import load_config
    from rlhf.trainers.setup import Sizes, _setup_optimization

    cfg = load_config(profile="ci")
    model = torch.nn.Linear(4, 4)
    for device, fused in ((torch.device("cuda", 0), True), (torch.device("cpu"), False)):
        optimizer, _ = _setup_optimization(cfg.train, model, Sizes.derive(cfg.train, 1), device)
        assert bool(optimizer.defaults["fused"]) == fused


def test_every_adamw_goes_through_the_one_that_knows_the_device():
    """A stage or bench that builds torch's AdamW itself would miss the GPU's fused kernel."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sources = [*root.glob("rlhf/**/*.py"), *root.glob("bench/*.py"), *root.glob("flows/*.py"), *root.glob("tasks/*.py")]
    direct = [str(p.relative_to(root)) for p in sources if "optim.AdamW(" in p.read_text()]
    assert direct == ["rlhf/runtime.py"]
