"""The `rlhf` flow: the dvc.yaml pipeline with one trainer, recorded as a DVC experiment.

One run:
  1. a temporary clone of the project at HEAD (+ the checkout's uncommitted changes to tracked files, as
     `dvc exp run` would take them), sharing the project's DVC cache, so runs never touch the user's
     checkout nor each other;
  2. params.yaml there gets the run's parameters (profile, train.trainer, overrides) and is validated with
     rlhf.config before any stage runs (a bad config fails at once, without retries);
  3. every dvc.yaml stage, in dependency order, as a `stage` task (`dvc repro --single-item <stage>`);
     stages whose inputs are unchanged come back from DVC's run-cache instead of running;
  4. `dvc exp save --name <experiment>` there, and its ref fetched into the project: `dvc exp show` lists
     the run with its params and metrics; `dvc exp apply <experiment>` brings its outputs into the checkout;
  5. the clone is removed (its outputs stay in the shared DVC cache).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, get_args

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import flow_run

from rlhf.config import ConfigError, TrainConfig, load_config, parse_yaml
from tasks.stages import metrics_files, run_stage, stage_graph, stage_order

# The trainer names come from the config schema, the one place they are defined.
TRAINERS: tuple[str, ...] = get_args(TrainConfig.model_fields["trainer"].annotation)
Trainer = Literal[TRAINERS]  # type: ignore[valid-type]  # a dropdown in the Prefect UI


def project_dir() -> Path:
    """The project whose pipeline a run executes: $RLHF_PROJECT_DIR, else the current directory."""
    root = Path(os.environ.get("RLHF_PROJECT_DIR") or os.getcwd()).resolve()
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        raise FileNotFoundError(f"{root}: not a DVC project (no dvc.yaml or .dvc/); set RLHF_PROJECT_DIR")
    return root


def _run(cmd: list[str], cwd: Path, stdin: bytes | None = None) -> str:
    """Run a git/dvc command; on failure raise with its output (these are setup steps, not stages)."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace").strip()
        raise RuntimeError(f"`{' '.join(cmd)}` failed in {cwd} (exit {proc.returncode}):\n{out}")
    return proc.stdout.decode(errors="replace")


def experiment_name(trainer: str, run_name: str | None) -> str:
    """`<trainer>-<flow run name>` with only characters a git ref accepts (e.g. `ppo-crimson-fox`)."""
    name = f"{trainer.replace('_', '-')}-{run_name or 'run'}"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")


def existing_experiments(project: Path) -> set[str]:
    """Names of the DVC experiments in the project (refs/exps/<baseline>/<name>)."""
    refs = _run(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], project).split()
    return {r.rsplit("/", 1)[-1] for r in refs if not r.startswith("refs/exps/exec/")}


def set_params(params_path: Path, profile: str | None, trainer: str, overrides: list[str]) -> None:
    """Write the run's parameters into params.yaml (comments kept), as `dvc exp run -S` would.

    `profile` sets the top-level `profile`; `trainer` sets `train.trainer`; each override `a.b=v` sets
    that key (v parsed as YAML, like `rlhf ... a.b=v`).
    """
    from dvc.utils.serialize import modify_yaml  # comment-preserving round trip, as DVC's own -S uses

    items = [*([f"profile={profile}"] if profile else []), f"train.trainer={trainer}", *overrides]
    with modify_yaml(params_path) as params:
        for item in items:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.k=4)")
            key, value = item.split("=", 1)
            *parents, leaf = key.strip().split(".")
            node = params
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[leaf] = parse_yaml(value, f"override {key}") if value != "" else None


