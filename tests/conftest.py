import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf import runtime  # noqa: E402

runtime.configure()

import pytest  # noqa: E402

from rlhf.config import load_config  # noqa: E402

PARAMS = ROOT / "params.yaml"
BIN = Path(sys.executable).parent  # the venv's `dvc`, `prefect`, `rlhf`, whatever PATH the runner has


def ci_config(data_dir, *overrides):
    """The `ci` profile of the real params.yaml, writing under `data_dir`, W&B off unless asked."""
    return load_config(PARAMS, "ci", [f"data_dir={data_dir}", "tracking.wandb_mode=disabled", *overrides])


def run_cli(*args, params=PARAMS, timeout=120, env=None):
    """`rlhf --params PARAMS ARGS...` in a fresh process, as a user runs it: exit status and stderr are the interface."""
    cmd = [sys.executable, "-m", "rlhf.cli", "--params", str(params), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def folder_digest(folder: Path) -> str:
    """sha256 over every file's relative path and bytes."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(home: Path) -> dict:
    """The suite's offline env with every cache of the run under `home` (never the project's .cache)."""
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(home / "prefect"),
            "WANDB_DIR": str(home / "wandb"), "RLHF_WORKSPACES": str(home / "workspaces"), "DVC_NO_ANALYTICS": "1"}


def run_ok(cmd: list[str], cwd: Path, env: dict, timeout: float = 60) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def make_dvc_repo(path: Path) -> Path:
    """A git+DVC copy of the project's pipeline: dvc.yaml, params.yaml and the `rlhf` code its stages depend on."""
    path.mkdir(parents=True)
    for name in ("dvc.yaml", "params.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(ROOT / name, path / name)
    # The stages' code is a DVC dep of theirs (the stages run the installed `rlhf`, this same code).
    shutil.copytree(ROOT / "rlhf", path / "rlhf", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for cmd in (["git", "init", "-q", "-b", "main"], ["git", "config", "user.name", "rlhf test"], ["git", "config", "user.email", "test@localhost"],
                ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"], ["git", "add", "-A"], ["git", "commit", "-qm", "pipeline"]):
        run_ok(cmd, path, env)
    return path


@pytest.fixture(scope="session")
def ci_stages(tmp_path_factory):
    """prepare -> gold -> sft -> reward on the `ci` profile, run once per test session (real data, real models)."""
    from rlhf.stages import gold, prepare, reward, sft

    data_dir = tmp_path_factory.mktemp("ci") / "data"
    cfg = ci_config(data_dir)
    for stage in (prepare, gold, sft, reward):
        stage.run(cfg)
    return data_dir


@pytest.fixture
def ci_data(ci_stages, tmp_path):
    """A private copy of the session's stage outputs, so a test may write train/ and checkpoints freely."""
    data_dir = tmp_path / "data"
    shutil.copytree(ci_stages, data_dir)
    return data_dir
