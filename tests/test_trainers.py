"""The online loop with every preset on the `ci` profile: real data, real tiny models, real accelerate/DeepSpeed."""

import csv
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import COMMAND_TIMEOUT, ROOT, accelerate_launch, ci_config, rlhf_command
from transformers import AutoModelForCausalLM

from rlhf.config import load_config
from rlhf.presets import PRESETS
from rlhf.trainers.loop import train
from rlhf.trainers.setup import Sizes, batch_prompts

HF_TRAINERS = [name for name, p in PRESETS.items() if p.engine == "hf"]


def documented_metrics(trainer: str, engine: str = "hf") -> set[str]:
    """Rows of docs/metrics.md that apply to `trainer` with a synchronous engine and a gold judge present."""
    algorithm = PRESETS[trainer].algorithm
    names = set()
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \|", line)
        if not m:
            continue
        who = m.group(2).strip()
        if who.startswith("all") or (engine != "hf" and who == "async engines"):
            names.add(m.group(1))
        elif any(w.strip().rstrip("*") in (trainer, algorithm) for w in who.split(",")):
            names.add(m.group(1))
    return names


def read_rows(data_dir):
    """The run's rows as logged: results and wall-clock columns (rlhf.tracking.logged_rows)."""
    from rlhf.tracking import logged_rows

    return logged_rows(data_dir)


@pytest.mark.parametrize("trainer", HF_TRAINERS)
def test_each_preset_trains_and_logs_its_documented_metrics(ci_data, trainer):
    cfg = ci_config(ci_data, f"train.trainer={trainer}")
    final = train(cfg)
    rows = read_rows(ci_data)
    assert len(rows) == Sizes.derive(cfg.train, 1).num_batches == 2
    assert set(rows[0]) == documented_metrics(trainer)
    assert all(math.isfinite(float(v)) for row in rows for v in row.values())
    assert float(rows[-1]["async/staleness"]) == 0  # synchronous: every batch sampled with current weights
    assert final["optimizer_steps"] == 2 * cfg.train.num_mini_batches
    reloaded = AutoModelForCausalLM.from_pretrained(ci_data / "train" / "policy")
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_training_changes_the_policy_and_logs_real_kl(ci_data):
    cfg = ci_config(ci_data, "train.trainer=rloo", "train.learning_rate=1e-2", "train.total_episodes=32")
    train(cfg)
    before = AutoModelForCausalLM.from_pretrained(ci_data / "sft").state_dict()
    after = AutoModelForCausalLM.from_pretrained(ci_data / "train" / "policy").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert float(read_rows(ci_data)[-1]["objective/kl"]) != 0.0


def test_gold_as_the_reward_optimises_the_judge_itself(ci_data):
    """train.reward=gold: the scores the loop optimises are the judge's (without the EOS penalty, equal to the
    logged gold metric). The async engine builds the same reward from its spec (tests/test_gold.py)."""
    cfg = ci_config(ci_data, "train.reward=gold", "train.non_eos_penalty=false", "train.total_episodes=16")
    train(cfg)
    rows = read_rows(ci_data)
    assert len(rows) == 2
    assert all(float(r["objective/scores"]) == pytest.approx(float(r["objective/gold"]), abs=1e-6) for r in rows)


def test_an_async_run_that_waited_for_its_engine_says_which_setting_fills_the_wait():
    """rlhf.trainers.summary.start_up_hint: one line at the end of a run whose first batch waited for the engine's
    start, none when nothing waited that long or the learner already sampled its own first batches."""
    from rlhf.config import TrainConfig
    from rlhf.trainers.summary import start_up_hint

    later = {"timing/step": 0.25, "timing/wait": 0.04, "timing/generation": 0.16, "timing/scoring_engine": 0.07}
    waited = [{"timing/step": 4.4, "timing/wait": 4.1}, later, later]  # tiny's figures on 2 cores
    hint = start_up_hint(TrainConfig(), waited)
    assert "waited 4.1 s" in hint and "train.learner_first_batches=9 " in hint  # 4.1 / (0.21 + 0.16 + 0.07)
    assert "learner_first_batches=W " in start_up_hint(TrainConfig(), waited[:1])  # no later batch to estimate from
    assert start_up_hint(TrainConfig(learner_first_batches=10), waited) is None
    assert start_up_hint(TrainConfig(), [{"timing/wait": 0.5}]) is None  # the engine was nearly ready
    assert start_up_hint(TrainConfig(), [{"objective/scores": 1.0}]) is None  # synchronous: no wait logged
    assert start_up_hint(TrainConfig(), []) is None


