import hashlib
import multiprocessing.spawn
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

if os.environ.get("RLHF_WARM_PYTHON") == sys.executable:  # a pytest-xdist worker forked from the warm server
    sys.executable = os.environ["RLHF_WARM_REAL_PYTHON"]  # tests start the real one unless they ask for warm
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlhf import runtime  # noqa: E402

runtime.configure_environment()  # torch's settings in pytest_configure: pytest-xdist's controller imports no torch
# Hang guards, not speed limits: on a slow 2-core box two vLLM engines building side by side took ~10 min (default
# limit 600 s) and a Prefect server over 2 min to answer (default 120 s); pytest's 900 s per test stops a real hang.
os.environ.setdefault("RLHF_ENGINE_START_TIMEOUT", "870")
os.environ.setdefault("RLHF_SERVER_START_TIMEOUT", "600")
os.environ.setdefault("RLHF_TORCH_THREADS", "1")  # the suite's processes share the cores (runtime.threads_alone)

import pytest  # noqa: E402
import warm  # noqa: E402

from rlhf.config import load_config  # noqa: E402

PARAMS = ROOT / "params.yaml"
BIN = Path(sys.executable).parent  # the venv's `dvc`, `prefect`, `rlhf`, whatever PATH the runner has


def ci_config(data_dir, *overrides):
    """The `ci` profile of the real params.yaml, writing under `data_dir`, W&B off unless asked."""
    return load_config(PARAMS, "ci", [f"data_dir={data_dir}", "tracking.wandb_mode=disabled", *overrides])


def rlhf_command(*args, params=PARAMS, launcher=()) -> list[str]:
    """`rlhf --params PARAMS ARGS...` as a command line of a fresh interpreter (tests about the process: its pid,
    its children, its signals); under `launcher` (e.g. `accelerate_launch(...)`) it runs in the project's
    environment (rlhf.runtime) as `make` would start it, the launcher and its ranks warm (tests/warm/)."""
    cli = ["-m", "rlhf.cli", "--params", str(params), *args]
    return [str(warm.start()), "-m", "rlhf.runtime", *launcher, *cli] if launcher else [sys.executable, *cli]


def accelerate_launch(zero: str, processes: int = 2) -> list[str]:
    """accelerate launch with configs/<zero>.yaml (DeepSpeed ZeRO-2/3) and `processes` training processes, their
    rendezvous on a free port (two launches on the default 29500 at once: EADDRINUSE)."""
    config = str(ROOT / "configs" / f"{zero}.yaml")
    port = ["--main_process_port", str(free_port())]
    return ["accelerate", "launch", "--config_file", config, "--num_processes", str(processes), *port]


# A hang guard for a command a test starts, not a speed limit: a bare `rlhf sft` that only reports a missing input
# took over 120 s to start on a slow box (imports at ~0.1 GB/s of first-touched memory); pytest's 900 s backstops it.
COMMAND_TIMEOUT = 600


def run_cli(*args, params=PARAMS, timeout=COMMAND_TIMEOUT, env=None):
    """`rlhf --params PARAMS ARGS...` in a process of its own, as a user runs it (exit status and stderr are
    checked), forked with the stages' libraries already imported (tests/warm/)."""
    cmd = [str(warm.start()), "-m", "rlhf.cli", "--params", str(params), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def pytest_configure(config):
    worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    if worker or not config.getoption("numprocesses", None):  # a process that runs tests
        runtime.configure_torch()
    # One warm server for the session (unless RLHF_WARM=0); pytest-xdist's workers fork from it too, so collecting
    # the tests imports nothing new (three processes importing torch and vLLM at once: 16 min).
    if not worker and warm.ON:
        python = warm.start()
        tx = getattr(config.option, "tx", None)  # pytest-xdist's, when it is on
        if tx and set(tx) == {"popen"}:
            config.option.tx = [f"popen//python={python}"] * len(tx)


@pytest.fixture(autouse=True, scope="session")
def warm_processes():
    """The processes tests start (rlhf commands, accelerate launches, vLLM's spawned engine process) fork from a
    server with their libraries imported (tests/warm/); it starts importing now, beside the first tests."""
    if warm.ON:
        multiprocessing.spawn.set_executable(str(warm.start()))


@pytest.fixture(autouse=True, scope="module")
def cores_given_back():
    """A module's tests leave this process the CPU cores they found: an engine that keeps the trainer off its core
    gives it back at close (one that did not would leave later tests, e.g. map_in_processes, on fewer cores)."""
    cores = os.sched_getaffinity(0)
    yield
    left = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    assert left == cores, f"this module's tests left the process on cores {sorted(left)}, not {sorted(cores)}"


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
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_HOME": str(home / "prefect"),
        "WANDB_DIR": str(home / "wandb"),
        "RLHF_WORKSPACES": str(home / "workspaces"),
        "DVC_NO_ANALYTICS": "1",
    }


