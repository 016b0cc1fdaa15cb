"""Prefect orchestration: the stage graph from dvc.yaml, params and retries, the deployments, W&B tracking,
then a real server + `python -m flows.deployments` (what `make serve` runs) on a free loopback port in a
temporary git+DVC copy of the project: a `ci` run of rlhf/ppo recorded as a DVC experiment, the UI seen by
headless Chromium, Ctrl-C. Nothing here touches the project's own data/, .dvc or Prefect database.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import BIN, COMMAND_TIMEOUT, ROOT, chromium, free_port, isolated_env, make_dvc_repo, run_ok

from rlhf.config import Config, ConfigError, TrackingConfig, load_config
from rlhf.tracking import STEP, Tracker, log_results, wandb_mode

DEPLOYMENTS = {
    "ppo": "ppo",
    "rloo": "rloo",
    "online-dpo": "online_dpo",
    "online-dpo-vllm": "online_dpo_vllm",
    "online-dpo-single-vllm": "online_dpo_single_vllm",
    "bok": "bok",
    "grpo": "grpo",
}


# --- the stage graph ------------------------------------------------------------------------------------


def dvc_project(path: Path, stages: dict) -> Path:
    """A DVC project (no git) whose dvc.yaml holds `stages`."""
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    run_ok([str(BIN / "dvc"), "init", "--no-scm", "-q"], path, {**os.environ, "DVC_NO_ANALYTICS": "1"})
    return path


def test_stage_order_follows_deps_not_file_order(tmp_path):
    from tasks.stages import Pipeline

    stages = {
        "report": {"cmd": "x", "deps": ["out/b", "out/c"]},
        "b": {"cmd": "x", "deps": ["out/a", "src.py"], "outs": ["out/b"]},
        "c": {"cmd": "x", "deps": ["out/a/part.txt"], "outs": ["out/c"], "metrics": [{"m/c.json": {"cache": False}}]},
        "a": {"cmd": "x", "outs": ["out/a"]},
    }
    pipeline = Pipeline.read(dvc_project(tmp_path, stages))
    # c depends on a through a file inside a's output folder; src.py belongs to no stage.
    assert pipeline.upstream == {"report": ["b", "c"], "b": ["a"], "c": ["a"], "a": []}
    # a is the only stage ready; then b and c are both ready and keep file order; report needs both.
    assert pipeline.order == ["a", "b", "c", "report"]
    assert pipeline.metrics == {"report": [], "b": [], "c": ["m/c.json"], "a": []}


def test_stage_cycle_is_an_error(tmp_path):
    from tasks.stages import Pipeline

    stages = {"x": {"cmd": "x", "deps": ["y"], "outs": ["x"]}, "y": {"cmd": "x", "deps": ["x"], "outs": ["y"]}}
    with pytest.raises(Exception, match="[Cc]ycl"):
        Pipeline.read(dvc_project(tmp_path, stages))


def test_real_pipeline_order_comes_from_dvc_yaml():
    from tasks.stages import Pipeline

    declared = list(yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"])
    pipeline = Pipeline.read(ROOT)
    order = pipeline.order
    assert sorted(order) == sorted(declared)
    for stage, upstream in pipeline.upstream.items():
        assert all(order.index(u) < order.index(stage) for u in upstream), (stage, upstream)
    assert order[0] == "prepare" and order[-2:] == ["evaluate", "report"]
    assert set(pipeline.upstream["train"]) == {"prepare", "sft", "reward", "gold"}
    assert pipeline.metrics["train"] == [] and pipeline.metrics["evaluate"] == ["data/metrics/eval.json"]


# --- failures: which ones are retried --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "rc", "expected"),
    [
        ("ERROR: failed to reproduce 'train': failed to run: rlhf train, exited with 1", 255, (1, False)),
        ("ERROR: failed to reproduce 'train': failed to run: rlhf train, exited with 2", 255, (2, False)),
        ("ERROR: failed to reproduce 'train': failed to run: rlhf train, exited with -9", 255, (-9, True)),
        ("ERROR: failed to reproduce 'train': failed to run: rlhf train, exited with 137", 255, (137, True)),
        ("ERROR: Unable to acquire lock. Most likely another DVC process is running", 255, (None, True)),
        ("ERROR: 'dvc.yaml' is invalid", 255, (None, False)),
        ("", -15, (None, True)),
    ],
)
def test_classify_failure(output, rc, expected):
    from tasks.stages import classify_failure

    assert classify_failure(output, rc) == expected


def test_retry_condition_uses_transience():
    from prefect.states import Completed, Failed

    from tasks.stages import StageFailed, retry_if_transient

    assert retry_if_transient(None, None, Failed(data=StageFailed("train", -9, True, "killed"))) is True
    assert retry_if_transient(None, None, Failed(data=StageFailed("train", 1, False, "bad config"))) is False
    assert retry_if_transient(None, None, Failed(data=KeyError("x"))) is False
    assert retry_if_transient(None, None, Completed(data=1)) is False


def test_stage_log_keeps_a_progress_bars_last_state_and_drops_dvcs_hints():
    """A real child process writing what `dvc repro` of a stage writes: a tqdm bar redrawn with \\r, DVC's hints."""
    import logging

    from tasks.stages import _stream

    script = (
        "import sys; w = sys.stdout.write\n"
        "w('Running stage train:\\n')\n"
        "[w(f'\\rtrain: {i}/4') for i in range(5)]; w('\\n')\n"
        "w('To track the changes with git, run:\\n\\n\\tgit add data/.gitignore dvc.lock\\n\\n')\n"  # a first run's
        "w('To enable auto staging, run:\\n')\n"
        "w('\\n\\tdvc config core.autostage true\\nUse `dvc push` to send your updates to remote storage.\\n')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    logger = logging.getLogger("stage-log-test")
    with pytest.MonkeyPatch.context() as mp:
        logged: list[str] = []
        mp.setattr(logger, "info", logged.append)
        _stream(proc, logger)
    proc.wait()
    assert logged == ["Running stage train:", "train: 4/4"]


# --- the run's parameters --------------------------------------------------------------------------------


def test_set_params_writes_overrides_and_keeps_comments(tmp_path):
    from flows.workspace import set_params

    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    set_params(
        params, ["profile=ci", "train.trainer=ppo", "train.k=4", "train.learning_rate=1e-4", "eval.batch_size=8"]
    )
    text = params.read_text()
    assert "# Experiment overrides on top of the profile" in text  # DVC's -S round trip keeps comments
    raw = yaml.safe_load(text)
    assert raw["profile"] == "ci"
    assert raw["train"]["trainer"] == "ppo" and raw["train"]["k"] == 4 and raw["eval"] == {"batch_size": 8}
    cfg = load_config(params)
    assert (cfg.profile, cfg.train.trainer, cfg.train.k, cfg.eval.batch_size) == ("ci", "ppo", 4, 8)
    assert cfg.train.learning_rate == pytest.approx(1e-4)  # a float, not the string "1e-4"
    assert cfg.data.n_sft == 400  # still the ci profile's value underneath


def test_bad_parameters_fail_as_config_errors(tmp_path):
    from flows.workspace import set_params

    params = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", params)
    with pytest.raises(ConfigError, match="section.key=value"):
        set_params(params, ["train.k"])
    set_params(params, ["train.learning_rate=-1"])
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config(params)


def test_experiment_name_is_the_flow_runs_a_valid_ref_and_new():
    from flows.rlhf_flow import experiment_name

    assert experiment_name("crimson fox!", set()) == "crimson-fox"
    assert experiment_name(None, set()) == "run"
    assert experiment_name("crimson-fox", {"crimson-fox", "crimson-fox-2"}) == "crimson-fox-3"  # never refused


def test_one_deployment_per_trainer_with_a_paused_schedule():
    from flows.deployments import deployments

    deps = {d.name: d for d in deployments()}
    assert set(deps) == set(DEPLOYMENTS)
    for name, trainer in DEPLOYMENTS.items():
        assert deps[name].parameters == {"trainer": trainer}
        assert deps[name].entrypoint == "flows.rlhf_flow.rlhf"
    scheduled = [d for d in deps.values() if d.schedules]
    assert scheduled and all(not s.active for d in scheduled for s in d.schedules)


# --- no Prefect below the flow ---------------------------------------------------------------------------


def test_rlhf_package_never_imports_prefect():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "rlhf").rglob("*.py")
        if re.search(r"^\s*(import|from)\s+(prefect|flows|tasks)\b", p.read_text(), re.M)
    ]
    assert offenders == []
    # Import the CLI and every stage module with prefect made unimportable, then resolve a config with a
    # Prefect API URL that nothing answers: no hidden dependency on a server.
    code = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'prefect':
            raise ImportError('prefect imported by ' + name)
