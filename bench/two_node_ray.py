"""A two-node Ray cluster on this one machine, and the learner run on it with its engines on the other node
(issue 59 item 3; docs/scale-out.md, "Two nodes").

Usage:
    .venv/bin/python -m rlhf.runtime python bench/two_node_ray.py up [--dir .cache/ray-2n]
    .venv/bin/python -m rlhf.runtime python bench/two_node_ray.py down [--dir .cache/ray-2n]
    .venv/bin/python -m rlhf.runtime python bench/two_node_ray.py demo [--dir .cache/ray-2n]

`up` starts two real `ray start --block` processes: a head node (1 CPU, the learner's node) and a worker node (1
CPU, the custom resource `engine`), each a raylet with its own object store, temp dir and ports, both on 127.0.0.1,
and prints the environment a learner joins with (RAY_ADDRESS and the cluster's auth token file). `down` stops those
two nodes only (`ray stop` would stop every Ray process of the machine, other people's too). `demo` runs the checks
of docs/scale-out.md ("What was run here") on the `ci` profile and prints the figures.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "engine"  # the custom resource that marks the engine node (train.engine_resource)
GRACE = 5  # seconds a stopping node may drain before it is killed (Ray's own drain waits up to 30 s)
START_TIMEOUT = 120  # seconds a node may take to start on a loaded 2-core box
NODE_FLAGS = ["--node-ip-address=127.0.0.1", "--disable-usage-stats", "--block"]  # --block: the node's lifetime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cluster_env(folder: Path) -> dict[str, str]:
    """What every process of the cluster and the learner joining it need: the project's code first on the path
    (Ray's workers import the engine from it), and the cluster's own auth token (Ray 2.60 turns token auth on and
    would otherwise read or write ~/.ray/auth_token)."""
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(folder / "auth_token"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # loopback stays loopback (see LOOPBACK_WORKER_START)
    }


# `ray start --address=...` as Ray's own CLI, less one refusal. Ray keeps 127.0.0.1 as a node's address only with
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (else it swaps a loopback address for the host's routable IP, binds there and
# dials the head there), and with the flag off it refuses to start a worker node: the CLI process turns the flag on
# for itself and keeps loopback as given (resolve_ip_for_localhost: the swap); the node's processes see it off.
LOOPBACK_WORKER_START = """
import sys
import ray._private.ray_constants as constants
import ray._private.services as services
from ray.scripts.scripts import main
constants.ENABLE_RAY_CLUSTER = True
services.resolve_ip_for_localhost = lambda host: host
sys.argv[0] = "ray"
main()
"""


class TwoNodes:
    """The head node and the engine node, each a `ray start --block` in a session of its own, so that stopping (or
    killing) a node is signalling its session: the raylet, its object store, workers and agents with it."""

    def __init__(self, folder: Path, engine_cpus: int = 1):
        self.folder = folder.resolve()
        self.engine_cpus = engine_cpus
        self.address: str | None = None
        self.nodes: dict[str, subprocess.Popen] = {}  # "head", "engine" -> its `ray start --block`
        self.node_ids: dict[str, str] = {}

    def env(self) -> dict[str, str]:
        """The learner's environment: join this cluster (rlhf keeps its loopback address as it is)."""
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        joined = {k: v for k, v in cluster_env(self.folder).items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        return {**env, **joined, "RAY_ADDRESS": self.address}

    def start(self) -> TwoNodes:
        """Start the head node, then the engine node; returns once both are in the cluster."""
        self.folder.mkdir(parents=True, exist_ok=True)
        token = self.folder / "auth_token"
        if not token.exists():
            token.write_text(secrets.token_hex(32))
            token.chmod(0o600)
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        # Ports of its own for Ray's client server, dashboard and dashboard agent: their defaults (10001, 8265,
        # 52365) may be another cluster's on this machine, and the agent's is the engine node's too.
        head = [
            *("--head", f"--port={port}", "--num-cpus=1", "--include-dashboard=false"),
            *(f"--ray-client-server-port={free_port()}", f"--dashboard-port={free_port()}"),
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.folder / 'head'}",
        ]
        self._start("head", [str(Path(sys.executable).parent / "ray"), "start", *head, *NODE_FLAGS])
        try:
            self.start_engine_node()
        except BaseException:  # a half-made cluster is stopped: nothing else would
            self.stop()
            raise
        return self

    def start_engine_node(self) -> str:
        """Start the engine node (again, after a kill: a new node); returns once it is in the cluster, its node id."""
        # Its own temp dir and dashboard agent port; Ray picks its raylet's and object manager's ports.
        engine = [
            f"--address={self.address}",
            f"--num-cpus={self.engine_cpus}",
            f"--resources={json.dumps({RESOURCE: self.engine_cpus})}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--temp-dir={self.folder / 'engine'}",
        ]
        old = self.node_ids.get("engine")
        if "engine" in self.nodes and self.nodes["engine"].poll() is None:
            raise RuntimeError("the engine node is still running: kill it first")
        self._start("engine", [sys.executable, "-c", LOOPBACK_WORKER_START, "start", *engine, *NODE_FLAGS])
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            for name, proc in self.nodes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"Ray's {name} node exited ({proc.returncode}): {self.folder / name}.log")
            ids = {name: self._node_id(name) for name in self.nodes}
            if ids["head"] and ids["engine"] not in (None, old) and set(ids.values()) <= set(self.active_nodes()):
                self.node_ids = ids
                return ids["engine"]
            time.sleep(1)
        raise TimeoutError(f"the two Ray nodes did not come up within {START_TIMEOUT} s: {self.folder}/*.log")

    def _node_id(self, name: str) -> str | None:
        """Node `name`'s id as its newest raylet logged it (None until one has): a node started again in the same
        temp dir logs to raylet.1.out, and so on."""
        logs = sorted((self.folder / name).glob("session_latest/logs/raylet*.out"), key=lambda p: p.stat().st_mtime)
        found = re.search(r"Setting node ID node_id=([0-9a-f]+)", logs[-1].read_text()) if logs else None
        return found and found[1]

    def active_nodes(self) -> list[str]:
        """The ids of the cluster's live nodes (`ray status`'s "Active:" list)."""
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **cluster_env(self.folder)}
        ray = str(Path(sys.executable).parent / "ray")
        status = subprocess.run([ray, "status", f"--address={self.address}"], env=env, capture_output=True, text=True)
        active = status.stdout.partition("Active:")[2].partition("Pending:")[0]
        return re.findall(r"node_([0-9a-f]+)", active) if status.returncode == 0 else []

    def _start(self, name: str, command: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        with open(self.folder / f"{name}.log", "w") as log:
            self.nodes[name] = subprocess.Popen(
                command, env={**env, **cluster_env(self.folder)}, stdout=log, stderr=log, start_new_session=True
            )

    def kill(self, name: str) -> float:
        """SIGKILL node `name`'s every process (a lost machine); the time.monotonic() it was sent."""
        sent = time.monotonic()
        _signal_session(self.nodes[name].pid, signal.SIGKILL)
        return sent

    def stop(self) -> None:
        """Both nodes' every process, SIGTERM then (after GRACE seconds) SIGKILL; returns once none is left."""
        stop_sessions([p.pid for p in self.nodes.values()])
        for proc in self.nodes.values():
            proc.wait()

    def __enter__(self) -> TwoNodes:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_sessions(leaders) -> None:
    """Every process of the sessions `leaders` lead, SIGTERM then (after GRACE seconds) SIGKILL; returns once none
    is left."""
    for sid in leaders:
        _signal_session(sid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline and any(_session(sid) for sid in leaders):
        time.sleep(0.2)
    for sid in leaders:
        _signal_session(sid, signal.SIGKILL)
    while any(_session(sid) for sid in leaders):
        time.sleep(0.1)


def _signal_session(sid: int, sig: int) -> None:
    """Signal every process of session `sid` (a node's `ray start` leads one: Ray's workers put themselves in process
    groups of their own, so the node's process group would miss them)."""
    for pid in _session(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _session(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies, dead already and reaped by whoever adopted them, left out)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


# --- the learner on the cluster --------------------------------------------------------------------------------------

EPISODES = 48  # 6 batches of 8 prompts on `ci`
TRAIN = ["--trainer", "online_dpo_vllm", "tracking.wandb_mode=disabled", "train.save_every=1"]
ON_ENGINE_NODE = ["train.engine_backend=ray", f"train.engine_resource={RESOURCE}"]


def ci_data(folder: Path) -> Path:
    """prepare -> gold -> sft -> reward on the `ci` profile in folder/ci-data, once (the train stage's inputs)."""
    from rlhf.config import load_config
    from rlhf.stages import gold, prepare, reward, sft

    data = folder / "ci-data"
    if not (data / "reward").exists():
        cfg = load_config(ROOT / "params.yaml", "ci", [f"data_dir={data}", "tracking.wandb_mode=disabled"])
        for stage in (prepare, gold, sft, reward):
            stage.run(cfg)
    return data


def train(data: Path, env: dict, log: Path, crash: str | None = None, extra: tuple = ()) -> subprocess.Popen:
    """`rlhf train` (online DPO, one async vLLM engine as a Ray actor on the engine node) on `data`, started; its
    output in `log`; crash: RLHF_CRASH_AT (rlhf.runtime.crash_point: the learner SIGKILLs itself there); extra:
    more settings (the last of a key wins)."""
    env = {k: v for k, v in env.items() if k != "RLHF_CRASH_AT"} | ({"RLHF_CRASH_AT": crash} if crash else {})
    cli = ["--params", str(ROOT / "params.yaml"), "--profile", "ci", "train", *TRAIN, *ON_ENGINE_NODE]
    cmd = [sys.executable, "-m", "rlhf.cli", *cli, f"data_dir={data}", f"train.total_episodes={EPISODES}", *extra]
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def results(data: Path) -> dict:
    """What a run produced except wall-clock figures: its metrics, rows, and the digests of the policy's weights
    and of the policies kept for the frontier (tests/test_resume.py compares the same)."""
    policies = [data / "train" / "policy", *sorted((data / "train" / "frontier").iterdir())]
    return {
        "metrics": (data / "metrics" / "train.json").read_text(),
        "rows": (data / "plots" / "train.csv").read_text(),
        **{p.name: hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest() for p in policies},
    }


def placed(log: str) -> tuple[str, str]:
    """(the engine actor's node id, the learner's), 12 hex digits each, from the run's placement line."""
    found = re.search(r"actor 0 on node 127\.0\.0\.1 ([0-9a-f]{12}), pid \d+; the learner on node ([0-9a-f]{12})", log)
    if found is None:
        raise AssertionError(f"no placement line in the run's output: {log[-3000:]}")
    return found[1], found[2]


def wait_for(path_glob: str, folder: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until a file matching `path_glob` exists under `folder` (while `proc` runs)."""
    deadline = time.monotonic() + timeout
    while not any(folder.glob(path_glob)):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{path_glob} never appeared under {folder} (run ended: {proc.returncode})")
        time.sleep(0.05)


def demo(folder: Path) -> dict:
    """The checks of docs/scale-out.md's "What was run here" on the `ci` profile, with their figures."""
    data = ci_data(folder)
    runs = {name: folder / name for name in ("first", "replay", "learner-killed", "node-killed")}
    for run in runs.values():
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(data, run)
    figures: dict = {}
    started = time.monotonic()
    with TwoNodes(folder / "c") as nodes:  # short: Ray's socket paths under it must stay < 108 characters
        figures["cluster_start_s"] = round(time.monotonic() - started, 1)
        figures["nodes"] = dict(nodes.node_ids)

        def finish(name: str, **kw) -> tuple[int, str, float]:
            start = time.monotonic()
            proc = train(runs[name], nodes.env(), folder / f"{name}.log", **kw)
            return proc.wait(), (folder / f"{name}.log").read_text(), time.monotonic() - start

        for name in ("first", "replay"):
            rc, log, seconds = finish(name)
            assert rc == 0, log[-3000:]
            engine, learner = placed(log)
            assert (engine, learner) == (nodes.node_ids["engine"][:12], nodes.node_ids["head"][:12]), (engine, learner)
            [sync] = [line for line in log.splitlines() if "weight syncs of" in line]
            figures[name] = {"seconds": round(seconds, 1), "engine_node": engine, "learner_node": learner, "sync": sync}
        figures["replay_identical"] = results(runs["replay"]) == results(runs["first"])

        # the learner SIGKILLed while writing the checkpoint after batch 3, then run again: resumes from batch 2's
        rc, log, _ = finish("learner-killed", crash="checkpoint_write:3")
        assert rc == -signal.SIGKILL, log[-3000:]
        rc, log, _ = finish("learner-killed")
        assert rc == 0 and "resumed from" in log, log[-3000:]
        figures["learner_killed_resume_identical"] = results(runs["learner-killed"]) == results(runs["first"])

        # the engine node SIGKILLed (every process of it) once batch 2's checkpoint is written
        log_path = folder / "node-killed.log"
        proc = train(runs["node-killed"], nodes.env(), log_path)
        wait_for("checkpoints/*/batch-000002", runs["node-killed"], proc)
        killed = nodes.kill("engine")
        rc = proc.wait()
        errors = [line for line in log_path.read_text().splitlines() if line.startswith("rlhf train: error:")]
        figures["node_killed"] = {"rc": rc, "stopped_after_s": round(time.monotonic() - killed, 2), "errors": errors}
        started = time.monotonic()
        figures["node_killed"]["new_engine_node"] = nodes.start_engine_node()
        figures["node_killed"]["node_restart_s"] = round(time.monotonic() - started, 1)
        rc, log, _ = finish("node-killed")
        assert rc == 0 and "resumed from" in log, log[-3000:]
        figures["node_killed_resume_identical"] = results(runs["node-killed"]) == results(runs["first"])
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="two_node_ray.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "demo"])
    parser.add_argument("--dir", type=Path, default=ROOT / ".cache" / "ray-2n", help="the cluster's files")
    args = parser.parse_args()
    folder = args.dir.resolve()
    if args.command == "up":
        nodes = TwoNodes(folder).start()  # its `ray start --block` processes outlive this one
        (folder / "nodes.json").write_text(json.dumps({name: p.pid for name, p in nodes.nodes.items()}))
        # the learner needs the first four; Ray's own CLI (`ray status`) the last too, to keep loopback as it is
        env = {**nodes.env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        for key in (
            "RAY_ADDRESS",
            "RAY_AUTH_MODE",
            "RAY_AUTH_TOKEN_PATH",
            "PYTHONPATH",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
        ):
            print(f"export {key}={env[key]}")
    elif args.command == "down":
        leaders = json.loads((folder / "nodes.json").read_text()).values()
        stop_sessions(leaders)
        (folder / "nodes.json").unlink()
    else:
        figures = demo(folder)
        (folder / "demo.json").write_text(json.dumps(figures, indent=1))
        print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