def run_ok(cmd: list[str], cwd: Path, env: dict, timeout: float = COMMAND_TIMEOUT) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def chromium(profile_dir: Path, offline: bool = False) -> list[str]:
    """Headless Chromium as a command line (append --dump-dom URL or --screenshot=... URL); scripts get 15 s of
    virtual time. offline: every host name fails to resolve, as on a machine without network."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium not installed: `make test` installs it (make chromium)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
    flags += ["--disable-component-update", "--disable-sync", f"--user-data-dir={profile_dir}"]
    flags += ["--virtual-time-budget=15000", *(["--host-resolver-rules=MAP * ~NOTFOUND"] if offline else [])]
    return [path, *flags]


def drawn_offline(page: Path, tmp_path: Path) -> str:
    """The page's DOM after headless Chromium, with no host name resolving, ran its scripts."""
    html = page.read_text()
    assert "<script src" not in html and "cdn." not in html  # DVC's CDN tags stay out (rlhf/plots_page.py)
    proc = subprocess.run(
        [*chromium(tmp_path / "chromium", offline=True), "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    return proc.stdout


def copy_pipeline(path: Path) -> None:
    """dvc.yaml and the files its stages depend on outside data/ into the folder `path`: the `rlhf` code (what they
    run, `python -m rlhf.cli` in the copy) and bench/metrics/offpolicy.csv (the report's off-policy section)."""
    (path / "bench" / "metrics").mkdir(parents=True)
    for name in ("dvc.yaml", ".gitignore", ".dvcignore", "bench/metrics/offpolicy.csv"):
        shutil.copy(ROOT / name, path / name)
    shutil.copytree(ROOT / "rlhf", path / "rlhf", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def make_dvc_repo(path: Path, cache: Path | None = None, prepare_only: bool = False) -> Path:
    """A git+DVC copy of the project's pipeline: dvc.yaml, params.yaml and the `rlhf` code its stages depend on.

    cache: a DVC cache folder to use (the session's `dvc_cache`) instead of the repo's own.
    prepare_only: dvc.yaml cut to its first stage (seconds, no torch): for tests of what runs the pipeline (a Prefect
    worker, a server gone mid-run), not of the stages."""
    copy_pipeline(path)
    shutil.copy(ROOT / "params.yaml", path / "params.yaml")
    if prepare_only:
        (path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text().split("\n  gold:")[0] + "\n")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    for cmd in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "config", "user.name", "rlhf test"],
        ["git", "config", "user.email", "test@localhost"],
        ["dvc", "init", "-q"],
        ["dvc", "config", "core.analytics", "false"],
        *([["dvc", "config", "--local", "cache.dir", str(cache)]] if cache else []),
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "pipeline"],
    ):
        run_ok(cmd, path, env)
    return path


def session_dir(tmp_path_factory) -> Path:
    """A folder of this test session that all its pytest-xdist workers share."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def dvc_cache(tmp_path_factory) -> Path:
    """One DVC cache for the session's end-to-end pipeline runs (test_pipeline, the Prefect and queue runs), as a
    user's experiments share their project's: one copy of each output, cached once. No stage comes back from it by
    DVC's run-cache (DVC skips that for stages with `persist` outputs, as all of ours are): a stage is skipped only
    where a repository's dvc.lock records it and its outputs are checked out. Tests that must see a stage really run
    (interrupts) keep their own cache."""
    return session_dir(tmp_path_factory) / "dvc-cache"


@pytest.fixture(scope="session")
def ci_stages(tmp_path_factory):
    """prepare -> gold -> sft -> reward on the `ci` profile (real data, real models), run once per test session:
    the first pytest-xdist worker to get here builds it, the others wait on the lock and share it (read-only)."""
    from filelock import FileLock

    from rlhf.stages import gold, prepare, reward, sft

    shared = session_dir(tmp_path_factory)
    data_dir = shared / "ci_stages" / "data"
    with FileLock(str(shared / "ci_stages.lock")):
        if not (data_dir.parent / "complete").exists():
            shutil.rmtree(data_dir, ignore_errors=True)
            cfg = ci_config(data_dir)
            for stage in (prepare, gold, sft, reward):
                stage.run(cfg)
            (data_dir.parent / "complete").touch()
    return data_dir


@pytest.fixture
def ci_data(ci_stages, tmp_path):
    """A private copy of the session's stage outputs, so a test may write train/ and checkpoints freely."""
    data_dir = tmp_path / "data"
    shutil.copytree(ci_stages, data_dir)
    return data_dir


_seconds: dict[str, dict[str, float]] = {}  # test -> phase (setup, call, teardown) -> seconds


@pytest.hookimpl(wrapper=True)
def pytest_report_teststatus(report, config):
    """`-v` lines (CI's) carry the test's time, setup included, and a failure's one-line reason: a run CI stops at
    its time limit never reaches the summary at the end, where pytest prints both."""
    category, letter, word = yield
    # set, not added: the hook runs again for the same report in the summary
    _seconds.setdefault(report.nodeid, {})[report.when] = getattr(report, "duration", 0.0)
    if not isinstance(word, str | tuple) or not word or (report.when != "call" and not report.failed):
        return category, letter, word
    text, markup = (word, {}) if isinstance(word, str) else word
    text = f"{text} {sum(_seconds[report.nodeid].values()):.0f}s"
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message if crash is not None else (str(report.longrepr).strip().splitlines() or [""])[-1]
        text += f" ({' '.join(reason.split())[:300]})"
    return category, letter, (text, markup) if markup else text