sys.meta_path.insert(0, Block())
import rlhf.cli, rlhf.stages
for m in pkgutil.iter_modules(rlhf.stages.__path__):
    importlib.import_module('rlhf.stages.' + m.name)
assert rlhf.cli.main(['--params', sys.argv[1], '--profile', 'ci', 'config']) == 0
print('NO-PREFECT-OK', len(rlhf.cli.PIPELINE))
"""
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "params.yaml")],
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "NO-PREFECT-OK 8" in proc.stdout


def test_dvc_repro_runs_a_stage_without_prefect(tmp_path):
    """`dvc repro` of a real stage with a `prefect` package that refuses to import, and no server."""
    repo = make_dvc_repo(tmp_path / "project")
    stub = tmp_path / "stub" / "prefect"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('a stage imported prefect')\n")
    env = {
        **isolated_env(tmp_path),
        "PYTHONPATH": str(stub.parent),
        "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api",
    }
    run_ok(["sed", "-i", "s/^profile: .*/profile: ci/", "params.yaml"], repo, env)
    out = run_ok(["dvc", "repro", "--single-item", "prepare"], repo, env)
    assert "Running stage 'prepare'" in out
    assert json.loads((repo / "data/metrics/prepare.json").read_text())


# --- W&B -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "env", "expected"),
    [
        ("offline", {"WANDB_MODE": "offline"}, "offline"),
        ("offline", {}, "offline"),
        ("offline", {"WANDB_API_KEY": "k"}, "online"),  # a key switches the default online
        ("offline", {"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, "offline"),  # ... unless asked to stay offline
        ("offline", {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k"}, "disabled"),
        ("online", {"WANDB_MODE": "offline"}, "online"),
        ("disabled", {"WANDB_API_KEY": "k"}, "disabled"),
    ],
)
def test_wandb_mode(setting, env, expected):
    assert wandb_mode(setting, env) == expected


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, its runs under tmp_path/wandb."""
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wandb").mkdir()


