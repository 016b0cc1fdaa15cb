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
SFT model: where it runs changes only the time). `score` = "always", or "auto": every batch, every other one or
none scored in the engine, whichever the measured seconds make fastest (`ScoringSplit`; the learner scores the
others, Generated.scores None). Either way the numbers are the same, so runs stay deterministic.

Timing, `stats()` after each receive, for the batch just received:
  timing/engine_idle          seconds the engine waited for work since it sent the previous batch
  timing/scoring_engine       seconds the engine spent scoring the batch and computing its reference log-probs
                              (when it scores)
  timing/weight_sync_engine   seconds the engine spent taking new weights (vLLM's weight-transfer API) since the
                              previous batch
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


class ScoringSplit:
    """score_in_engine: auto. Which side scores the next batch (the reward model's and the reference's forwards): the
    engine every batch, every other batch, or none, whichever makes the shortest step.

    Per batch the learner works L seconds besides scoring, the engine generates for G and scoring costs C (measured
    in the engine; the learner runs the same forwards). The learner's step t runs beside the engine's batch t+1
    (N = 1), so a step takes max(L + C [the learner scores t], G + C [the engine scores t+1]), and a pattern's step
    is the mean of these: max(L, G + C) with all in the engine, max(L, G) + C/2 alternating, max(L + C, G) with all
    in the learner. A share in between, with one batch in flight, is no better than one of these three (the step is
    linear in it between them). So all in the engine while it is the faster side (a GPU engine; also the RLOO run on
    SmolLM2 that asked for auto: L 45, G 20, C 30 s; `tiny` on 2 cores: 0.21, 0.16, 0.07 s), alternating when the
    two are close (L 0.18, G 0.16, C 0.09 s: 0.225 s a step against 0.25), all in the learner when generation is
    the bulk. Moving averages follow the sides' speeds.
    """

    def __init__(self):
        self.learner = self.generation = self.cost = None  # seconds a batch: moving averages, None until measured
        self._owed = 0.0  # the fraction accumulated since the learner last scored

    def observe(self, learner_busy: float | None, generation: float, cost: float, learner_scored: bool) -> None:
        """One batch received. learner_busy: the learner's seconds from receiving the batch before until asking for
        this one (None for the first), its scoring included when `learner_scored` that batch; generation: the
        engine's seconds sampling this batch; cost: the engine's seconds scoring it (0: it did not)."""
        if cost > 0:
            self.cost = _average(self.cost, cost)
        if learner_busy is not None and self.cost is not None:
            self.learner = _average(self.learner, learner_busy - (self.cost if learner_scored else 0.0))
        self.generation = _average(self.generation, generation)

    def learner_fraction(self) -> float:
        """0, 1/2 or 1: the share of the batches the learner scores from now on (all in the engine until measured)."""
        if self.learner is None or self.generation is None or not self.cost:
            return 0.0
        learner, generation, cost = self.learner, self.generation, self.cost
        steps = {0.0: max(learner, generation + cost), 0.5: max(learner, generation) + cost / 2}
        steps[1.0] = max(learner + cost, generation)
        return min(steps, key=steps.__getitem__)  # a tie: the first, the engine's

    def engine_scores_next(self) -> bool:
        self._owed += self.learner_fraction()
        if self._owed >= 1:
            self._owed -= 1
            return False
        return True


def _average(old: float | None, new: float) -> float:
    return new if old is None else 0.7 * old + 0.3 * new


def start_engine(
    where, max_staleness: int, backend: str = "process", num_engines: int = 1, resource: str | None = None
):
    """The channel to an async engine placed as `where` says (factory.Placement), starting now: its own process
    (EngineProcess), or `num_engines` Ray actors (rlhf.generation.ray_engines.RayEngines), each also asking for one
    unit of Ray resource `resource` (train.engine_resource) when given."""
    if backend == "ray":
        from rlhf.generation.ray_engines import RayEngines

        return RayEngines(where.device, max_staleness, num_engines, where.ray_gpus, resource)
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
        self._split = ScoringSplit()  # score_in_engine auto: where the next batch is scored
        self._received_at: float | None = None  # when the previous batch was handed to the learner
        self._learner_scored = False  # the previous batch: scored by the learner
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
        score = self._score == "always" or (self._score == "auto" and self._split.engine_scores_next())
        self._put(Generate(batch, prompts, params, score, parts or [len(prompts)]))
        self._pending.append(batch)
        self._next_batch += 1

    def receive(self) -> Generated:
        """The oldest submitted batch; raises RuntimeError if the engine process died or failed."""
        if not self._pending:
            raise RuntimeError("AsyncEngine.receive: no batch was submitted")
        batch = self._pending[0]
        asked = time.perf_counter()
        self.wait_ready()
        while batch not in self._ready:
            self._handle(self._next_message(timeout=None))
        gen, stats = self._ready.pop(batch)
        busy = None if self._received_at is None else asked - self._received_at
        self._split.observe(busy, gen.seconds, stats.get("timing/scoring_engine", 0.0), self._learner_scored)
        self._received_at, self._learner_scored = time.perf_counter(), gen.scores is None
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
                gen = Generated.from_wire(msg.generated)
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
