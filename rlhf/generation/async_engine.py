"""Asynchronous generation: a VLLMEngine in its own process samples up to N batches ahead of training.
This module is the trainer's side; rlhf.generation.engine_process holds the messages and both sides of the engine's
process (EngineProcess, engine_process_main). With
train.engine_backend: ray the same AsyncEngine drives E engines as Ray actors instead (rlhf.generation.ray_engines:
same messages, same staleness rule); what follows describes the process backend.

Processes and channels:
- The trainer (this process) and one engine process (multiprocessing "spawn"), pinned to the last allowed core
  with torch on one thread. vLLM runs inside it (VLLMEngine builds it in-process, "uni" executor): one process
  to watch, to kill and to pin, no grandchild left behind when it dies, and a ~3 s engine start instead of
  ~19 s for vLLM's own engine-core process.
- Start-up: the process (EngineProcess) is spawned first thing in the train stage and imports vLLM while the
  trainer imports and loads; the AsyncEngine then sends Build(EngineSpec), and the process builds vLLM and
  its scorer and answers Ready(seconds) (or Error(traceback)).
- trainer -> engine: a bounded multiprocessing Queue of messages handled strictly in order,
  Weights(SharedWeights, version), answered by Ack(version), and Generate(batch, prompts, params, score, parts),
  answered by a Result (engine_process: one record per batch, arrays as numpy). Bounded at 2(N+2)
  messages; the loop never has more than N+1 batches and N+1 weight versions outstanding.
- engine -> trainer: a one-way Pipe whose write end only the engine holds, so the engine's death reads as EOF
  (a Queue would leave a read blocked forever on a half-written message). The engine sends from a thread
  with a bounded buffer, so a large result never stops it from starting the next batch.
Every read polls with a timeout and checks that the engine is alive: if it dies (killed, crashed, vLLM
error) the next receive/submit/load_weights raises RuntimeError naming the engine process, its exit code and
the error text it sent, within about a second. The engine exits too if the trainer dies (parent-death signal).

Staleness: batch t is sampled with the newest weights the engine has loaded when it starts batch t. The loop
submits batch t+N before it trains batch t and calls load_weights(version t+1) after training batch t, and the
engine handles messages in order, so batch t is sampled with version >= t-N: staleness <= N.

Weights: load_weights copies the trainer's weights between optimizer steps into shared memory
(weights.shared_snapshot: gathered under ZeRO-3) and only enqueues the message, which carries the memory's
handle, not its bytes; the trainer never waits for the engine's reload. A copy's buffers are reused for a later
version once the engine has loaded a newer one and no checkpoint can need it (it is more than N old). The N
newest copies before the current version are the weights of the batches still in flight: a checkpoint writes
them to files (`weights_in_flight`) and a resume puts them back (`load_snapshot`), so a resumed run samples every
batch with the same version as an uninterrupted one. At most N+2 copies live at once (transfer.shm_copies); before the
first, /dev/shm must have room for them, or the run stops with one line naming docker's --shm-size / --ipc=host.

With max_staleness 0 this is the colocated engine in its own process (several training processes: rank 0 holds
it, see rlhf.generation.shared): each batch is sampled after the previous update's weights arrived.

Scoring: given a RewardSpec, the engine process can also score a batch (post-processed exactly as the learner
would, with the same code: the same scores) right after sampling it, so the reward model's forward overlaps
training; given a ReferenceSpec it computes the batch's reference log-probs there too (the reference is the frozen
SFT model: where it runs changes only the time). `score` = "always", or "auto": batches are scored in the engine
until the learner waits for them longer than the scoring costs the engine (then moving it to the learner shortens
the step; Generated.scores is None), and back once the engine idles longer than that (`engine_scores_next`).
Either way the numbers are the same, so runs stay deterministic.

Timing, `stats()` after each receive, for the batch just received:
  timing/engine_idle          seconds the engine waited for work since it sent the previous batch
  timing/scoring_engine       seconds the engine spent scoring the batch and computing its reference log-probs
                              (when it scores)
  timing/weight_sync_engine   seconds the engine spent in reload_weights since the previous batch
  timing/weight_snapshot      seconds the trainer spent in its last load_weights (gather, copy to shared memory)
Generated.seconds is the engine's own generation time for the batch.
"""

