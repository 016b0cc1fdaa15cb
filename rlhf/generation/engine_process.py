"""The async engine's own process, both sides: the messages the trainer and an engine exchange (also spoken by the
Ray actors, rlhf.generation.ray_engines), `EngineProcess` (the trainer's side: the process and its channels) and
`engine_process_main` (the engine's side: a VLLMEngine, built by rlhf.generation.engine_build, that handles the
messages in order until stopped). How the AsyncEngine drives them is described in rlhf.generation.async_engine."""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from typing import NamedTuple

import torch

from rlhf.generation.base import EngineSpec, Generated, SamplingParams
from rlhf.generation.engine_build import build
from rlhf.generation.quiet_channels import EngineInbox, quiet_fd_server
from rlhf.generation.vllm import Swap, VLLMEngine, import_engine_code
from rlhf.generation.weights import SharedWeights
from rlhf.runtime import give_back_cores, keep_off_cores, visible_gpus

POLL_SECONDS = 0.5  # how often a waiting side checks that the other one is still alive
PR_SET_PDEATHSIG = 1  # linux/prctl.h

# --- the messages, in both directions: module-level NamedTuples (they pickle through pipes and Ray), told apart by
# type. Trainer -> engine, handled strictly in order:


class Build(NamedTuple):  # the first message: build vLLM (and the scorer) as `spec` says
    spec: EngineSpec


class Weights(NamedTuple):  # load these weights before the next batch; answered by Ack
    weights: SharedWeights
    version: int


class Generate(NamedTuple):  # sample (and, if `score`, score) one batch; answered by a Result
    batch: int  # the run's batch index: seeds its samples
    prompts: list[list[int]]
    params: SamplingParams
    score: bool
    parts: list[int]  # how many of the prompts each training rank sent (scored part by part)


class Stop(NamedTuple):  # wakes an engine waiting for work when the stop event is set
    pass


# Engine -> trainer:


class Ready(NamedTuple):
    seconds: float  # the engine's start-up (LLM()) time


class Ack(NamedTuple):
    version: int  # the newest weight version the engine has loaded


class Result(NamedTuple):
    """One generated batch, on the wire, and the engine's time since the previous Result."""

    batch: int
    generated: dict  # Generated.to_wire(): samples, log-probs, per-token versions, scores and reference log-probs
    # when the engine computed them, the prompts as it sampled them, its seconds generating
    scoring: float  # scoring it and computing its reference log-probs
    idle: float  # waiting for work since the previous Result
    reload: float  # loading weights since the previous Result


class Error(NamedTuple):
    text: str  # the engine's traceback; it exits with code 1 after sending this


def engine_process_main(device: str, inbox, results, stop) -> None:
    """Entry point of the engine process: import vLLM and the scorer's code, wait for Build(EngineSpec), build
    the VLLMEngine (and the scorer), then serve until stopped. The imports (~7 s of the ~11 s start-up on these
    CPUs) run before the spec exists: the trainer starts this process first and sends the spec once it knows it.

    device: "cpu" or "cuda:<i>" (spec.device): needed before CUDA starts, so it comes at spawn, not with the spec.
    Errors are sent back as Error(traceback) before the process exits with code 1.
    """
    _die_with_parent()
    _progress_bars_lock_threads_only()
    device = see_only(device)
    outbox = _Sender(results)
    try:
        import_ahead(device)
        first = _next_work(inbox, stop)
        if first is None:
            return
        if not isinstance(first, Build):
            raise ValueError(f"expected the engine's spec first, got {type(first).__name__}")
        engine, scorer = build(first.spec, device)
        outbox.send(Ready(engine.start_seconds))
        _serve(engine, scorer, inbox, outbox, stop, first.spec)
    except BaseException:
        outbox.send(Error(traceback.format_exc()))
        outbox.flush(timeout=10)
        # Exit at once, with the code the trainer reports: vLLM lives in this process only, so there is
        # nothing to shut down, and a normal interpreter exit (vLLM/torch teardown) can take seconds.
        os._exit(1)
    outbox.flush(timeout=10)
    # Stopped: nothing of this process outlives it, and vLLM's and torch's teardown at a normal exit took ~2 s
    # of the train stage's wall clock.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def see_only(device: str) -> str:
    """Set this (new) process up for its engine on `device`, as the trainer numbers it; returns the device as this
    process numbers it. On the CPU: a core of its own (the trainer keeps the others) and one torch thread. On a GPU:
    before CUDA starts, only that GPU is visible (mapped through the trainer's CUDA_VISIBLE_DEVICES, which this
    process inherited), and no core pinning: vLLM's scheduler and the sampling loop then run wherever a core is free."""
    if not device.startswith("cuda"):
        pin_to_core((engine_cores(1) or [None])[0])
        return device
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus([int(device.partition(":")[2] or 0)])
    return "cuda:0"


