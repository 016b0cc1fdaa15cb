"""Engines on another Ray node than the learner (docs/scale-out.md, "Two nodes"), on a two-node cluster made on this
machine by bench/two_node_ray.py: two real `ray start` processes, a head node the learner joins (RAY_ADDRESS) and an
engine node started with the custom resource `engine`, each a raylet with its own object store, both on 127.0.0.1.
The learner asks for it (train.engine_resource=engine), so its engine actor runs there and every weight version
crosses from the head's object store to the engine node's.

One test, three runs on `ci` (~85 s in all, ~10 s of it the cluster's start): the run the others are compared with;
one whose engine node is SIGKILLed (every process of it) mid-run, which must stop within seconds in one line naming
that node; the same run again once a new engine node joined, which must resume to the first run's results exactly.
Exact is also the replay check: the resumed run's batches before the kill were sampled and trained by another
process with another engine node, and still give the first run's weights.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import two_node_ray as two  # noqa: E402

pytestmark = pytest.mark.slow


def run(data: Path, nodes: two.TwoNodes, log: Path, extra: tuple = ()) -> tuple[int, str]:
    proc = two.train(data, nodes.env(), log, extra=extra)
    return proc.wait(timeout=600), log.read_text()


def test_engines_on_the_engine_node_stop_in_seconds_when_it_is_lost_and_resume_exactly(ci_data, tmp_path):
    killed = tmp_path / "killed"
    shutil.copytree(ci_data, killed)
    folder = Path(tempfile.mkdtemp(prefix="ray2n-"))  # short: Ray's socket paths under it must stay < 108 characters
    try:
        with two.TwoNodes(folder) as nodes:
            engine_node, learner_node = nodes.node_ids["engine"][:12], nodes.node_ids["head"][:12]
            assert engine_node != learner_node

            # a resource no node has: refused in one line before anything trains (its actors would wait forever)
            rc, out = run(killed, nodes, tmp_path / "none.log", extra=("train.engine_resource=gpu_engine",))
            assert rc == 1 and "Traceback" not in out, out[-3000:]
            [error] = [line for line in out.splitlines() if line.startswith("rlhf train: error:")]
            assert "train.engine_resource: gpu_engine: 1 engine actor(s) each ask Ray for one unit" in error, error
            assert not (killed / "train" / "policy").exists()

            rc, out = run(ci_data, nodes, tmp_path / "done.log")
            assert rc == 0, out[-3000:]
            assert two.placed(out) == (engine_node, learner_node)  # the actor on the engine node, not the learner's
            [sync] = [line for line in out.splitlines() if "weight syncs of" in line]
            figures = re.search(r"(\d+) weight syncs of ([\d.]+) MB .* each actor's fetch ([\d.]+) s", sync)
            assert figures and int(figures[1]) >= 5 and float(figures[2]) > 0 and float(figures[3]) > 0, sync

            proc = two.train(killed, nodes.env(), tmp_path / "killed.log")
            two.wait_for("checkpoints/*/batch-000002", killed, proc)  # batches 0-1 trained and saved, 4 to go
            sent = nodes.kill("engine")
            rc = proc.wait(timeout=120)
            stopped = time.monotonic() - sent
            out = (tmp_path / "killed.log").read_text()
            assert rc == 1 and stopped < 15 and "Traceback" not in out, (rc, stopped, out[-3000:])
            [error] = [line for line in out.splitlines() if line.startswith("rlhf train: error:")]
            assert f"vLLM engine actor 0 on node 127.0.0.1 {engine_node}, pid " in error, error
            print(f"\n{sync}\nthe engine node killed: the learner stopped {stopped:.2f} s later: {error}")

            new_node = nodes.start_engine_node()[:12]
            rc, out = run(killed, nodes, tmp_path / "resumed.log")
            assert rc == 0 and "resumed from" in out, out[-3000:]
            assert two.placed(out) == (new_node, learner_node)
            assert two.results(killed) == two.results(ci_data)
        assert not any(two._session(p.pid) for p in nodes.nodes.values())  # no process of either node is left
    finally:
        shutil.rmtree(folder, ignore_errors=True)