@pytest.mark.parametrize("trainer", ["online_dpo", "rloo"])
def test_a_run_whose_every_update_was_empty_says_so_and_names_the_likely_setting(ci_data, trainer):
    """At a temperature of ~0 a prompt's k samples are one text: no valid pair (online DPO), all-zero advantages
    (RLOO). The run still ends (its outputs are valid: the SFT policy again), with one line saying nothing was learned
    and naming the setting; a run that learned says nothing of the kind."""
    from conftest import run_cli

    tied = run_cli(
        "--profile",
        "ci",
        "train",
        f"data_dir={ci_data}",
        f"train.trainer={trainer}",
        "train.temperature=1e-9",
        "train.total_episodes=16",
        "tracking.wandb_mode=disabled",
    )
    assert tied.returncode == 0, tied.stderr[-2000:]
    lines = [line for line in tied.stderr.splitlines() if "nothing was learned" in line]
    assert len(lines) == 1 and "train.temperature=1e-09" in lines[0], tied.stderr[-2000:]
    learned = run_cli(
        "--profile",
        "ci",
        "train",
        f"data_dir={ci_data}",
        f"train.trainer={trainer}",
        "train.total_episodes=16",
        "tracking.wandb_mode=disabled",
    )
    assert learned.returncode == 0 and "nothing was learned" not in learned.stderr


