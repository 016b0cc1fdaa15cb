"""Generation engines as Ray actors (train.engine_backend: ray): E engines, each a VLLMEngine built by the same code
as the engine process (rlhf.generation.engine_process), placed by Ray on any node of a cluster.

`RayEngines` is the channel an AsyncEngine drives, with the same calls as EngineProcess (send, recv, alive, dead,
close), so staleness, checkpoints of the weights in flight and scoring are the async engine's, unchanged:
- Build(spec): every actor builds its engine (and scorer); Ready(seconds of the slowest) once all have.
- Weights(SharedWeights, version): one copy goes into Ray's object store (numpy buffers: actors on the
  learner's node read them without a copy, other nodes fetch them once) and every actor loads it; Ack(version)
  once all have. No shared filesystem is needed. The put and each actor's fetch are timed: one line at close.
- Generate(batch, prompts, params, score, parts): the prompts are cut into E contiguous slices, slice e to actor
  e, which seeds prompt i of the batch as a single engine would (rlhf.generation.vllm.request_seed), so a run is
  reproducible for a fixed E; the slices come back as one Result, in prompt order.
Staleness: Ray runs the calls one caller makes on an actor in the order they were made (these actors run one call at
a time), and every actor gets each weights call before the generate calls made after it, so every slice of batch t
is sampled with the same version, the newest loaded when the actor starts it: >= t-N, as with one engine.
In-flight updates (spec.in_flight_step): batch b >= N's slices are begun (`generate` up to that decode step), the
next version's `load(..., in_flight=True)` follows when the trainer sends it, then `finish`: the same order on every
actor, so every slice takes the update at the same step, as the engine process does (engine_process.in_flight_swap).
Faults: an actor that dies (killed, out of memory), becomes unreachable (its node lost: 1.8-3.0 s after a node was
SIGKILLed here) or raises fails the trainer's next receive with a RuntimeError naming the actor, its node (IP and
id) and pid. Actors are not restarted.
Cluster: with RAY_ADDRESS set, ray.init joins that cluster; else the first RayEngines of the process starts a local
one bound to 127.0.0.1 (no dashboard; its files in .cache/ray), stopped when the last RayEngines on it closes: its
GCS, raylet and monitors took ~half a core of a 2-core box even with no actor left. Placement: Ray's, or only
nodes with a custom resource (train.engine_resource; one line says where each actor and the learner run).
GPU (reasoned, not run: docs/scale-out.md): an engine on a GPU asks Ray for one (num_gpus=1) and runs vLLM there;
weights still travel through host memory, where an NCCL broadcast from the learner would replace the object store.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections import deque
from typing import NamedTuple

import numpy as np
import psutil

from rlhf.generation.base import Generated
from rlhf.generation.engine_process import Ack, Build, Generate, Ready, Result, Weights, engine_cores
from rlhf.generation.ray_actor import EngineActor, pack_weights
from rlhf.runtime import CACHE, OFFLINE_ENV, give_back_cores, keep_off_cores, visible_gpus

# On a slow or loaded machine the raylet gives up on its dashboard agent after a fixed 15 s and the node fails to
# start ("The current node timed out during startup", ray-project/ray#65983): the agent's start varies with the load.
START_ATTEMPTS = 3
_local_users = 0  # open RayEngines on a local cluster start_cluster started: the last one to close stops it


def start_cluster(gpus: tuple[int, ...] | None = None) -> bool:
    """Join RAY_ADDRESS's cluster, or start a local one on loopback; nothing when Ray is already initialised.
    gpus: the GPUs of this node (as this process numbers them) a local cluster may hand to engines; None = none.
    True when Ray runs on the local cluster this function started (now or before), False when joined or when
    Ray was initialised by someone else (theirs to stop)."""
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return _local_users > 0
    address = os.environ.get("RAY_ADDRESS")
    if address is None or address.removeprefix("ray://").startswith(("127.0.0.1:", "localhost:")):
        # A node of no cluster takes 127.0.0.1 as its address and every server binds to it, not to all interfaces
        # (rlhf.runtime sets the variable behind this flag too; vLLM may have imported ray before we could). A
        # cluster on this machine's loopback is dialled there: with the flag on, Ray swaps a loopback address for
        # the host's routable IP, where such a cluster does not listen.
        ray_constants.ENABLE_RAY_CLUSTER = False
    env = {"env_vars": {k: os.environ[k] for k in OFFLINE_ENV if k in os.environ}}
    if "RAY_ADDRESS" in os.environ:
        _check_reachable(os.environ["RAY_ADDRESS"])
        ray.init(runtime_env=env, configure_logging=False)
        return False
    (CACHE / "ray").mkdir(parents=True, exist_ok=True)
    # The cluster's processes see only the engines' GPUs (not the training ranks'): Ray hands those out. This
    # process keeps its own view: CUDA reads the variable once, when it starts, and the trainer's comes later.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_gpus(list(gpus))
    try:
        _init_local_node(
            num_cpus=os.cpu_count(),
            num_gpus=len(gpus or ()),
            include_dashboard=False,
            _temp_dir=str(CACHE / "ray"),
            runtime_env=env,
            configure_logging=False,
        )
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return True


def _init_local_node(**init) -> None:
    """ray.init(**init) for a local node, started again (up to START_ATTEMPTS times) when it times out starting."""
    import ray

    for attempt in range(1, START_ATTEMPTS + 1):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            ray.init(**init)
            return
        except Exception as err:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(err):
                raise
            _kill_new_children(before)  # the half-started node's GCS and monitors: no one else stops them
            if attempt == START_ATTEMPTS:
                raise
            print(f"Ray's local node timed out starting (attempt {attempt}): starting it again", file=sys.stderr)


def _kill_new_children(before: set[int]) -> None:
    """Kill this process's descendants that are not in `before` (pids), and wait for them."""
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(new, timeout=10)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """A RAY_ADDRESS host:port that nothing answers fails here in seconds (ray.init would retry for minutes)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if address == "auto" or not port.isdigit():
        return  # Ray's own forms ("auto": the cluster started on this node): Ray resolves and reports them
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({err.strerror or err}); start one "
            "(`ray start --head`, docs/scale-out.md) or unset RAY_ADDRESS for a local cluster"
        ) from None


def slices(n: int, engines: int) -> list[tuple[int, int]]:
    """[start, end) of each engine's prompts: n split into `engines` contiguous slices, sizes differing by <= 1."""
    bounds = np.cumsum([0] + [n // engines + (e < n % engines) for e in range(engines)])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def slice_parts(parts: list[int], start: int, end: int) -> list[int]:
    """The training ranks' parts (prompt counts, in order) cut to prompts [start, end): the sub-parts in it."""
    edges = np.cumsum([0, *parts])
    cut = [min(max(e, start), end) for e in edges]
    return [b - a for a, b in zip(cut[:-1], cut[1:]) if b > a]


class RayEngines:
    """E EngineActors and the calls in flight to them, as the message channel an AsyncEngine drives."""

    def __init__(
        self,
        device: str,
        max_staleness: int,
        num_engines: int,
        gpus: tuple[int, ...] | None = None,
        resource: str | None = None,
    ):
        """device: "cpu" or "cuda:0" (each actor's own GPU); gpus: see start_cluster; resource: a custom Ray
        resource each actor also asks one unit of (train.engine_resource: the engine nodes have it)."""
        global _local_users
        self._local = start_cluster(gpus if device.startswith("cuda") else None)
        import ray

        if resource is not None:
            try:
                _check_resource(resource, num_engines)
            except ValueError:
                if self._local and _local_users == 0:
                    ray.shutdown()
                raise
        _local_users += self._local
        self.device, self.max_staleness, self.num_engines = device, max_staleness, num_engines
        resources = dict(num_gpus=1, num_cpus=1) if device.startswith("cuda") else dict(num_cpus=1)
        if resource is not None:
            resources["resources"] = {resource: 1}
        actor = ray.remote(max_restarts=0, max_task_retries=0, **resources)(EngineActor)
        # On the local cluster this process started, each engine gets a core of its own from the last one down, as
        # the engine process does. Not on a joined cluster: the engines may be on other machines (or, on this one,
        # on cores the learner's pinning knows nothing of), and their node's raylet holds them to their CPUs.
        cores = engine_cores(num_engines) if self._local and device == "cpu" else None
        self.resource = resource
        self.syncs: list[tuple[int, float]] = []  # per weight version put: (bytes, seconds of pack + put)
        self.fetches: list[float] = []  # per actor and version: seconds its ray.get of the weights took
        self.actors = [actor.remote(core) for core in cores or [None] * num_engines]
        # each actor's name in errors: its Ray id until it is built, then its node and pid
        self.where = [f"actor {e} (id {a._actor_id.hex()[:12]})" for e, a in enumerate(self.actors)]
        self._calls: deque = deque()  # (kind, key, engine index, ObjectRef), oldest first
        self.in_flight_step: int | None = None  # the spec's: in-flight updates at this decode step
        self._begun: dict[int, dict[int, Generate]] = {}  # batch -> its slices begun, awaiting their update
        self._parts: dict[tuple, tuple[int, dict]] = {}  # (kind, key) -> (calls made, engine index -> value)
        self._done: deque[tuple] = deque()  # messages ready for recv
        self._failed: RuntimeError | None = None
        self._cores_key = object()
        if cores:  # the trainer keeps the cores no engine took (all when they took every one); given back at close
            keep_off_cores(self._cores_key, set(cores))

    @property
    def pid(self) -> None:
        return None  # several processes, possibly on other nodes: `where` names them

    def alive(self) -> bool:
        return self._failed is None

    def send(self, msg: Build | Weights | Generate, timeout: float) -> bool:
        """Hand the message to every actor now (Ray queues the calls); always True."""
        import ray

        match msg:
            case Build(spec):
                self.in_flight_step = spec.in_flight_step
                self._call(Ready, None, {e: a.build.remote(spec) for e, a in enumerate(self.actors)})
            case Weights(weights, version):
                start = time.perf_counter()
                packed = pack_weights(weights)
                ref = ray.put(packed)
                self.syncs.append((sum(a.nbytes for a in packed[0].values()), time.perf_counter() - start))
                # in flight: the batch begun before these weights takes them half-way (engine_process.in_flight_swap)
                taker = version + self.max_staleness - 1
                begun = self._begun.pop(taker, None)
                loads = {e: a.load.remote([ref], version, begun is not None) for e, a in enumerate(self.actors)}
                self._call(Ack, version, loads)
                if begun is not None:
                    self._call(Result, taker, self._finish(begun))
            case Generate(batch, prompts, parts=parts):
                cuts = slices(len(prompts), self.num_engines)  # a batch smaller than E leaves the last engines idle
                work = {
                    e: (msg._replace(prompts=prompts[a:b], parts=slice_parts(parts, a, b)), a)
                    for e, (a, b) in enumerate(cuts)
                    if b > a
                }
                if self.in_flight_step is None or batch < self.max_staleness:
                    self._call(Result, batch, {e: self.actors[e].generate.remote(*w) for e, w in work.items()})
                else:
                    until = self.in_flight_step
                    self._call(_Begun, batch, {e: self.actors[e].generate.remote(*w, until) for e, w in work.items()})
                    self._begun[batch] = {e: w[0] for e, w in work.items()}
            case _:
                raise ValueError(f"RayEngines: unknown message {msg!r}")
        return True

    def recv(self, timeout: float) -> Ready | Ack | Result | None:
        """The next complete message (every actor's part of it arrived) within `timeout` seconds, else None."""
        import ray

        if self._failed is not None:
            raise self._failed
        if not self._done and self._calls:
            refs = [ref for *_, ref in self._calls]
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
                for call in [c for c in self._calls if c[3] in ready]:
                    self._calls.remove(call)
                    self._collect(*call)
        elif not self._done:
            time.sleep(timeout)
        return self._done.popleft() if self._done else None

    def dead(self, what: str) -> RuntimeError:
        return RuntimeError(f"vLLM engine actors ({', '.join(self.where)}) {what}")

    def close(self, at_once: bool = False) -> None:
        """Kill the actors (nothing of theirs is kept), stop the local cluster if no other RayEngines uses it, and
        give the trainer its cores back; safe to call twice."""
        global _local_users
        import ray

        if self.syncs and self.actors:
            print(self.sync_summary(), file=sys.stderr)
        if ray.is_initialized():
            for a in self.actors:
                ray.kill(a, no_restart=True)
        self.actors, self._calls = [], deque()
        if self._local:
            self._local, _local_users = False, _local_users - 1
            if _local_users == 0 and ray.is_initialized():
                ray.shutdown()
        give_back_cores(self._cores_key)

    def placement(self) -> str:
        """One line: where each actor runs (node IP, node id, pid) and the learner's node, once all are built."""
        import ray

        asked = f" (each asked for Ray resource {self.resource!r})" if self.resource else ""
        learner = ray.get_runtime_context().get_node_id()[:12]
        return f"Ray engines{asked}: {'; '.join(self.where)}; the learner on node {learner}"

    def sync_summary(self) -> str:
        """One line: the weight syncs through the object store so far, their bytes and seconds."""
        sizes = {size for size, _ in self.syncs}
        size = f"{max(sizes) / 1e6:.2f} MB" if len(sizes) == 1 else f"{min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB"
        put = [s for _, s in self.syncs]
        fetch = f"{np.mean(self.fetches):.4f} s (max {max(self.fetches):.4f})" if self.fetches else "none"
        return (
            f"Ray engines: {len(self.syncs)} weight syncs of {size} through the object store: learner's pack + put "
            f"{np.mean(put):.4f} s (max {max(put):.4f}), each actor's fetch {fetch}"
        )

    def _finish(self, begun: dict[int, Generate]) -> dict[int, object]:
        """The `finish` calls of a batch's slices begun before an in-flight update."""
        return {e: self.actors[e].finish.remote(work) for e, work in begun.items()}

    def _call(self, kind: type, key, refs: dict[int, object]) -> None:
        """Track the calls `refs` (engine index -> ObjectRef) as the parts of one message."""
        self._parts[(kind, key)] = (len(refs), {})
        self._calls.extend((kind, key, e, ref) for e, ref in refs.items())

    def _collect(self, kind: type, key, engine: int, ref) -> None:
        import ray

        try:
            value = ray.get(ref)
        except ray.exceptions.ActorDiedError as err:  # Ray's text: what happened, then pid and node
            self._failed = self._actor_error(engine, "died", " ".join(str(err).split()))
        except ray.exceptions.ActorUnavailableError as err:  # its node lost (seen ~3 s after a node was killed)
            # Ray may see the actor again after a network blip; with no restarts and batches possibly lost, the run
            # stops anyway and resumes from its last checkpoint.
            self._failed = self._actor_error(engine, "is unreachable (its node lost?)", " ".join(str(err).split()))
        except ray.exceptions.RayError as err:
            self._failed = self._actor_error(engine, "failed", err)
        if self._failed is not None:
            raise self._failed
        if kind is Ready:
            self.where[engine] = f"actor {engine} on node {value[1]} {value[3][:12]}, pid {value[2]}"
        elif kind is Ack:
            self.fetches.append(value[1])
        expected, parts = self._parts[(kind, key)]
        parts[engine] = value
        if len(parts) == expected:
            del self._parts[(kind, key)]
            if kind is Ready:
                print(self.placement(), file=sys.stderr)
            if kind is not _Begun:  # a batch's first decode steps: its Result comes from the finish calls
                self._done.append(_merge(kind, key, [parts[e] for e in sorted(parts)]))

    def _actor_error(self, engine: int, what: str, err) -> RuntimeError:
        return RuntimeError(f"vLLM engine {self.where[engine]} of {self.num_engines} {what}: {err}")


def _check_resource(name: str, count: int) -> None:
    """The cluster Ray joined has `count` units of custom resource `name` (the engine nodes'): else its actors would
    wait for it forever."""
    import ray

    have = ray.cluster_resources().get(name, 0)
    if have < count:
        raise ValueError(
            f"train.engine_resource: {name}: {count} engine actor(s) each ask Ray for one unit of it, and the cluster "
            f"has {have:g}; start the engine nodes with `ray start --resources='{{\"{name}\": <engines>}}'` "
            '(docs/scale-out.md, "Two nodes"), or set train.num_engines to what it has'
        )


class _Begun(NamedTuple):
    """The kind of the calls that run a batch's decode steps before its in-flight update: no message."""


def _merge(kind: type, key, values: list) -> Ready | Ack | Result:
    """One message from every engine's part of it, in engine (= prompt) order."""
    if kind is Ready:
        return Ready(max(v[0] for v in values))
    if kind is Ack:
        return Ack(key)
    generated = Generated.concat([Generated.from_wire(r.generated) for r in values])
    scoring, reload = max(r.scoring for r in values), max(r.reload for r in values)
    return Result(key, generated.to_wire(), scoring, min(r.idle for r in values), reload)