def test_completions_table_lands_in_the_offline_run(tmp_path, offline_wandb):
    tracker = Tracker(
        Config(profile="test", data_dir=str(tmp_path / "data"), tracking=TrackingConfig(wandb_mode="offline")), "train"
    )
    tracker.log({STEP: 8, "objective/scores": 0.5})
    tracker.completions(
        8,
        ["a film", "a film", "the plot"],
        ["that shines", "that bores", "drags"],
        [0.5, -0.25, 1.0],
        [0.875, 0.125, 0.5],
        max_rows=2,
    )
    with pytest.raises(ValueError, match="one entry per completion"):
        tracker.completions(8, ["a film"], ["x", "y"], [0.0, 1.0])
    tracker.finish({"final/objective/scores": 0.5})
    tables = list((tmp_path / "wandb").glob("wandb/offline-run-*/files/media/table/completions_*.table.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "gold"]
    assert table["data"] == [
        ["a film", "that shines", 0.5, 0.875],
        ["a film", "that bores", -0.25, 0.125],
    ]  # max_rows=2


def test_results_land_in_an_offline_run_as_a_table_and_images(tmp_path, offline_wandb):
    """What `evaluate` (the frontier) and `rlhf report` (its charts) log: a W&B run of their own."""
    import io

    import pandas as pd
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (40, 30), "white").save(png, "PNG")
    frontier = pd.DataFrame({"episode": [0, 8], "kl": [0.0, 1.5], "win_rate_vs_sft": [0.5, 0.75]})

    def config(mode: str) -> Config:
        return Config(profile="test", data_dir=str(tmp_path / "data"), tracking=TrackingConfig(wandb_mode=mode))

    log_results(config("disabled"), "evaluate", {"gold/win_rate_vs_sft": 0.75}, {"frontier": frontier})
    assert not list((tmp_path / "wandb").iterdir())  # no run
    log_results(
        config("offline"),
        "evaluate",
        {"gold/win_rate_vs_sft": 0.75},
        {"frontier": frontier},
        {"Frontier": png.getvalue()},
    )
    [files] = (tmp_path / "wandb").glob("wandb/offline-run-*/files")
    [table] = files.glob("media/table/frontier_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"] == ["episode", "kl", "win_rate_vs_sft"] and logged["data"] == [
        [0, 0.0, 0.5],
        [8, 1.5, 0.75],
    ]
    [image] = files.glob("media/images/Frontier_*.png")
    assert Image.open(image).size == (40, 30)


# --- a real server, the deployments, a run ---------------------------------------------------------------


def _api(api_url: str, route: str, body: dict | None = None):
    req = urllib.request.Request(
        f"{api_url}{route}",
        data=json.dumps(body or {}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("prefect-home")


@pytest.fixture(scope="module")
def repo(home, dvc_cache):
    return make_dvc_repo(home / "project", dvc_cache)


@pytest.fixture(scope="module")
def served(home, repo):
    """`python -m flows.deployments --port P` (the `make serve` command) in the temporary project."""
    port = free_port()
    env = {**isolated_env(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"}
    log = (home / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flows.deployments", "--port", str(port)],
        cwd=repo,
        env=isolated_env(home),  # no PREFECT_API_URL, as `make serve` starts: the process sets its own
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api_url = env["PREFECT_API_URL"]
    info = {"api_url": api_url, "port": port, "env": env, "proc": proc, "log": home / "serve.log"}
    try:
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while time.monotonic() < deadline:
            assert proc.poll() is None, (home / "serve.log").read_text()[-3000:]
            if _healthy(api_url) and len(_api(api_url, "/deployments/filter")) == len(DEPLOYMENTS):
                break
            time.sleep(1)
        else:
            log = (home / "serve.log").read_text()[-3000:]
            pytest.fail(f"server + deployments not up in {COMMAND_TIMEOUT} s:\n{log}")
        info["startup_s"] = COMMAND_TIMEOUT - (deadline - time.monotonic())
        found = re.search(r"prefect server pid (\d+)", (home / "serve.log").read_text())
        info["server_pid"] = int(found.group(1))
        yield info
    finally:  # whatever a test left running: the runner first, then the server
        for pgid in (proc.pid, info.get("server_pid")):
            if pgid is not None:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait(10)
        log.close()


@pytest.mark.slow
def test_server_lists_the_deployments(served):
    deps = {d["name"]: d for d in _api(served["api_url"], "/deployments/filter")}
    assert set(deps) == set(DEPLOYMENTS)
    assert all(d["parameters"] == {"trainer": DEPLOYMENTS[n]} for n, d in deps.items())
    schedules = [s for d in deps.values() for s in d["schedules"]]
    assert schedules and not any(s["active"] for s in schedules)  # the example schedule is paused


@pytest.mark.slow
def test_ppo_run_completes_and_is_a_dvc_experiment(served, repo, home):
    env = served["env"]
    # An uncommitted edit in the checkout goes into the run (as with `dvc exp run`) and stays in the checkout.
    params = (repo / "params.yaml").read_text().replace("seed: 1234", "seed: 4321")
    (repo / "params.yaml").write_text(params)
    t0 = time.monotonic()
    cli = subprocess.run(
        [
            "prefect",
            "deployment",
            "run",
            "rlhf/ppo",
            "--param",
            "profile=ci",
            "--watch",
            "--watch-interval",
            "1",
            "--watch-timeout",
            str(COMMAND_TIMEOUT - 30),
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    print(f"rlhf/ppo on ci: {time.monotonic() - t0:.1f} s")
    runs = [
        r
        for r in _api(served["api_url"], "/flow_runs/filter")
        if r["parameters"] == {"trainer": "ppo", "profile": "ci"}
    ]
    assert len(runs) == 1
    run = runs[0]
    if cli.returncode != 0 or run["state_type"] != "COMPLETED":
        logs = _api(served["api_url"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}})
        pytest.fail(cli.stdout[-2000:] + "\n".join(entry["message"] for entry in logs)[-6000:])
    tasks = _api(served["api_url"], "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
    tasks.sort(key=lambda t: t["start_time"])
    names = [t["name"] for t in tasks]
    stages = yaml.safe_load((repo / "dvc.yaml").read_text())["stages"]
    assert "report" in stages and sorted(names) == sorted([*stages, "dvc exp save", "artifacts"])
    assert (names[0], *names[-4:]) == (
        "prepare",
        "evaluate",
        "report",
        "dvc exp save",
        "artifacts",
    )  # every stage, deps first
    assert all(t["state_type"] == "COMPLETED" and t["run_count"] == 1 for t in tasks)
    train = next(t for t in tasks if t["name"] == "train")
    logs = _api(served["api_url"], "/logs/filter", {"logs": {"task_run_id": {"any_": [train["id"]]}}})
    assert any("train [ppo]: final/" in entry["message"] for entry in logs)  # the stage's own output is in the UI
    # The run's results beside its task states: the metrics and the frontier as tables, a note on the report.
    artifacts = _api(served["api_url"], "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run["id"]]}}})
    by_key = {a["key"]: a for a in artifacts}
    assert {k: by_key[k]["type"] for k in by_key} == {
        "rlhf-headline": "table",
        "rlhf-metrics": "table",
        "rlhf-frontier": "table",
        "rlhf-report": "markdown",
    }
    assert sorted(artifacts, key=lambda a: a["created"])[0]["key"] == "rlhf-headline"  # the UI lists it first
    headline = json.loads(by_key["rlhf-headline"]["data"])
    assert headline[0]["metric"] == "gold win-rate vs SFT" and set(headline[0]) == {
        "metric",
        "value",
        "unit",
        "meaning",
    }
    assert all(len(row["value"].lstrip("-0.").replace(".", "")) <= 3 for row in headline), headline
    assert "plumbing check" in by_key["rlhf-headline"]["description"]  # the ci profile's numbers mean nothing
    metrics_table = json.loads(by_key["rlhf-metrics"]["data"])
    assert {"file": "data/metrics/eval.json", "metric": "gold/win_rate_vs_sft"} in [
        {k: row[k] for k in ("file", "metric")} for row in metrics_table
    ]
    assert not any(isinstance(row["value"], str) and row["value"].startswith("{") for row in metrics_table)
    assert [row["episode"] for row in json.loads(by_key["rlhf-frontier"]["data"])] == [0, 8, 16]
    note = by_key["rlhf-report"]["data"]
    copy = repo / ".cache" / "reports" / run["name"] / "index.html"
    assert f"]({copy.as_uri()})" in note and copy.is_file() and "dvc exp apply" not in note
    # quiet logs: DVC's per-stage hints left out, and transformers' bar per model loaded (nothing is downloaded)
    assert not any("git add" in entry["message"] for entry in logs)
    assert not any("Loading weights" in entry["message"] for entry in logs)

    # The DVC record: `dvc exp show` lists the run with its params and metrics.
    shown = json.loads(run_ok(["dvc", "exp", "show", "--json"], repo, env))
    revs = {rev["name"]: rev for b in shown for e in (b.get("experiments") or []) for rev in e["revs"]}
    exps = {exp: rev["data"] for exp, rev in revs.items()}
    name = run["name"]  # the flow run's name is the experiment's
    assert set(exps) == {name}
    exp_params = exps[name]["params"]["params.yaml"]["data"]
    assert (exp_params["profile"], exp_params["train"]["trainer"], exp_params["seed"]) == ("ci", "ppo", 4321)
    assert set(exps[name]["metrics"]) == {"data/metrics/eval.json"}  # the results: dvc.yaml's one metrics file
    assert exps[name]["metrics"]["data/metrics/eval.json"]["data"]
    # ... and the README's first comparison command, as typed, reads in a 120-column terminal: no column cut to "…"
    [typed] = re.findall(r"^dvc exp show\b.*?(?=\s+#|$)", (ROOT / "README.md").read_text(), flags=re.M)[:1]
    table = run_ok(shlex.split(typed), repo, {**env, "COLUMNS": "120"})
    assert name in table and "…" not in table and max(map(len, table.splitlines())) <= 120, table
    # the stages' diagnostics (plain `cache: false` outs) are in the experiment's commit too
    committed = run_ok(["git", "ls-tree", "-r", "--name-only", revs[name]["rev"]], repo, env)
    assert all(f"data/metrics/{stage}.json" in committed for stage in ("prepare", "gold", "sft", "reward", "train"))
    # W&B: the train stage's offline run, under WANDB_DIR.
    assert list((home / "wandb").glob("wandb/offline-run-*/run-*.wandb"))
    # The user's checkout is untouched: its own edit only, no outputs, no DVC bookkeeping refs, no workspace.
    assert run_ok(["git", "status", "--porcelain"], repo, env).strip() == "M params.yaml"
    assert (repo / "params.yaml").read_text() == params
    assert not (repo / "data").exists()
    assert run_ok(["git", "for-each-ref", "refs/exps/exec/"], repo, env).strip() == ""
    assert list((home / "workspaces").iterdir()) == []


@pytest.mark.slow
def test_bad_config_fails_at_once_without_retries(served, repo):
    proc = subprocess.run(
        [
            "prefect",
            "deployment",
            "run",
            "rlhf/rloo",
            "--param",
            "profile=ci",
            "--param",
            'overrides=["train.learning_rate=-1"]',
            "--watch",
            "--watch-interval",
            "1",
            "--watch-timeout",
            str(COMMAND_TIMEOUT - 30),
        ],
        cwd=repo,
        env=served["env"],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert proc.returncode != 0
    run = next(r for r in _api(served["api_url"], "/flow_runs/filter") if r["parameters"].get("trainer") == "rloo")
    assert run["state_type"] == "FAILED" and run["run_count"] == 1
    assert (
        _api(served["api_url"], "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}}) == []
    )  # no stage ran
    logs = _api(served["api_url"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}})
    assert any("train.learning_rate" in entry["message"] for entry in logs)


@pytest.mark.slow
def test_ui_lists_the_deployments_in_chromium(served, home):
    cmd = chromium(home / "chromium")
    url = f"http://127.0.0.1:{served['port']}/deployments"
    dom = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=COMMAND_TIMEOUT).stdout
    for name in DEPLOYMENTS:  # each deployment is a link named after it (the UI rendered the API's list)
        assert re.search(rf">\s*{re.escape(name)}\s*</a>", dom), name
    subprocess.run(
        [*cmd, "--window-size=1400,900", f"--screenshot={home / 'deployments.png'}", url],
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert (home / "deployments.png").stat().st_size > 10_000


def test_prefect_yaml_declares_the_served_deployments_on_a_process_pool():
    """prefect.yaml (workers on other machines) and `make serve` offer the same rlhf/<trainer> deployments."""
    from flows.deployments import deployments

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    declared = {d["name"]: d for d in spec["deployments"]}
    served = {d.name: d.parameters for d in deployments()}
    assert {n: d["parameters"] for n, d in declared.items() if n != "ci"} == served
    assert declared["ci"]["parameters"] == {"trainer": "online_dpo", "profile": "ci"}
    assert all(
        d["work_pool"]["name"] == "rlhf" and d["entrypoint"] == "flows.rlhf_flow.rlhf" for d in declared.values()
    )


def test_a_project_without_a_git_identity_still_saves_its_experiment(tmp_path, monkeypatch):
    """A fresh machine, a container or a Prefect worker may have no git user: the run's clone then authors its
    experiment commit as flows.workspace.NO_IDENTITY (was: `dvc exp save` failed the run after every stage ran)."""
    from flows.workspace import NO_IDENTITY, clone_at_head

    home = tmp_path / "home"
    home.mkdir()
    for variable in ("HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(variable, str(home))  # no ~/.gitconfig: git has no user here
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    env = isolated_env(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text("seed: 1\n")
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"]):
        run_ok(cmd, project, env)
    run_ok(["git", "-c", "user.name=a", "-c", "user.email=a@localhost", "commit", "-qm", "c"], project, env)
    assert subprocess.run(["git", "config", "user.name"], cwd=project, env=env).returncode == 1  # none set
    clone = clone_at_head(project, tmp_path / "clone")
    run_ok(["dvc", "exp", "save", "-n", "no-identity"], clone, env)
    authors = run_ok(["git", "for-each-ref", "--format=%(authorname) %(authoremail)", "refs/exps/"], clone, env)
    assert f"{NO_IDENTITY['user.name']} <{NO_IDENTITY['user.email']}>" in authors, authors


@pytest.mark.slow
def test_a_run_skips_the_stages_the_projects_dvc_lock_has_done(served, dvc_cache, tmp_path):
    """The run's clone has the outputs its dvc.lock records, from the project's DVC cache: a stage whose inputs did
    not change is skipped, as `dvc repro` skips it in the checkout (the clone ran every stage again: DVC's run-cache
    skips stages with `persist` outputs)."""
    repo = make_dvc_repo(tmp_path / "project", dvc_cache, prepare_only=True)
    env = {**served["env"], "RLHF_PROJECT_DIR": str(repo), "RLHF_WORKSPACES": str(tmp_path / "workspaces")}
    params = repo / "params.yaml"
    params.write_text(re.sub(r"^profile: \S+", "profile: ci", params.read_text(), count=1, flags=re.M))
    run_ok(["dvc", "repro"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "commit", "-qm", "the ci profile's prepare"], repo, env)
    flow = [sys.executable, "-c", "from flows.rlhf_flow import rlhf; rlhf(trainer='ppo', profile='ci')"]
    proc = subprocess.run(flow, cwd=repo, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "Stage 'prepare' didn't change, skipping" in out and "Running stage" not in out, out[-3000:]
    shown = json.loads(run_ok(["dvc", "exp", "show", "--json"], repo, env))
    saved = re.search(r"saved DVC experiment (\S+):", out).group(1)  # the flow run's name
    assert saved in {r["name"] for b in shown for e in b.get("experiments") or [] for r in e["revs"]}, out[-3000:]


@pytest.mark.slow
def test_a_worker_runs_the_ci_deployment_from_the_work_pool(served, dvc_cache, tmp_path):
    """prefect.yaml's way: a process work pool, `prefect deploy`, and a worker (on loopback here, on any machine with
    the project checked out in general) that picks up the run and takes it to completion in its own checkout. The
    worker's checkout runs `prepare` only: what is tested is the worker's part (the whole pipeline through a
    deployment is test_ppo_run_completes_and_is_a_dvc_experiment's), and the pipeline cost ~50 s more here."""
    repo = make_dvc_repo(tmp_path / "worker-checkout", dvc_cache, prepare_only=True)
    env = {**served["env"], "RLHF_PROJECT_DIR": str(repo)}  # what `make worker` sets: the worker's checkout
    shutil.copy(ROOT / "prefect.yaml", tmp_path / "prefect.yaml")
    run_ok(["prefect", "work-pool", "create", "rlhf", "--type", "process"], tmp_path, env)
    run_ok(["prefect", "--no-prompt", "deploy", "--name", "ci"], tmp_path, env)
    run_ok(["prefect", "deployment", "run", "rlhf/ci"], tmp_path, env)
    t0 = time.monotonic()
    worker = subprocess.run(
        ["prefect", "worker", "start", "--pool", "rlhf", "--run-once"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    print(f"rlhf/ci through the worker: {time.monotonic() - t0:.1f} s")
    [run] = _api(served["api_url"], "/flow_runs/filter", {"work_pools": {"name": {"any_": ["rlhf"]}}})
    if worker.returncode != 0 or run["state_type"] != "COMPLETED":
        logs = _api(served["api_url"], "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}})
        pytest.fail(worker.stdout[-2000:] + worker.stderr[-2000:] + "\n".join(e["message"] for e in logs)[-4000:])
    assert run["parameters"] == {"trainer": "online_dpo", "profile": "ci"}
    shown = json.loads(run_ok(["dvc", "exp", "show", "--json"], repo, env))
    names = {rev["name"] for b in shown for e in (b.get("experiments") or []) for rev in e["revs"]}
    assert run["name"] in names  # the run's results are an experiment of the worker's project


@pytest.mark.slow
def test_ctrl_c_stops_runner_then_server(served):
    proc = served["proc"]
    before = len(served["log"].read_text())  # what earlier tests' flow runs logged (a failed run's traceback)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends to `make serve`'s process group
    assert proc.wait(COMMAND_TIMEOUT) == 0
    assert time.monotonic() - t0 < 15  # was 68 s: the runner talked to a second, temporary server being torn down
    assert not _healthy(served["api_url"])
    with pytest.raises(ProcessLookupError):
        os.kill(served["server_pid"], 0)
    whole = served["log"].read_text()
    log = whole[before:]  # what stopping printed
    assert log.index("Received KeyboardInterrupt") < log.index("stopping the prefect server") < log.index("stopped")
    assert "Traceback" not in log and "Error" not in log, log[-3000:]
    assert "temporary server" not in whole  # one server all along: the one `make serve` started


def test_deployment_run_without_server_is_prefects_error(tmp_path):
    env = {**isolated_env(tmp_path), "PREFECT_API_URL": f"http://127.0.0.1:{free_port()}/api"}
    proc = subprocess.run(
        ["prefect", "deployment", "run", "rlhf/ppo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert proc.returncode != 0
    assert "ConnectError" in proc.stdout + proc.stderr
