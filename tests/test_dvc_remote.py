"""Results that travel: a flow run pushes its DVC experiment and cached outputs (`dvc exp push origin <exp>`) where the
project has a default DVC remote, and other clones get them with the commands a user types.

Real parts only: a bare git repository as the team's git remote, a DVC remote that is a folder or an S3 bucket served
by moto on 127.0.0.1, a Prefect server on a free loopback port, a worker taking the run from prefect.yaml's work pool.
Every clone, cache and config lives under the test's tmp_path; HOME and XDG_CONFIG_HOME point there too.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import COMMAND_TIMEOUT, ROOT, free_port, isolated_env, make_dvc_repo, run_ok

# The tests that start the Prefect server share it: one pytest-xdist worker runs them, in file order.
ONE_SERVER = pytest.mark.xdist_group("dvc_remote")
BUCKET = "team-results"
EXPERIMENT = "shared-run"


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("remote-home")


@pytest.fixture(scope="module")
def env(home) -> dict:
    """The suite's offline env; the user's home, DVC/git config and AWS files all under `home`, and S3 credentials
    that moto accepts (no instance-metadata look-up: nothing leaves 127.0.0.1)."""
    (home / "home").mkdir(exist_ok=True)
    return {
        **isolated_env(home),
        "HOME": str(home / "home"),
        "XDG_CONFIG_HOME": str(home / "home" / ".config"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "AWS_ACCESS_KEY_ID": "team",
        "AWS_SECRET_ACCESS_KEY": "team-secret",
        "AWS_CONFIG_FILE": str(home / "home" / "aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(home / "home" / "aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
        # one attempt a request (botocore's default is 5, with backoff): a remote that answers nothing fails at once;
        # moto on loopback needs no retry
        "AWS_MAX_ATTEMPTS": "1",
    }


@pytest.fixture(scope="module")
def s3(env, home) -> str:
    """An S3-compatible server (moto) on a free loopback port with one bucket; its endpoint URL. In a process of its
    own: moto's server is a Flask app, and Flask's request-context globals, once imported into a test worker, broke
    later tests that build vLLM in that process (its start-up walks objects, and a context proxy raises on access)."""
    import boto3

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with (home / "moto.log").open("w") as log:
        server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while not _answers(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto's S3 server did not start: {(home / 'moto.log').read_text()[-2000:]}")
            time.sleep(0.2)
        keys = {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        boto3.client("s3", endpoint_url=url, region_name="us-east-1", **keys).create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def prefect_api(home, env) -> dict:
    """`prefect server start` on a free loopback port and prefect.yaml's process work pool `rlhf` on it; the env
    that points at it."""
    from flows.deployments import stop_server, wait_healthy

    port = free_port()
    api = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with (home / "server.log").open("w") as log:
        server = subprocess.Popen(cmd, env=api, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(api["PREFECT_API_URL"], server, COMMAND_TIMEOUT)
        run_ok(["prefect", "work-pool", "create", "rlhf", "--type", "process"], home, api)
        shutil.copy(ROOT / "prefect.yaml", home / "prefect.yaml")
        run_ok(["prefect", "--no-prompt", "deploy", "--name", "ci"], home, api)
        yield api
    finally:
        stop_server(server)


def team_project(path: Path, env: dict, remote: list[str], prepare_only: bool = False) -> Path:
    """Clone A: the pipeline on the `ci` profile with DVC remote `team` as its default (committed: every clone has
    it), pushed to the team's git remote, a bare repository beside it (`origin`)."""
    bare = path.parent / "team.git"
    run_ok(["git", "init", "-q", "--bare", "-b", "main", str(bare)], path.parent, env)
    repo = make_dvc_repo(path, prepare_only=prepare_only)
    params = repo / "params.yaml"
    params.write_text(re.sub(r"^profile: \S+", "profile: ci", params.read_text(), count=1, flags=re.M))
    run_ok(["dvc", "remote", "add", "-d", "team", *remote[:1]], repo, env)
    for setting in remote[1:]:
        run_ok(["dvc", "remote", "modify", "team", *setting.split("=", 1)], repo, env)
    run_ok(["git", "commit", "-qam", "the ci profile; the team's DVC remote"], repo, env)
    run_ok(["git", "remote", "add", "origin", str(bare)], repo, env)
    run_ok(["git", "push", "-q", "origin", "main"], repo, env)
    return repo


