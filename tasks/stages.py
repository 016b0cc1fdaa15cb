"""The pipeline's stages as Prefect tasks, derived from dvc.yaml (the one list of stages).

Each task runs `dvc repro --single-item <stage>` in a run's workspace: DVC decides whether the stage is
up to date (the workspace holds the outputs its dvc.lock records: flows/rlhf_flow.py's `workspace`), runs
`python -m rlhf.cli <stage>` if not, and records it in dvc.lock.
The command's output streams into the task's log, so the Prefect UI shows every stage's progress.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from rlhf import runtime

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


@dataclass(frozen=True)
class Pipeline:
    """The dvc.yaml stage graph as DVC itself reads it (its own parser and graph, not a copy of its rules)."""

    order: list[str]  # every stage once, each after the stages it depends on; ties keep dvc.yaml's order
    upstream: dict[str, list[str]]  # stage -> the stages whose outputs it depends on
    metrics: dict[str, list[str]]  # stage -> its metrics files, relative to the workspace

    @classmethod
    def read(cls, workspace: Path) -> Pipeline:
        import networkx as nx
        from dvc.repo import Repo

        with Repo(str(workspace)) as repo:
            graph = repo.index.graph  # an edge runs from a stage to a stage it depends on
            declared = [stage.name for stage in repo.index.stages]
            ordered = nx.lexicographical_topological_sort(graph.reverse(), key=lambda s: declared.index(s.name))
            order = [stage.name for stage in ordered]
            upstream = {s.name: sorted((u.name for u in graph.successors(s)), key=order.index) for s in graph}
            metrics = {s.name: [m.def_path for m in s.metrics] for s in graph}
        return cls(order, upstream, metrics)


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


# DVC's advice after each `dvc repro`, the same for every stage of every run: left out of the task logs. By prefix:
# the files `git add` names vary (dvc.lock alone, or with the .gitignore files a first run writes).
DVC_HINTS = (
    "To track the changes with git, run:",
    "git add ",
    "To enable auto staging, run:",
    "dvc config core.autostage true",
    "Use `dvc push` to send your updates to remote storage.",
)


def _stream(proc: subprocess.Popen, logger, keep: int = 40) -> str:
    """Log the command's output line by line, without DVC's hints; a progress bar (redrawn with \\r) logs only its
    last state. Read as bytes: a text stream would turn each \\r into a line of its own."""
    tail: deque[str] = deque(maxlen=keep)
    for raw in proc.stdout:
        redraws = [part.rstrip() for part in raw.decode(errors="replace").rstrip("\n").split("\r")]
        line = next((part for part in reversed(redraws) if part), "")
        if line and not line.strip().startswith(DVC_HINTS):
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
def run_stage(stage: str, workspace: str, metrics_files: list[str]) -> dict:
    """Run one dvc.yaml stage in `workspace` with `dvc repro --single-item`; return its metrics files' contents
    ({file: values}; `metrics_files` relative to the workspace, as Pipeline.metrics lists them)."""
    logger = get_run_logger()
    ws = Path(workspace)
    cmd = ["dvc", "repro", "--single-item", stage]
    logger.info("%s  (in %s)", " ".join(cmd), ws)
    # `dvc` and the `python` it runs come from this interpreter's environment, whatever PATH the worker had. The
    # stage runs the clone's code, with the project's caches (the clone is deleted after the run).
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    env = {**os.environ, "PATH": path, "TQDM_MININTERVAL": os.environ.get("TQDM_MININTERVAL", "10")}
    env.setdefault("RLHF_CACHE_DIR", str(runtime.CACHE))
    proc = subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tail = _stream(proc, logger)
    if proc.wait() != 0:
        status, transient = classify_failure(tail, proc.returncode)
        raise StageFailed(stage, status if status is not None else proc.returncode, transient, tail)
    metrics = {}
    for rel in metrics_files:
        path = ws / rel
        if path.exists():
            metrics[rel] = json.loads(path.read_text(encoding="utf-8"))
    return metrics
