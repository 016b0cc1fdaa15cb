"""The `rlhf` flow: the dvc.yaml pipeline with one trainer, recorded as a DVC experiment.

One run:
  1. a temporary clone of the project at HEAD (+ the checkout's uncommitted changes to tracked files, as
     `dvc exp run` would take them), sharing the project's DVC cache, so runs never touch the user's
     checkout nor each other;
  2. params.yaml there gets the run's parameters (profile, train.trainer, overrides) and is validated with
     rlhf.config before any stage runs (a bad config fails at once, without retries);
  3. every dvc.yaml stage, in dependency order, as a `stage` task (`dvc repro --single-item <stage>`);
     the clone first checks out the outputs dvc.lock records from the shared cache, so a stage whose inputs
     are unchanged is skipped instead of run again; the last, `report`, writes data/report/index.html;
  4. `dvc exp save --name <experiment>` there, and its ref fetched into the project:
     `dvc exp show` lists the run with its params and metrics, `dvc exp diff` compares it;
  5. where the project has a default DVC remote (`dvc remote add -d`), `dvc exp push origin <experiment>` from the
     project: the experiment's commit to the git remote, its cached outputs to the DVC remote, so another clone
     gets both with `dvc exp pull`; a failed push is one warning, the run still succeeds with its results saved;
  6. the run's results as Prefect artifacts, visible in the UI beside its task states: the headline metrics and
     the win-rate vs KL frontier as tables, a link to a copy of the report (.cache/reports/<experiment>/), every
     metric;
  7. the clone is removed (its outputs stay in the shared DVC cache).
"""

from __future__ import annotations

import csv
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NONE
from prefect.runtime import flow_run

from flows.workspace import clone_at_head, run_tool, set_params
from rlhf.config import flatten, load_config, profile_note
from rlhf.presets import PRESETS
from rlhf.stages.report import named_metrics
from tasks.stages import Pipeline, run_stage

REPORT = "data/report/index.html"  # written by the report stage (rlhf/stages/report.py)
EVAL_METRICS = "data/metrics/eval.json"  # the headline results (dvc.yaml's one metrics file)
# The git remote a run's experiment goes to: the one `git clone` names, where the other clones fetch from. Whether it
# goes at all is the project's DVC setting: a default DVC remote (see default_remote).
GIT_REMOTE = "origin"
TRAINERS: tuple[str, ...] = tuple(PRESETS)
Trainer = Literal[TRAINERS]  # type: ignore[valid-type]  # a dropdown in the Prefect UI


def project_dir() -> Path:
    """The project whose pipeline a run executes: $RLHF_PROJECT_DIR, else the current directory."""
    root = Path(os.environ.get("RLHF_PROJECT_DIR") or os.getcwd()).resolve()
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        raise FileNotFoundError(f"{root}: not a DVC project (no dvc.yaml or .dvc/); set RLHF_PROJECT_DIR")
    return root