from __future__ import annotations

import atexit
import math
import shutil
import time
import weakref
from collections import deque
from pathlib import Path

import torch

from rlhf.generation.base import EngineSpec, Generated, SamplingParams
from rlhf.generation.engine_process import (
    POLL_SECONDS,
    Ack,
    Build,
    EngineProcess,
    Error,
    Generate,
    Ready,
    Result,
    Weights,
)
from rlhf.generation.transfer import check_shm_room, free_bytes, shm_copies
from rlhf.generation.weights import SharedWeights, read_snapshot, shared_snapshot, weight_bytes, write_snapshot
from rlhf.runtime import env_int


def engine_scores_next(engine_scores: bool, learner_wait: float, engine_idle: float, cost: float) -> bool:
    """score_in_engine: auto. Whether the engine scores the next batch (the reward model's and the reference's
    forwards: `cost` seconds a batch there), given whether it scores now and, since then, the learner's wait for
    batches and the engine's wait for work (seconds a batch). Moving the scoring adds `cost` to one side and takes it
    from the other, so it pays only when the side doing it is the slower one by more than `cost`: moved to the
    learner when the learner waits longer than that, back to the engine when the engine idles longer."""
    if engine_scores:
        return learner_wait - engine_idle <= cost
    return engine_idle - learner_wait > cost


def start_engine(where, max_staleness: int, backend: str = "process", num_engines: int = 1):
    """The channel to an async engine placed as `where` says (factory.Placement), starting now: its own process
    (EngineProcess), or `num_engines` Ray actors (rlhf.generation.ray_engines.RayEngines)."""
    if backend == "ray":
        from rlhf.generation.ray_engines import RayEngines

        return RayEngines(where.device, max_staleness, num_engines, where.ray_gpus)
    if backend != "process" or num_engines != 1:
        raise ValueError(f"an engine process is one engine (backend process), got {num_engines} on {backend!r}")
    return EngineProcess(where.device, max_staleness)