def test_the_tracked_rows_file_holds_results_only_and_the_timing_file_the_wall_clock(tmp_path):
    """Tracker.finish: plots/train.csv (in git) without timing/* and eps, so an identical rerun leaves it and
    dvc.lock unchanged; timing/train.csv (a DVC output) with them and the axes; logged_rows joins them back. A
    timing file of another run (other row count) is an error naming it."""
    from rlhf.stages.report import write_report
    from rlhf.tracking import Tracker, logged_rows

    cfg = ci_config(tmp_path, "tracking.wandb_mode=disabled")
    logged = [
        {"train/episode": 8 * (i + 1), "train/global_step": i + 1, "objective/scores": 0.5 + i, "eps": 40.0 + i}
        | {"timing/step": 0.2 + i}
        for i in range(3)
    ]
    tracker = Tracker(cfg, "train")
    for row in logged:
        tracker.log(row)
    tracker.finish({"final/objective/scores": 2.5})
    with open(tmp_path / "plots" / "train.csv") as f:
        assert next(csv.reader(f)) == ["objective/scores", "train/episode", "train/global_step"]
    with open(tmp_path / "timing" / "train.csv") as f:
        assert next(csv.reader(f)) == ["eps", "timing/step", "train/episode", "train/global_step"]
    assert [{k: float(v) for k, v in r.items()} for r in logged_rows(tmp_path)] == logged
    timing = tmp_path / "timing" / "train.csv"
    timing.write_text("".join(timing.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(ValueError, match=rf"{timing}: 2 rows for the 3 of .*train.csv"):
        logged_rows(tmp_path)
    with pytest.raises(ValueError, match=rf"{timing}: 2 rows for the 3 of .*train.csv"):
        write_report(cfg)  # the report's charts join them the same way


def test_prompt_batches_are_disjoint_within_an_epoch_and_pure_functions_of_the_step():
    prompts = [[i] for i in range(12)]
    sizes = Sizes(world=2, local_batch=3, batch=6, num_batches=4, num_updates=4)
    epoch0 = [p[0] for t in range(2) for rank in range(2) for p in batch_prompts(prompts, t, sizes, rank, 0)]
    assert sorted(epoch0) == list(range(12))
    assert batch_prompts(prompts, 3, sizes, 1, 0) == batch_prompts(prompts, 3, sizes, 1, 0)


LAUNCHERS = {  # two training processes each: DeepSpeed ZeRO-2 and ZeRO-3 through accelerate, and plain DDP
    "zero2": lambda: accelerate_launch("zero2"),  # a free port each time it is called
    "zero3": lambda: accelerate_launch("zero3"),
    "ddp": lambda: ["torchrun", "--standalone", "--nproc_per_node", "2"],
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_processes_train_step_the_schedule_once_per_update_and_save_a_reloadable_policy(
    ci_data, tmp_path, launcher
):
    settings = [f"data_dir={ci_data}", "tracking.wandb_mode=disabled", "train.total_episodes=32"]
    cmd = rlhf_command("--profile", "ci", "train", "--trainer", "ppo", *settings, launcher=LAUNCHERS[launcher]())
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}
    if launcher == "ddp":
        env["ACCELERATE_USE_CPU"] = "1"  # torchrun: accelerate's CPU DDP
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # DeepSpeed compiled nothing: its CPU all-reduce op serves inference only (rlhf/runtime.py); its build took
    # over 25 min on a slow box, and one killed half-way left a lock every later ZeRO run waited on forever.
    assert not (tmp_path / "ops").exists()
    rows = read_rows(ci_data)
    assert len(rows) == 2  # 32 episodes / (P*G*M = 8 prompts x 2 processes)
    # Linear decay over the run's 4 optimizer steps (2 per batch): one schedule step per update, not per process.
    lr = load_config(ROOT / "params.yaml", "ci").train.learning_rate
    assert [float(r["lr"]) for r in rows] == pytest.approx([lr * (1 - 2 / 4), lr * (1 - 4 / 4)])
    assert [int(float(r["train/global_step"])) for r in rows] == [2, 4]
    model = AutoModelForCausalLM.from_pretrained(ci_data / "train" / "policy")
    sft = AutoModelForCausalLM.from_pretrained(ci_data / "sft")
    assert set(model.state_dict()) == set(sft.state_dict())
    assert all(model.state_dict()[k].shape == v.shape for k, v in sft.state_dict().items())


def test_a_run_writes_nothing_into_the_users_home(ci_data, tmp_path):
    """Caches, W&B (offline) and telemetry ids stay in the project's folders (rlhf/runtime.py)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("HF_", "WANDB_", "PREFECT_", "XDG_", "TORCH_", "VLLM_", "DVC_"))
    }
    env["HOME"] = str(home)
    cmd = rlhf_command("--profile", "ci", "train", f"data_dir={ci_data}", "tracking.wandb_mode=offline")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == []


THREADS_CHILD = """
import json, os, sys
from types import SimpleNamespace
import torch
from rlhf.config import load_config
from rlhf.stages import train as stage
from rlhf.trainers import early, loop
seen = {}
# stand-ins for the engine's process and the training itself: what the stage does before them is under test
loop.train = lambda cfg, started=None: seen.__setitem__(case, torch.get_num_threads()) or {}
for case, engine_process, world in [("alone", None, "1"), ("one-of-two-ranks", None, "2"),
                                    ("beside-an-engine-process", SimpleNamespace(close=lambda at_once: None), "1")]:
    os.environ["WORLD_SIZE"] = world
    early.start_engine_process = lambda cfg, found=engine_process: early.EarlyStart("vllm_async", None, found)
    torch.set_num_threads(1)
    stage.run(load_config(sys.argv[1], "ci"))
print(json.dumps({"seen": seen, "cores": len(os.sched_getaffinity(0))}))
"""


def test_the_train_stage_places_its_engine_once_and_the_trainer_builds_on_it(ci_data, monkeypatch):
    """The stage's first step places the engine (rlhf.trainers.early) and hands the placement to the trainer's setup,
    which does not place it again: one placement a run, whichever of the two would ask."""
    from rlhf.stages import train as stage
    from rlhf.trainers import early, setup

    placed = []

    def engine_placement(cfg):
        placed.append(real(cfg))
        return placed[-1]

    real = early.engine_placement
    monkeypatch.setattr(early, "engine_placement", engine_placement)
    monkeypatch.setattr(setup, "engine_placement", engine_placement)  # setup's own name for it: asked without a start
    threads = torch.get_num_threads()
    try:
        stage.run(ci_config(ci_data, "train.trainer=online_dpo", "train.total_episodes=8"))
    finally:
        torch.set_num_threads(threads)  # the stage, alone, takes every core: not the later tests' business
    assert placed == [("hf", None)]  # the HF engine's (no vLLM in this process), placed by the stage only
    assert len(read_rows(ci_data)) == 1


def test_the_train_stage_takes_every_core_only_when_alone():
    """Generation in the training process and no other training process: the stage uses every core it may (sync
    runs were 1.2-1.3x faster on two threads than one on 2 cores); beside an engine process or another rank, the
    one thread each that processes sharing the cores want. In a fresh interpreter, as `rlhf train` runs: a test
    process that has hosted vLLM's CPU worker keeps torch at the thread count that worker bound."""
    env = {k: v for k, v in os.environ.items() if k not in ("RLHF_TORCH_THREADS", "RLHF_WARM_PYTHON", "WORLD_SIZE")}
    proc = subprocess.run(
        [sys.executable, "-c", THREADS_CHILD, str(ROOT / "params.yaml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["seen"] == {"alone": result["cores"], "one-of-two-ranks": 1, "beside-an-engine-process": 1}


@pytest.mark.parametrize("trainer", ["ppo", "rloo", "online_dpo"])
def test_every_model_that_samples_or_scores_computes_in_the_training_precision(ci_data, trainer):
    """train.mixed_precision=bf16: the engine's sampling, the reference, the reward model and (PPO) the value model all
    run under bf16 autocast, as the update does. PPO's engine samples with the policy inside the policy-and-value
    wrapper, whose forward accelerate never wrapped: it sampled in float32 (on a GPU, the slowest path)."""
    from accelerate.state import AcceleratorState

    from rlhf.trainers import loop
    from rlhf.trainers.setup import setup

    AcceleratorState._reset_state(reset_partial_state=True)  # this process's earlier runs trained in float32
    run = setup(ci_config(ci_data, f"train.trainer={trainer}", "train.mixed_precision=bf16"))
    seen: dict[str, list[bool]] = {}
    models = {"policy": run.policy, "reference": run.ref, "reward": getattr(run.reward_fn, "model", None)}
    if trainer == "ppo":
        models["value"] = run.acc.unwrap_model(run.model).value_model
    for name, model in models.items():
        first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        first.register_forward_hook(lambda m, i, o, name=name: seen.setdefault(name, []).append(o.dtype))
    try:
        loop.collect(run, 0, loop.Clock())
    finally:
        run.engine.close()
        AcceleratorState._reset_state(reset_partial_state=True)
    assert set(seen) == set(models) - ({"reference"} if run.ref is None else set())
    assert {name: set(dtypes) for name, dtypes in seen.items()} == {name: {torch.bfloat16} for name in seen}
    assert len(seen["policy"]) > 1  # the engine's decode steps and the behaviour forward


def test_the_parameters_gradient_accumulators_outlive_each_micro_steps_graph(ci_data):
    """PPO's policy and value model: each trainable parameter's AccumulateGrad node is held by the run, so a
    micro-step's graph finds the same node and does not free it with the rest (autograd holds it weakly: unheld, each
    forward made a new one and each graph's teardown freed ~200 a backbone)."""
    from accelerate.state import AcceleratorState

    from rlhf.trainers import loop
    from rlhf.trainers.setup import setup

    AcceleratorState._reset_state(reset_partial_state=True)
    run = setup(ci_config(ci_data, "train.trainer=ppo"))
    try:
        trainable = [p for p in run.model.parameters() if p.requires_grad]
        assert len(run.grad_accumulators) == len(trainable) > 0
        state = loop.checkpoint.LoopState()
        loop.update(run, loop.collect(run, 0, loop.Clock()), 0, state)  # micro-steps: their graphs built and freed
        for p, held in zip(trainable, run.grad_accumulators):
            assert p.view_as(p).grad_fn.next_functions[0][0] is held
    finally:
        run.engine.close()
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("trainer", ["ppo", "rloo", "online_dpo"])
def test_an_iteration_reads_the_device_at_most_three_times_all_when_it_logs(ci_data, trainer, monkeypatch):
    """Every `.item()`, `.tolist()`, `.cpu()`, `.numpy()` and tensor truth or number value taken in the loop's own code
    between an iteration's post-processing and its log (bench/host_overhead.py's ReadCounter): on a GPU each one
    waits for the device's queue. At most 3 per iteration, none inside a micro-step; reads of host bookkeeping go
    through batch.host_list, which refuses device tensors. Seen failing on the loop before it (6950680): 141-165 reads
    over the 3 iterations, 48 of them the prompt order's, read element by element."""
    sys.path.insert(0, str(ROOT / "bench"))
    from host_overhead import ReadCounter

    from rlhf.trainers import loop

    counter = ReadCounter()
    counter.active = False
    collect, log = loop.collect, loop.log

    def counted_collect(*args, **kwargs):
        counter.active = True
        return collect(*args, **kwargs)

    def counted_log(*args, **kwargs):
        try:
            return log(*args, **kwargs)
        finally:
            counter.active = False

    monkeypatch.setattr(loop, "collect", counted_collect)
    monkeypatch.setattr(loop, "log", counted_log)
    with counter.installed():
        train(ci_config(ci_data, f"train.trainer={trainer}", "train.total_episodes=24"))  # 3 iterations
    reads = sum(counter.sites.values())
    assert reads <= 3 * 3, dict(counter.sites)
    assert all(site.startswith(("rlhf/trainers/readback.py", "rlhf/trainers/loop.py")) for site in counter.sites)
    assert counter.counts["host"] > 0 and counter.counts["library"] > 0  # it saw host and library reads: it counts


def test_the_garbage_collector_runs_between_batches_on_its_schedule_only(ci_data, monkeypatch):
    """train.gc_every=2: while the loop runs, Python's collector is off (no collection of its own inside a step, where
    on a GPU the device's queue would drain during its scan) and what setup built is frozen out of its scans; a
    young-generation collection follows batches 1 and 3 only, each after that batch's log; afterwards the collector is
    as it was. (Seen failing with collect_garbage made a no-op, and with the collector left on inside the loop.)"""
    import gc

    from rlhf.trainers import loop

    events, batch = [], [-1]
    log = loop.log

    def logged(run, tracker, state, t, *args):
        batch[0] = t
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # inside the loop: off, setup's objects frozen
        return log(run, tracker, state, t, *args)

    def seen(phase, info):
        if phase == "start" and batch[0] >= 0:
            events.append((batch[0], info["generation"]))

    monkeypatch.setattr(loop, "log", logged)
    gc.callbacks.append(seen)
    try:
        train(ci_config(ci_data, "train.trainer=rloo", "train.total_episodes=32", "train.gc_every=2"))  # 4 batches
    finally:
        gc.callbacks.remove(seen)
    # after batch 3 the run finishes (export, W&B's finish) with the collector back on: its own collections may follow
    assert [e for e in events if e[0] < 3] == [(1, 1)], events
    assert (3, 1) in events
    assert gc.isenabled() and gc.get_freeze_count() == 0


@pytest.mark.parametrize("steps", [1, 2, 3, 16, 64])
def test_micro_step_means_are_the_float64_sums_in_step_order_on_either_path(steps):
    """readback._means: micro-steps with the same metrics take one stack and one mean over the steps; micro-steps
    whose metrics differ, one index_add. Both give each metric's float64 sum in micro-step order over its count:
    the same bits (here with the metrics of each step in another order, which takes the general path)."""
    from rlhf.trainers.readback import _means

    gen = torch.Generator().manual_seed(steps)
    scale = 10.0 ** torch.randint(-6, 7, (12,), generator=gen)
    step_stats = [{f"m{j}": torch.randn((), generator=gen) * scale[j] for j in range(12)} for _ in range(steps)]
    fast, general = (dict(zip(*_means(s))) for s in (step_stats, [dict(reversed(s.items())) for s in step_stats]))
    assert fast.keys() == general.keys() == {f"m{j}" for j in range(12)}
    for name, mean in fast.items():
        by_hand = sum(float(s[name]) for s in step_stats) / steps  # Python floats: float64, in step order
        assert mean.dtype == torch.float64 and torch.equal(mean, general[name]) and mean.item() == by_hand, name
    keys, partial = _means([{"a": torch.tensor(1.0), "b": torch.tensor(2.0)}, {"a": torch.tensor(4.0)}])
    assert dict(zip(keys, partial.tolist())) == {"a": 2.5, "b": 2.0}  # each over the steps that have it