def import_ahead(device: str = "cpu") -> None:
    """What building the engine and the scorer imports, imported while the spec is not known yet."""
    import_engine_code(device)  # vLLM's engine: ~6 s on these CPUs, 6 min on the slow box

    import rlhf.models.forward  # noqa: F401
    import rlhf.models.loading  # noqa: F401


def engine_cores(n: int) -> list[int] | None:
    """The cores `n` engines on this machine's CPU take, one each from the last allowed core down (wrapping round
    when there are fewer); None with a single core, which they share with the trainer."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[-1 - e % len(cores)] for e in range(n)] if len(cores) > 1 else None


def pin_to_core(core: int | None) -> None:
    """This engine's process on `core` alone (None: where it runs now), torch on one thread: the trainer keeps the
    other cores, and two busy processes on one core each ran at half speed."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)


class EngineClock:
    """The seconds an engine waited for work and spent loading weights since its last Result: the same accounting
    in the engine process and in a Ray actor. free() when it starts waiting, busy() when work arrives."""

    def __init__(self):
        self.free_since, self.idle, self.reload = time.perf_counter(), 0.0, 0.0

    def free(self) -> None:
        self.free_since = time.perf_counter()

    def busy(self) -> None:
        self.idle += time.perf_counter() - self.free_since

    def take(self) -> tuple[float, float]:
        """(idle, reload) since the last take, then zero."""
        taken, self.idle, self.reload = (self.idle, self.reload), 0.0, 0.0
        return taken


class _Stopped(Exception):
    """Asked to stop while a batch waited for its in-flight weights."""


def _serve(engine: VLLMEngine, scorer, inbox, outbox, stop, spec: EngineSpec) -> None:
    """Handle Weights and Generate messages in order until stopped."""
    clock = EngineClock()
    while True:
        clock.free()
        msg = _next_work(inbox, stop)
        clock.busy()
        match msg:
            case None:
                return
            case Weights(weights, version):
                clock.reload += engine.reload(weights, version)
                del msg, weights  # vLLM holds its own copy now: the trainer may reuse the shared buffers
                outbox.send(Ack(version))
            case Generate():
                swap = in_flight_swap(spec, msg.batch, lambda: _next_work(inbox, stop), engine, outbox, clock)
                try:
                    outbox.send(sample_and_score(engine, scorer, msg, clock, swap=swap))
                except _Stopped:
                    return
            case _:
                raise ValueError(f"unknown message {type(msg).__name__}")


