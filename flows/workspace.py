"""A run's own copy of the project: a git clone at HEAD plus the checkout's uncommitted tracked changes (as
`dvc exp run` would take them), with its params.yaml set for the run. Used by the flow and the benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf.config import parse_override


def run_tool(cmd: list[str], cwd: Path, stdin: bytes | None = None) -> str:
    """Run a git/dvc command with this environment's tools first on PATH; on failure raise with its output."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, input=stdin, capture_output=True)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr).decode(errors="replace").strip()
        raise RuntimeError(f"`{' '.join(cmd)}` failed in {cwd} (exit {proc.returncode}):\n{out}")
    return proc.stdout.decode(errors="replace")


# The author of a run's experiment commit where the project's git has none (a fresh machine, a container, a Prefect
# worker): without one `dvc exp save` failed the run at its end, after every stage had run.
NO_IDENTITY = {"user.name": "rlhf flow", "user.email": "rlhf-flow@localhost"}


def clone_at_head(project: Path, dest: Path) -> Path:
    """`dest`: a clone of `project` at HEAD (objects borrowed with --shared) plus its uncommitted changes to
    tracked files, commits authored as the project's git user (NO_IDENTITY where it has none). A clone, not a
    worktree: its refs are its own."""
    head = run_tool(["git", "rev-parse", "HEAD"], project).strip()
    run_tool(["git", "clone", "--quiet", "--shared", "--no-checkout", str(project), str(dest)], dest.parent)
    run_tool(["git", "checkout", "--quiet", "--detach", head], dest)
    for key, fallback in NO_IDENTITY.items():
        value = subprocess.run(["git", "config", key], cwd=project, capture_output=True, text=True).stdout.strip()
        run_tool(["git", "config", key, value or fallback], dest)
    diff = subprocess.run(["git", "diff", "--binary", "HEAD"], cwd=project, capture_output=True, check=True).stdout
    if diff.strip():
        run_tool(["git", "apply", "--whitespace=nowarn"], dest, stdin=diff)
    return dest


def set_params(params_path: Path, items: list[str]) -> None:
    """Write `key=value` items (rlhf.config.parse_override, e.g. profile=ci, train.k=4) into params.yaml,
    comments kept, as `dvc exp run -S` would."""
    from dvc.utils.serialize import modify_yaml  # comment-preserving round trip, as DVC's own -S uses

    with modify_yaml(params_path) as params:
        for item in items:
            (*parents, leaf), value = parse_override(item)
            node = params
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[leaf] = value