@contextmanager
def workspace(project: Path, name: str) -> Iterator[Path]:
    """A temporary clone of `project` at HEAD plus its uncommitted tracked changes, DVC cache shared.

    A clone (objects borrowed with --shared), not a worktree: its refs are its own, so DVC's
    refs/exps/exec/* bookkeeping during `dvc exp save` can't collide with a `dvc exp run` in the
    checkout; only the finished experiment's ref is fetched back (save_experiment).
    """
    parent = os.environ.get("RLHF_WORKSPACES")  # default: the system's temp folder
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"rlhf-{name}-", dir=parent))
    ws = root / "repo"
    try:
        head = _run(["git", "rev-parse", "HEAD"], project).strip()
        cache_dir = _run(["dvc", "cache", "dir"], project).strip()
        _run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(project), str(ws)], root)
        _run(["git", "checkout", "--quiet", "--detach", head], ws)
        for key in ("user.name", "user.email"):  # the experiment commit's author: the user's identity
            value = subprocess.run(["git", "config", key], cwd=project, capture_output=True, text=True).stdout.strip()
            if value:
                _run(["git", "config", key, value], ws)
        diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=project, capture_output=True, check=True).stdout
        if diff.strip():
            _run(["git", "apply", "--whitespace=nowarn"], ws, stdin=diff)
        _run(["dvc", "config", "--local", "cache.dir", cache_dir], ws)
        yield ws
    finally:
        shutil.rmtree(root, ignore_errors=True)


@task(name="dvc exp save", task_run_name="dvc exp save", cache_policy=NONE)
def save_experiment(project: str, ws: str, name: str, stages: list[str]) -> str:
    """`dvc exp save` the workspace as experiment `name` and fetch its ref into the project.

    dvc.lock and the metrics/plots files go in: they are `cache: false` outputs that git ignores, and `-I`
    puts them in the experiment commit so `dvc exp show` / `dvc plots diff` can read them. Returns the ref.
    """
    ws_path = Path(ws)
    files = ["dvc.lock", *(f for s in stages for f in metrics_files(ws_path / "dvc.yaml", s))]
    files += [str(p.relative_to(ws_path)) for p in sorted((ws_path / "data" / "plots").glob("*.csv"))]
    includes = [arg for f in dict.fromkeys(files) if (ws_path / f).exists() for arg in ("-I", f)]
    out = _run(["dvc", "exp", "save", "--name", name, *includes], ws_path)
    refs = _run(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], ws_path).split()
    ref = next(r for r in refs if r.endswith(f"/{name}") and not r.startswith("refs/exps/exec/"))
    # Fetching creates the ref (refusing to overwrite an existing one) and copies the commit's objects.
    _run(["git", "fetch", "--quiet", "--no-tags", str(ws_path), f"{ref}:{ref}"], Path(project))
    get_run_logger().info("%s (%s)", out.strip(), ref)
    return ref


@flow(name="rlhf", description="The dvc.yaml pipeline with one trainer, saved as a DVC experiment.")
def rlhf(trainer: Trainer = "online_dpo", profile: str | None = None, overrides: list[str] | None = None, experiment: str | None = None) -> dict:
    """Run every dvc.yaml stage for `trainer` and save the run as DVC experiment `experiment`.

    trainer: train.trainer preset. profile: params.yaml profile (None = the file's `profile`).
    overrides: `section.key=value` items (e.g. ["train.k=4"]). experiment: name in `dvc exp show`
    (default `<trainer>-<flow run name>`).
    Returns {"experiment": name, "metrics": {metrics file: values}}.
    """
    logger = get_run_logger()
    project = project_dir()
    name = experiment or experiment_name(trainer, flow_run.get_name())
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name) or name.endswith((".", ".lock")):
        raise ValueError(f"experiment name {name!r}: use letters, digits, '.', '_' and '-' (it becomes a git ref)")
    if name in existing_experiments(project):
        raise ValueError(f"experiment {name!r} already exists in {project}; pick another `experiment` name")
    with workspace(project, name) as ws:
        set_params(ws / "params.yaml", profile, trainer, list(overrides or []))
        cfg = load_config(ws / "params.yaml")  # a bad parameter fails here, before any stage (no retry)
        graph = stage_graph(ws / "dvc.yaml")  # the run's dvc.yaml: HEAD plus the checkout's edits
        stages = stage_order(graph)
        logger.info("experiment %s of %s in %s: profile %s, trainer %s, stages %s", name, project, ws, cfg.profile, cfg.train.trainer, " -> ".join(stages))
        futures, metrics = {}, {}
        for stage in stages:
            futures[stage] = run_stage.submit(stage, str(ws), wait_for=[futures[u] for u in graph[stage]])
            metrics.update(futures[stage].result())  # one stage at a time: the stages share the machine
        save_experiment(str(project), str(ws), name, stages)
    logger.info("saved DVC experiment %s: `dvc exp show` lists it, `dvc exp apply %s` checks it out", name, name)
    return {"experiment": name, "metrics": metrics}