def in_flight_swap(spec: EngineSpec, batch: int, next_message, engine: VLLMEngine, outbox, clock) -> Swap | None:
    """Batch `batch`'s in-flight weight update (train.weight_updates: in_flight), or None: between batches.

    Batch b >= N starts with version b-N, as between batches, and takes version b-N+1 at decode step
    spec.in_flight_step. The trainer sends that version right after Generate(b) (it submits batch t+N, trains batch
    t, then sends version t+1; a resume replays the same order, rlhf.trainers.loop.start), so the next message is
    always it: the engine waits for it there. Where the swap lands is fixed by the settings, not by when the weights
    arrive, so a run replays bit for bit. The first N batches have no newer version to take (none is trained yet)."""
    if spec.in_flight_step is None or batch < spec.max_staleness:
        return None
    wanted = batch - spec.max_staleness + 1

    def take() -> None:
        clock.free()
        msg = next_message()
        clock.busy()  # the wait for the learner's weights is the engine's idle time
        if msg is None:
            raise _Stopped
        if not isinstance(msg, Weights) or msg.version != wanted:
            got = f"version {msg.version}" if isinstance(msg, Weights) else type(msg).__name__
            raise RuntimeError(f"batch {batch}: the in-flight update expected weight version {wanted}, got {got}")
        clock.reload += engine.reload(msg.weights, msg.version, in_flight=True)
        outbox.send(Ack(msg.version))

    return Swap(spec.in_flight_step, take)


def sample_and_score(
    engine: VLLMEngine, scorer, work: Generate, clock: EngineClock, first: int = 0, swap: Swap | None = None
) -> Result:
    """One batch, sampled and (when work.score) scored, with the engine's idle and reload time since the last one.
    `first`: the index of work.prompts[0] in the run's batch, when this engine samples a slice of it (Ray engines);
    `swap`: its in-flight weight update (in_flight_swap)."""
    return scored(engine.generate(work.prompts, work.params, work.batch, first, swap), scorer, work, clock)


def scored(gen: Generated, scorer, work: Generate, clock: EngineClock) -> Result:
    """A sampled batch, scored when work.score, as the Result sent back."""
    scored = time.perf_counter()
    if scorer is not None and work.score:
        scores, refs = scorer(work.prompts, gen.responses, work.params, work.parts)
        gen.scores, gen.ref_logprobs = torch.from_numpy(scores), None if refs is None else torch.from_numpy(refs)
    scoring = time.perf_counter() - scored
    idle, reload = clock.take()
    return Result(work.batch, gen.to_wire(), scoring, idle, reload)


def _next_work(inbox, stop):
    """The next message, or None when asked to stop or when the trainer is gone."""
    while not stop.is_set():
        if not _trainer_alive():
            return None
        try:
            msg = inbox.get(timeout=POLL_SECONDS)
        except queue.Empty:
            continue
        return None if isinstance(msg, Stop) or stop.is_set() else msg
    return None


def _trainer_alive() -> bool:
    """The trainer (the process that started this one) still runs: its end of multiprocessing's start-up pipe is
    open. Unlike a parent-pid check, this holds when a launcher or fork server sits between the two."""
    return mp.parent_process().is_alive()


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the trainer dies, so no engine outlives a killed run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # not Linux: the check in _next_work still ends it
    if not _trainer_alive():
        os._exit(1)


