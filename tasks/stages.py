"""The pipeline's stages as Prefect tasks, derived from dvc.yaml (the one list of stages).

Each task runs `dvc repro --single-item <stage>` in a run's workspace: DVC decides whether the stage is
up to date (or restores it from the shared run-cache), records it in dvc.lock, and runs `rlhf <stage>`.
The command's output streams into the task's log, so the Prefect UI shows every stage's progress.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path, PurePosixPath

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NONE

# Exit statuses of `rlhf <stage>` that mean "this input will fail again": 1 = a known error (bad config,
# missing file, bad value; rlhf/cli.py) or an uncaught exception, 2 = bad command line (argparse).
DETERMINISTIC_EXIT = {1, 2}
# DVC's own messages for a failure of the infrastructure rather than of the stage: worth another try.
TRANSIENT_DVC = ("Unable to acquire lock", "unable to acquire lock", "Resource temporarily unavailable")


class StageFailed(RuntimeError):
    """`dvc repro` of one stage failed; `transient` says whether a retry may succeed."""

    def __init__(self, stage: str, returncode: int | None, transient: bool, tail: str):
        kind = "transient" if transient else "deterministic"
        super().__init__(f"stage {stage!r} failed ({kind}, exit status {returncode}):\n{tail}")
        self.stage, self.returncode, self.transient = stage, returncode, transient


def _stages(dvc_yaml: Path) -> dict[str, dict]:
    raw = yaml.safe_load(Path(dvc_yaml).read_text(encoding="utf-8")) or {}
    stages = raw.get("stages")
    if not isinstance(stages, dict) or not stages:
        raise ValueError(f"{dvc_yaml}: no `stages:` mapping")
    return stages


def _paths(entries: list | None) -> list[PurePosixPath]:
    """dvc.yaml lists paths as strings or as one-key mappings {path: options}."""
    out = []
    for entry in entries or []:
        out.extend(PurePosixPath(p) for p in (entry if isinstance(entry, dict) else [entry]))
    return out


def _overlaps(a: PurePosixPath, b: PurePosixPath) -> bool:
    return a == b or a in b.parents or b in a.parents


def stage_graph(dvc_yaml: Path) -> dict[str, list[str]]:
    """stage -> the stages it depends on (an upstream out is one of its deps, or contains/is inside one).

    Keys keep dvc.yaml's order. Only deps/outs/metrics/plots are used, as DVC itself links stages.
    """
    stages = _stages(dvc_yaml)
    produced = {name: _paths(s.get("outs")) + _paths(s.get("metrics")) + _paths(s.get("plots")) for name, s in stages.items()}
    graph = {}
    for name, spec in stages.items():
        deps = _paths(spec.get("deps"))
        graph[name] = [up for up in stages if up != name and any(_overlaps(d, o) for d in deps for o in produced[up])]
    return graph


def stage_order(graph: dict[str, list[str]]) -> list[str]:
    """Topological order; among stages that are ready, dvc.yaml's order wins (stable, predictable)."""
    done: list[str] = []
    pending = list(graph)
    while pending:
        ready = [s for s in pending if all(u in done for u in graph[s])]
        if not ready:
            raise ValueError(f"dvc.yaml: dependency cycle among stages {', '.join(pending)}")
        done.append(ready[0])
        pending.remove(ready[0])
    return done


def metrics_files(dvc_yaml: Path, stage: str) -> list[str]:
    """The stage's metrics files (relative to the workspace), as dvc.yaml declares them."""
    return [str(p) for p in _paths(_stages(dvc_yaml)[stage].get("metrics"))]


def classify_failure(output: str, returncode: int) -> tuple[int | None, bool]:
    """(exit status of the stage's command, transient?) from `dvc repro`'s output and exit status.

    DVC exits 255 whatever the command did and reports "... exited with N". A command killed by a signal
    (negative N, 137 = SIGKILL by the OOM killer, 143 = SIGTERM) or a DVC lock conflict may pass on a
    retry; exit 1/2 (bad config, missing input, a bug) fails the same way again.
    """
    if any(m in output for m in TRANSIENT_DVC):
        return None, True
    found = re.findall(r"exited with (-?\d+)", output)
    if not found:
        # DVC failed before running the command (bad dvc.yaml, missing dep): deterministic.
        return None, returncode < 0
    status = int(found[-1])
    return status, status not in DETERMINISTIC_EXIT


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect retry condition: retry a stage only when its failure was transient."""
    try:
        state.result()
    except StageFailed as e:
        return e.transient
    except Exception:  # noqa: BLE001 - anything else (e.g. a bad workspace path) is not worth a retry
        return False
    return False


def _stream(proc: subprocess.Popen, logger, keep: int = 40) -> str:
    """Log the command's output line by line; progress bars (\\r updates) log only their last state."""
    tail: deque[str] = deque(maxlen=keep)
    for raw in proc.stdout:
        line = raw.rstrip("\n").split("\r")[-1].rstrip()
        if line:
            logger.info(line)
            tail.append(line)
    return "\n".join(tail)


@task(
    name="stage",
    task_run_name="{stage}",
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=retry_if_transient,
    cache_policy=NONE,  # DVC decides what is up to date; Prefect must not skip a stage on its own
)
def run_stage(stage: str, workspace: str) -> dict:
    """Run one dvc.yaml stage in `workspace` with `dvc repro --single-item`; return its metrics files' contents."""
    logger = get_run_logger()
    ws = Path(workspace)
    cmd = ["dvc", "repro", "--single-item", stage]
    logger.info("%s  (in %s)", " ".join(cmd), ws)
    # `dvc` and the `rlhf` it runs come from this interpreter's environment, whatever PATH the worker had.
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    env = {**os.environ, "PATH": path, "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "10")}
    proc = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    tail = _stream(proc, logger)
    if proc.wait() != 0:
        status, transient = classify_failure(tail, proc.returncode)
        raise StageFailed(stage, status if status is not None else proc.returncode, transient, tail)
    metrics = {}
    for rel in metrics_files(ws / "dvc.yaml", stage):
        path = ws / rel
        if path.exists():
            metrics[rel] = json.loads(path.read_text(encoding="utf-8"))
    return metrics