def experiment_name(run_name: str | None, taken: set[str]) -> str:
    """The flow run's name (e.g. `crimson-fox`) with only characters a git ref accepts, `-2`, `-3`, ... added when
    `taken` has it: the same name in the Prefect UI and in `dvc exp show`. The trainer has its own column there;
    as a prefix it made names of up to 49 characters, past a 120-column `dvc exp show` (Prefect's run names have
    at most 26)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", run_name or "run").strip("-.") or "run"
    return next(n for n in (name, *(f"{name}-{i}" for i in range(2, len(taken) + 3))) if n not in taken)


def existing_experiments(project: Path) -> set[str]:
    """Names of the DVC experiments in the project (refs/exps/<baseline>/<name>)."""
    refs = run_tool(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], project).split()
    return {r.rsplit("/", 1)[-1] for r in refs if not r.startswith("refs/exps/exec/")}


@contextmanager
def workspace(project: Path, name: str) -> Iterator[Path]:
    """A temporary clone of `project` at HEAD plus its uncommitted tracked changes, DVC cache shared, with the
    outputs its dvc.lock records checked out of that cache.

    A clone (objects borrowed with --shared), not a worktree: its refs are its own, so DVC's
    refs/exps/exec/* bookkeeping during `dvc exp save` can't collide with a `dvc exp run` in the
    checkout; only the finished experiment's ref is fetched back (save_experiment). The checkout is what lets a
    stage whose inputs did not change be skipped (`didn't change, skipping`): without its outputs DVC ran every
    stage again, and its run-cache cannot stand in (it skips stages with `persist` outputs, as all of ours are).
    An output missing from the cache is left out (--allow-missing): its stage runs.
    """
    parent = os.environ.get("RLHF_WORKSPACES")  # default: the system's temp folder
    if parent:
        Path(parent).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"rlhf-{name}-", dir=parent))
    try:
        ws = clone_at_head(project, root / "repo")
        cache_dir = run_tool(["dvc", "cache", "dir"], project).strip()
        run_tool(["dvc", "config", "--local", "cache.dir", cache_dir], ws)
        run_tool(["dvc", "checkout", "--allow-missing", "--quiet"], ws)
        yield ws
    finally:
        shutil.rmtree(root, ignore_errors=True)


@task(name="artifacts", task_run_name="artifacts", cache_policy=NONE)
def publish_artifacts(project: str, ws: str, name: str, metrics: dict[str, dict]) -> None:
    """The run's results as Prefect artifacts, in the order the UI lists them: the headline eval metrics (rounded,
    each with its meaning), the frontier, the report (a copy kept outside any checkout, linked), every metric.
    After `dvc exp save`: they need the API server, the experiment does not."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    cfg = load_config(Path(ws) / "params.yaml")
    note = f" ({plumbing})" if (plumbing := profile_note(cfg.profile)) else ""
    headline = headline_table(metrics.get(EVAL_METRICS, {}))
    what = f"experiment {name}: profile {cfg.profile}, trainer {cfg.train.trainer}{note}"
    create_table_artifact(headline, key="rlhf-headline", description=f"{what}: the headline results")
    if (frontier := Path(ws) / "data" / "plots" / "frontier.csv").exists():
        with open(frontier, newline="") as f:
            points = [{k: _rounded(v) for k, v in row.items()} for row in csv.DictReader(f)]
        create_table_artifact(points, key="rlhf-frontier", description=f"{what}: win-rate vs KL, in training order")
    create_markdown_artifact(_report_note(Path(project), Path(ws), name, plumbing), key="rlhf-report", description=what)
    rows = [
        {"file": f, "metric": k, "value": _rounded(v)} for f, vals in metrics.items() for k, v in flatten(vals).items()
    ]
    create_table_artifact(rows, key="rlhf-metrics", description=f"{what}: every metric")


def headline_table(eval_metrics: dict) -> list[dict[str, str]]:
    """The headline artifact's rows: eval.json's headline metrics, readable names, 3 significant digits, units."""
    rows = named_metrics("eval", eval_metrics)
    return [{"metric": m, "value": v, "unit": unit, "meaning": meaning} for m, v, unit, meaning in rows]


def _report_note(project: Path, ws: Path, name: str, plumbing: str | None) -> str:
    """Markdown: a link to a copy of the run's report under the project's .cache/reports/<experiment>/ (opening it
    touches no checkout), and how to compare runs without changing the workspace."""
    text = f"### Experiment `{name}`\n\n"
    if plumbing:
        text += f"**{plumbing}.**\n\n"
    if (ws / REPORT).exists():
        copy = project / ".cache" / "reports" / name / "index.html"
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ws / REPORT, copy)
        text += (
            f"The report (header, headline metrics, the frontier, reward/gold/KL over episodes, step time by phase): "
            f"[{copy}]({copy.as_uri()}) (a browser may refuse a file link from a web page: paste the path into its "
            f"address bar). It is also saved in the experiment as `{REPORT}`.\n\n"
        )
    return text + (
        f"Compare runs in the project without touching its workspace: `dvc exp show`, `dvc exp diff {name}`, "
        f"`dvc plots diff {name}`."
    )


def _rounded(value):
    """Numbers to 3 significant digits (CSV cells are strings: converted first), anything else as it is."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    return int(number) if number.is_integer() and abs(number) < 1e15 else float(f"{number:.3g}")


@task(name="dvc exp save", task_run_name="dvc exp save", cache_policy=NONE)
def save_experiment(project: str, ws: str, name: str, metrics: list[str]) -> str:
    """`dvc exp save` the workspace as experiment `name` and fetch its ref into the project.

    dvc.lock, the metrics, every stage's data/metrics file (diagnostics: plain outs) and the plots files go in:
    `cache: false` outputs, which git would otherwise skip; `-I` puts them in the experiment commit so `dvc exp
    show` / `dvc plots diff` / `dvc exp apply` can read them. Returns the ref.
    """
    ws_path = Path(ws)
    files = ["dvc.lock", *metrics]
    files += [str(p.relative_to(ws_path)) for p in sorted((ws_path / "data" / "metrics").glob("*.json"))]
    files += [str(p.relative_to(ws_path)) for p in sorted((ws_path / "data" / "plots").glob("*.csv"))]
    includes = [arg for f in dict.fromkeys(files) if (ws_path / f).exists() for arg in ("-I", f)]
    out = run_tool(["dvc", "exp", "save", "--name", name, *includes], ws_path)
    refs = run_tool(["git", "for-each-ref", "--format=%(refname)", "refs/exps/"], ws_path).split()
    ref = next(r for r in refs if r.endswith(f"/{name}") and not r.startswith("refs/exps/exec/"))
    # Fetching creates the ref (refusing to overwrite an existing one) and copies the commit's objects.
    run_tool(["git", "fetch", "--quiet", "--no-tags", str(ws_path), f"{ref}:{ref}"], Path(project))
    get_run_logger().info("%s (%s)", out.strip(), ref)
    return ref


def default_remote(project: Path) -> tuple[str, str] | None:
    """The project's default DVC remote as (name, url), or None where none is set: a run's experiment is pushed only
    where one is. Read as `dvc push` reads it: .dvc/config, .dvc/config.local (credentials, a machine's own remote)
    and the user's and system's DVC config. (`dvc exp push` takes .dvc/config from the experiment's own commit: the
    checkout's, as the run began.)"""
    from dvc.config import Config

    config = Config(project / ".dvc")
    name = config["core"].get("remote")
    return (name, str(config["remote"].get(name, {}).get("url"))) if name else None


@task(name="dvc exp push", task_run_name="dvc exp push", cache_policy=NONE)
def push_experiment(project: str, name: str, remote: tuple[str, str]) -> bool:
    """`dvc exp push origin <name>` in the project (its git remotes, its DVC config, the run's outputs in its cache):
    the experiment's commit to git remote `origin`, then the outputs its dvc.lock records to DVC remote `remote`.

    A failure (a remote down, no credentials) is one warning line naming the remote and the cause, and False: the
    experiment stays saved in the project and the flow run succeeds; the same command there pushes it later. DVC
    pushes the git ref first, so a failed upload can leave the experiment listed on the git remote without its data
    until then.
    """
    cmd = ["dvc", "exp", "push", GIT_REMOTE, name]
    logger = get_run_logger()
    try:
        run_tool(cmd, Path(project))
    except RuntimeError as e:
        logger.warning(
            "experiment %s not pushed (git remote %r, DVC remote %r at %s): %s; it is saved in %s, where `%s` retries",
            name,
            GIT_REMOTE,
            *remote,
            dvc_error(str(e)),
            project,
            " ".join(cmd),
        )
        return False
    logger.info(
        "pushed experiment %s to git remote %r and its outputs to DVC remote %r (%s): another clone gets them with "
        "`dvc exp pull %s %s`",
        name,
        GIT_REMOTE,
        *remote,
        GIT_REMOTE,
        name,
    )
    return True


def dvc_error(output: str) -> str:
    """DVC's own one-line reason in a failed command's output (its `ERROR: ...` line), else the output's last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("ERROR: ")), lines[-1] if lines else "no output")
    return reason.removeprefix("ERROR: ").removeprefix("unexpected error - ")


@flow(name="rlhf", description="The dvc.yaml pipeline with one trainer, saved as a DVC experiment.")
def rlhf(
    trainer: Trainer = "online_dpo",
    profile: str | None = None,
    overrides: list[str] | None = None,
    experiment: str | None = None,
) -> dict:
    """Run every dvc.yaml stage for `trainer` and save the run as DVC experiment `experiment`, pushed to git remote
    `origin` and the default DVC remote where the project has one (push_experiment).

    trainer: train.trainer preset. profile: params.yaml profile (None = the file's `profile`).
    overrides: `section.key=value` items (e.g. ["train.k=4"]). experiment: name in `dvc exp show`
    (default: the flow run's name).
    Returns {"experiment": name, "metrics": {metrics file: values}}.
    """
    logger = get_run_logger()
    project = project_dir()
    taken = existing_experiments(project)
    name = experiment or experiment_name(flow_run.get_name(), taken)
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9._-]*", name) or name.endswith((".", ".lock")):
        raise ValueError(f"experiment name {name!r}: use letters, digits, '.', '_' and '-' (it becomes a git ref)")
    if name in taken:
        raise ValueError(f"experiment {name!r} already exists in {project}; pick another `experiment` name")
    with workspace(project, name) as ws:
        items = [*([f"profile={profile}"] if profile else []), f"train.trainer={trainer}", *(overrides or [])]
        set_params(ws / "params.yaml", items)
        cfg = load_config(ws / "params.yaml")  # a bad parameter fails here, before any stage (no retry)
        pipeline = Pipeline.read(ws)  # the run's dvc.yaml: HEAD plus the checkout's edits
        logger.info(
            "experiment %s of %s in %s: profile %s, trainer %s, stages %s",
            name,
            project,
            ws,
            cfg.profile,
            cfg.train.trainer,
            " -> ".join(pipeline.order),
        )
        futures, metrics = {}, {}
        for stage in pipeline.order:
            upstream = [futures[u] for u in pipeline.upstream[stage]]
            futures[stage] = run_stage.submit(stage, str(ws), pipeline.metrics[stage], wait_for=upstream)
            metrics.update(futures[stage].result())  # one stage at a time: the stages share the machine
        save_experiment(str(project), str(ws), name, [m for stage in pipeline.order for m in pipeline.metrics[stage]])
        if remote := default_remote(project):  # before the artifacts: a server gone mid-run costs those, not the push
            push_experiment(str(project), name, remote)
        publish_artifacts(str(project), str(ws), name, metrics)
    logger.info("saved DVC experiment %s: `dvc exp show` lists it, `dvc exp diff %s` compares it", name, name)
    return {"experiment": name, "metrics": metrics}