def _progress_bars_lock_threads_only() -> None:
    """tqdm's first bar creates a multiprocessing lock (a named semaphore) so that bars of several processes can share
    a terminal. This process ends with os._exit, which never unlinks it, and multiprocessing's resource tracker then
    printed "leaked semaphore objects to clean up at shutdown" at the end of every async run. The engine's own bars
    (vLLM's) are drawn by its threads only: a thread lock serves them."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


class _Sender:
    """Sends messages to the trainer from a thread, through a bounded buffer, in order."""

    def __init__(self, conn, capacity: int = 64):
        self.conn = conn
        self.buffer: queue.Queue = queue.Queue(maxsize=capacity)
        self.thread = threading.Thread(target=self._run, name="rlhf-vllm-sender", daemon=True)
        self.thread.start()

    def send(self, msg: tuple) -> None:
        self.buffer.put(msg)

    def flush(self, timeout: float) -> None:
        self.buffer.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (msg := self.buffer.get()) is not None:
            try:
                self.conn.send(msg)
            except (BrokenPipeError, OSError):
                return  # the trainer is gone


# --- the trainer's side ------------------------------------------------------------------------------------


class EngineProcess:
    """The engine's process and its channels, started before the engine's spec is known: it imports vLLM while
    the trainer imports its own libraries and loads its models; an AsyncEngine then takes it over and sends the
    spec (rlhf.trainers.early starts it first thing in the train stage). device: the engine's (EngineSpec.device)."""

    def __init__(self, device: str, max_staleness: int):
        ctx = mp.get_context("spawn")
        self.device, self.max_staleness = device, max_staleness
        quiet_fd_server()  # the engine's death is this class's one line (`dead`), not a helper thread's traceback
        self.inbox = EngineInbox(maxsize=2 * (max_staleness + 2), ctx=ctx)
        self.stop = ctx.Event()
        self.results, writer = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=engine_process_main,
            args=(device, self.inbox, writer, self.stop),
            name="rlhf-vllm-engine",
            daemon=False,
        )
        self.proc.start()
        writer.close()  # the engine holds the only write end: its death closes the pipe
        # The engine pins itself to the last core; the trainer keeps the others, or the scheduler puts it on the
        # engine's core now and then (seen: both at ~50% of one core). Given back at close.
        key = object()
        if device == "cpu" and (cores := engine_cores(1)):
            keep_off_cores(key, set(cores))
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, self.stop, self.inbox, self.results, key)
        # Run before multiprocessing's own exit hook, which would join the (non-daemon) engine forever.
        self._finalizer.atexit = False
        atexit.register(self._finalizer)

    def close(self, at_once: bool = False) -> None:
        """Stop the process (stop event + sentinel, join, then terminate/kill); safe to call twice. at_once:
        terminate it now (it is still importing or building vLLM, deaf to the stop message: nothing to lose)."""
        if at_once and self._finalizer.alive and self.proc.is_alive():
            self.proc.terminate()
        self._finalizer()
        atexit.unregister(self._finalizer)

    # The channel an AsyncEngine drives (rlhf.generation.ray_engines.RayEngines offers the same five calls)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def send(self, msg: NamedTuple, timeout: float) -> bool:
        """Queue a message for the engine; False if the queue stayed full for `timeout` seconds."""
        try:
            self.inbox.put(msg, timeout=timeout)
            return True
        except queue.Full:
            return False

    def recv(self, timeout: float) -> NamedTuple | None:
        """The engine's next message within `timeout` seconds, else None; RuntimeError once the engine is gone."""
        try:
            if self.results.poll(timeout):
                return self.results.recv()
        except (EOFError, OSError):
            raise self.dead("closed its result channel") from None
        if not self.proc.is_alive() and not self.results.poll(0):
            raise self.dead("exited")
        return None

    def dead(self, what: str) -> RuntimeError:
        """The error that reports the engine process as `what` ("exited", "failed:\n<traceback>", ...)."""
        self.proc.join(timeout=5)  # the exit code, once it has exited
        code = self.proc.exitcode
        how = "still running" if code is None else f"exit code {code}"
        if code is not None and code < 0:
            how += f" ({signal.Signals(-code).name})"
        return RuntimeError(f"vLLM engine process (pid {self.proc.pid}, {how}) {what}")


def _shutdown(proc, stop, inbox, results, cores_key: object, timeout: float = 30.0) -> None:
    """Stop the engine process, free the channels, give the trainer the engine's core back (EngineProcess's
    finalizer: runs once)."""
    give_back_cores(cores_key)
    if proc.is_alive():
        stop.set()  # skip batches still queued
        try:
            inbox.put_nowait(Stop())  # wakes it if it waits for work
        except (queue.Full, ValueError, OSError):
            pass
        deadline = time.monotonic() + timeout
        while proc.is_alive() and time.monotonic() < deadline:
            try:  # keep its results flowing so it is never stuck sending
                while results.poll(0.2):
                    results.recv()
            except (EOFError, OSError):
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
    proc.join(timeout=5)
    results.close()
    inbox.cancel_join_thread()  # unsent messages to a dead engine must not block interpreter exit
    inbox.close()