class AsyncEngine:
    """The Engine protocol over a VLLMEngine in its own process (or E of them as Ray actors: the channel decides);
    lookahead = max_staleness (N >= 0)."""

    def __init__(self, spec: EngineSpec, process, start_timeout: float | None = None):
        """spec: the engine to build, in spec.work_dir the checkpoints' copies of the weights in flight; process: its
        channel (start_engine), started for spec.device and spec.lookahead; start_timeout: seconds the engine may
        take to build (None: RLHF_ENGINE_START_TIMEOUT, default 600; a slow machine took 4-6 min for a tiny model)."""
        max_staleness = spec.lookahead
        if (process.device, process.max_staleness) != (spec.device, max_staleness):
            raise ValueError(
                f"AsyncEngine: the process was started for {process.device} with max_staleness "
                f"{process.max_staleness}, the engine needs {spec.device} and {max_staleness}"
            )
        self.lookahead = max_staleness
        self.work_dir = Path(spec.work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self._next_batch = 0  # the batch index (seeds) of the next submit
        self._pending: deque[int] = deque()  # submitted batch indices not yet received, oldest first
        self._ready: dict[int, tuple[Generated, dict]] = {}  # results read while waiting for something else
        self._snapshots: dict[int, SharedWeights] = {}  # version -> weights the engine may still need
        self._spare: list[SharedWeights] = []  # buffers of versions the engine is done with, to reuse
        self._acked = 0  # the newest weight version the engine has loaded
        self._shm_checked = False
        self._stats: dict[str, float] = {}
        self._snapshot_seconds = 0.0
        self._score = spec.score if spec.reward is not None else "never"
        # score_in_engine auto: moving averages, seconds per batch, of who waits for whom since the scoring last
        # moved, and of what scoring costs the engine; where the next batch is scored
        self._learner_wait = self._engine_idle = self._scoring_cost = 0.0
        self._engine_scores, self._filled = self._score != "never", False
        self.start_seconds = float("nan")
        self._process = process
        self._finalizer = weakref.finalize(self, _close, self._process, self.work_dir)
        self._finalizer.atexit = False  # as EngineProcess: before multiprocessing's exit hook
        atexit.register(self._finalizer)
        # vLLM builds in the engine process while the trainer goes on loading its models: messages queue up until
        # it is ready, and the first receive() waits for it (wait_ready).
        self._start_timeout = start_timeout or env_int("RLHF_ENGINE_START_TIMEOUT", 600, minimum=1)
        self._start_deadline = time.monotonic() + self._start_timeout
        self._put(Build(spec))

    # The Engine protocol

    def seek(self, batch: int) -> None:
        self._next_batch = batch

    def submit(self, prompts: list[list[int]], params: SamplingParams, parts: list[int] | None = None) -> None:
        batch = self._next_batch
        if self._score == "auto":
            scores = engine_scores_next(self._engine_scores, self._learner_wait, self._engine_idle, self._scoring_cost)
            if scores != self._engine_scores:  # fresh evidence from here on, about the new placement
                self._engine_scores, self._learner_wait, self._engine_idle = scores, 0.0, 0.0
        self._put(Generate(batch, prompts, params, self._engine_scores, parts or [len(prompts)]))
        self._pending.append(batch)
        self._next_batch += 1

    def receive(self) -> Generated:
        """The oldest submitted batch; raises RuntimeError if the engine process died or failed."""
        if not self._pending:
            raise RuntimeError("AsyncEngine.receive: no batch was submitted")
        batch = self._pending[0]
        waited = time.perf_counter()
        self.wait_ready()
        while batch not in self._ready:
            self._handle(self._next_message(timeout=None))
        gen, stats = self._ready.pop(batch)
        if self._filled:  # the first batch's wait is the engine's start and a pipeline filling up: not evidence
            self._learner_wait = 0.7 * self._learner_wait + 0.3 * (time.perf_counter() - waited)
            self._engine_idle = 0.7 * self._engine_idle + 0.3 * stats["timing/engine_idle"]
        self._filled = True
        if (cost := stats.get("timing/scoring_engine", 0.0)) > 0:
            self._scoring_cost = 0.7 * self._scoring_cost + 0.3 * cost if self._scoring_cost else cost
        self._pending.popleft()
        self._stats = {**stats, "timing/weight_snapshot": self._snapshot_seconds}
        return gen

    def load_weights(self, model: torch.nn.Module, version: int) -> None:
        """Copy `model`'s weights into shared memory and queue them; the engine loads them before its next batch."""
        start = time.perf_counter()
        self._recycle(version)
        self._check_shm(weight_bytes(model))
        self._queue_weights(shared_snapshot(model, self._spare.pop() if self._spare else None), version)
        self._snapshot_seconds = time.perf_counter() - start

    def _recycle(self, version: int) -> None:
        """Before `version` is sent: the copies no checkpoint will need (older than version-N) and that the engine is
        done with (it acknowledged a newer version) become spare buffers; their checkpoint files go."""
        while self._process.alive() and (msg := self._next_message(timeout=0)) is not None:  # acks so far
            self._handle(msg)
        for old in [v for v in self._snapshots if v < min(version - self.lookahead, self._acked)]:
            self._spare = [self._snapshots.pop(old)]  # one spare set of buffers is enough
            shutil.rmtree(self.work_dir / f"v{old:06d}", ignore_errors=True)

    def load_snapshot(self, folder: Path, version: int) -> None:
        """Queue weights a checkpoint wrote (`weights_in_flight`); `folder` stays untouched."""
        self._check_shm(sum(f.stat().st_size for f in Path(folder).iterdir()))  # the weights' file
        self._queue_weights(read_snapshot(folder), version)

    def _check_shm(self, nbytes: int) -> None:
        """Before the first copy into shared memory: /dev/shm must hold every copy kept at once (a container's
        default 64 MB fails at the first sync with SIGBUS and no hint)."""
        if not self._shm_checked:
            check_shm_room(nbytes * shm_copies(self.lookahead), free_bytes())
            self._shm_checked = True

    def weights_in_flight(self, version: int) -> dict[int, Path]:
        """Files of versions version-N .. version-1 (>= 1), written now: batches version .. version+N-1 are sampled
        with them. Version 0 is the starting model, which a resume has anyway."""
        folders = {}
        for v, weights in self._snapshots.items():
            if max(1, version - self.lookahead) <= v < version:
                folders[v] = self.work_dir / f"v{v:06d}"
                if not folders[v].exists():  # an earlier checkpoint may have written it
                    write_snapshot(weights, folders[v])
        return folders

    def close(self) -> None:
        """Stop the engine process (stop event + sentinel, join, then terminate/kill); safe to call twice."""
        self._process.close(at_once=math.isnan(self.start_seconds))  # still building: nothing to lose
        self._finalizer()
        atexit.unregister(self._finalizer)

    def stats(self) -> dict[str, float]:
        """Timings for the batch last received (see the module docstring)."""
        return dict(self._stats)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    # Channel plumbing

    def wait_ready(self) -> None:
        """Block until the engine process has built vLLM; its start-up errors are raised here, and it is closed."""
        try:
            while math.isnan(self.start_seconds):
                msg = self._next_message(timeout=max(0.0, self._start_deadline - time.monotonic()))
                if msg is None:
                    raise self._process.dead(
                        f"did not start within {self._start_timeout:.0f} s (on a slow machine, set "
                        "RLHF_ENGINE_START_TIMEOUT to more seconds)"
                    )
                self._handle(msg)
        except BaseException:
            self.close()
            raise

    def _queue_weights(self, weights: SharedWeights, version: int) -> None:
        self._snapshots[version] = weights
        self._put(Weights(weights, version))

    def _put(self, msg: Build | Weights | Generate) -> None:
        while True:
            if not self._finalizer.alive:
                raise RuntimeError("AsyncEngine: used after close()")
            if not self._process.alive():  # fail now, not at the next receive
                while (ready := self._next_message(timeout=0)) is not None:  # raises with its error or exit code
                    self._handle(ready)
            if self._process.send(msg, timeout=POLL_SECONDS):
                return
            # The engine may be waiting to hand over results: take them so it can move on.
            while (ready := self._next_message(timeout=0)) is not None:
                self._handle(ready)

    def _next_message(self, timeout: float | None) -> Ready | Ack | Result | Error | None:
        """The next message from the engine; None after `timeout` seconds (None = wait as long as it lives)."""
        if not self._finalizer.alive:
            raise RuntimeError("AsyncEngine: used after close()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = POLL_SECONDS if deadline is None else max(0.0, min(POLL_SECONDS, deadline - time.monotonic()))
            if (msg := self._process.recv(wait)) is not None:
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _handle(self, msg: Ready | Ack | Result | Error) -> None:
        match msg:
            case Result():
                scores, refs = (None if a is None else torch.from_numpy(a) for a in (msg.scores, msg.refs))
                responses, logprobs = torch.from_numpy(msg.responses), torch.from_numpy(msg.logprobs)
                gen = Generated(responses, msg.version, msg.seconds, logprobs, scores, msg.prompts, ref_logprobs=refs)
                stats = {"timing/engine_idle": msg.idle, "timing/weight_sync_engine": msg.reload}
                if self._score != "never":
                    stats["timing/scoring_engine"] = msg.scoring
                self._ready[msg.batch] = (gen, stats)
            case Ack(version):
                self._acked = version
            case Ready(seconds):
                self.start_seconds = seconds
            case Error(text):
                raise self._process.dead(f"failed:\n{text}")
            case _:
                raise RuntimeError(f"AsyncEngine: unknown message {msg!r} from the vLLM engine process")


def _close(process: EngineProcess, work_dir: Path) -> None:
    """AsyncEngine's finalizer: stop its process, delete the weight files."""
    process.close()
    for folder in work_dir.glob("v[0-9]*"):
        shutil.rmtree(folder, ignore_errors=True)