def worker_run(project: Path, api: dict, experiment: str) -> str:
    """rlhf/ci (online_dpo on `ci`) taken from the work pool by `prefect worker start --run-once` whose checkout is
    `project`; the flow run's log as Prefect stored it (`prefect flow-run logs`)."""
    wenv = {**api, "RLHF_PROJECT_DIR": str(project)}  # what `make worker` sets
    created = run_ok(["prefect", "deployment", "run", "rlhf/ci", "--param", f"experiment={experiment}"], project, wenv)
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", created).group(1)
    run_ok(["prefect", "worker", "start", "--pool", "rlhf", "--run-once"], project.parent, wenv)
    state = run_ok(["prefect", "flow-run", "inspect", run_id], project.parent, wenv)
    logs = run_ok(["prefect", "flow-run", "logs", run_id], project.parent, wenv)
    assert "state_type=StateType.COMPLETED" in state, logs[-4000:]
    return logs


def dvc_json(args: list[str], cwd: Path, env: dict):
    """A `dvc ... --json` command's output (stdout: DVC writes its notes to stderr)."""
    proc = subprocess.run(["dvc", *args, "--json"], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def recorded(project: Path, ref: str, out: str, env: dict) -> dict[str, str]:
    """What clone A's experiment `ref` records for output `out`: {file: md5} from its dvc.lock, a folder's files read
    from the .dir manifest in A's own DVC cache."""
    lock = yaml.safe_load(run_ok(["git", "show", f"{ref}:dvc.lock"], project, env))
    (digest,) = [o["md5"] for s in lock["stages"].values() for o in s.get("outs", []) if o["path"] == out]
    if not digest.endswith(".dir"):
        return {out: digest}
    manifest = json.loads((project / ".dvc" / "cache" / "files" / "md5" / digest[:2] / digest[2:]).read_text())
    return {f"{out}/{entry['relpath']}": entry["md5"] for entry in manifest}


def present(clone: Path, out: str) -> dict[str, str]:
    """{file: md5} of output `out` as it is in `clone`: the file, or every file under the folder."""
    path = clone / out
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    return {str(f.relative_to(clone)): hashlib.md5(f.read_bytes()).hexdigest() for f in files}


def test_a_push_needs_a_default_dvc_remote_and_its_failure_is_dvcs_one_line_reason(tmp_path, env):
    """The setting is DVC's own: no default remote, no push (`make run` and a lone checkout need none). A push that
    fails is told by DVC's one ERROR line, here of a real `dvc exp push` from a checkout with no git remote `origin`."""
    from flows.rlhf_flow import default_remote, dvc_error

    repo = tmp_path / "project"
    repo.mkdir()
    for cmd in (["git", "init", "-q"], ["git", "config", "user.name", "t"], ["git", "config", "user.email", "t@t"]):
        run_ok(cmd, repo, env)
    run_ok(["dvc", "init", "-q"], repo, env)
    assert default_remote(repo) is None
    run_ok(["dvc", "remote", "add", "other", str(tmp_path / "elsewhere")], repo, env)
    assert default_remote(repo) is None  # a remote, but not the default: still no push
    run_ok(["dvc", "remote", "add", "-d", "team", "../store"], repo, env)  # relative to where it is typed
    assert default_remote(repo) == ("team", str(tmp_path / "store"))
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "init"], repo, env)
    run_ok(["dvc", "exp", "save", "-n", "lonely"], repo, env)
    proc = subprocess.run(["dvc", "exp", "push", "origin", "lonely"], cwd=repo, env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "Having any troubles?" in proc.stderr  # DVC's reason, then its help lines
    reason = "Git failed to push '[]' to 'origin': No git repository was found at origin"
    assert dvc_error(proc.stdout + proc.stderr) == reason, proc.stderr


@pytest.mark.slow  # a Prefect server, a worker, the pipeline on `ci`
@ONE_SERVER
@pytest.mark.parametrize("kind", ["folder", "s3"])
def test_a_workers_run_reaches_another_clone_through_the_remotes(kind, tmp_path, env, s3, prefect_api):
    remote = [str(tmp_path / "dvc-store")] if kind == "folder" else [f"s3://{BUCKET}/{kind}", f"endpointurl={s3}"]
    a = team_project(tmp_path / "a", env, remote)
    logs = worker_run(a, prefect_api, EXPERIMENT)
    pushed = f"pushed experiment {EXPERIMENT} to git remote 'origin' and its outputs to DVC remote 'team'"
    assert pushed in logs, logs[-4000:]
    (ref,) = run_ok(["git", "for-each-ref", "--format=%(refname)", f"refs/exps/*/*/{EXPERIMENT}"], a, env).split()

    # Clone B, as a teammate types it.
    b = tmp_path / "b"
    run_ok(["git", "clone", "-q", str(tmp_path / "team.git"), str(b)], tmp_path, env)
    run_ok(["dvc", "exp", "pull", "origin", EXPERIMENT], b, env)
    shown = dvc_json(["exp", "show"], b, env)
    exps = {r["name"]: r["data"] for x in shown for e in x.get("experiments") or [] for r in e["revs"]}
    metrics_a = json.loads(run_ok(["git", "show", f"{ref}:data/metrics/eval.json"], a, env))
    assert exps[EXPERIMENT]["metrics"]["data/metrics/eval.json"]["data"] == metrics_a
    run_ok(["dvc", "exp", "apply", EXPERIMENT], b, env)
    eval_json = "data/metrics/eval.json"
    assert (b / eval_json).read_bytes() == subprocess.check_output(["git", "show", f"{ref}:{eval_json}"], cwd=a)
    for out in ("data/report", "data/train"):  # the report; the policy (and its training record)
        files = recorded(a, ref, out, env)
        assert len(files) >= 1 and present(b, out) == files, out
    diff = dvc_json(["metrics", "diff"], b, env)  # the experiment against HEAD (none)
    assert {k: v["new"] for k, v in diff[eval_json].items()} == metrics_a

    # Clone C skips every stage A ran: the experiment as a branch (from B), then `dvc pull` there.
    run_ok(["dvc", "exp", "branch", EXPERIMENT, "results"], b, env)
    run_ok(["git", "push", "-q", "origin", "results"], b, env)
    c = tmp_path / "c"
    run_ok(["git", "clone", "-q", "-b", "results", str(tmp_path / "team.git"), str(c)], tmp_path, env)
    run_ok(["dvc", "pull"], c, env)
    assert "Data and pipelines are up to date" in run_ok(["dvc", "status"], c, env)
    assert present(c, "data/train") == recorded(a, ref, "data/train", env)


@pytest.mark.slow  # a Prefect server, a worker, `prepare` on `ci`
@ONE_SERVER
def test_a_push_to_an_unreachable_remote_is_one_warning_and_the_result_stays(tmp_path, env, prefect_api):
    """The S3 endpoint answers nothing (a free port): the flow run still completes, with one warning line naming the
    remote and the cause, and its experiment and outputs saved in the project."""
    closed = f"http://127.0.0.1:{free_port()}"
    a = team_project(tmp_path / "a", env, [f"s3://{BUCKET}/down", f"endpointurl={closed}"], prepare_only=True)
    logs = worker_run(a, prefect_api, "unshared")
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d \d)", logs.strip())  # a record may span lines: each starts dated
    warnings = [r for r in records if "| WARNING |" in r or "| ERROR " in r]
    assert len(warnings) == 1 and "\n" not in warnings[0], logs[-4000:]
    (warning,) = warnings
    assert "experiment unshared not pushed" in warning
    assert "DVC remote 'team' at s3://" in warning and "Could not connect to the endpoint URL" in warning
    assert "Traceback" not in logs
    (ref,) = run_ok(["git", "for-each-ref", "--format=%(refname)", "refs/exps/*/*/unshared"], a, env).split()
    prepared = recorded(a, ref, "data/prepared", env)  # read from A's cache: the outputs are saved locally
    cache = a / ".dvc" / "cache" / "files" / "md5"
    assert len(prepared) > 1 and all((cache / h[:2] / h[2:]).is_file() for h in prepared.values())
