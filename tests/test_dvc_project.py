"""The project's DVC settings as a plain clone has them: `dvc plots show` draws the committed plots files offline,
with no pipeline run and no .cache/ (nothing `make setup` writes)."""

import re
import shutil
import subprocess

import pytest
from conftest import ROOT, drawn_offline, isolated_env, make_dvc_repo, run_ok


def test_the_committed_plots_page_is_what_rlhf_plots_page_writes():
    from rlhf.plots_page import DEFAULT_PATH, page_template

    assert DEFAULT_PATH == ROOT / ".dvc" / "plots_page.html"  # where .dvc/config points
    assert "html_template = plots_page.html" in (ROOT / ".dvc" / "config").read_text()
    assert DEFAULT_PATH.read_text() == page_template(), "out of date: run `python -m rlhf.plots_page`"


def plain_clone(path):
    """The tracked files `dvc plots show` reads (dvc.yaml, params.yaml, .dvc/, data/plots/), as this checkout has
    them, in a git repository of their own: a clone without the pipeline's outputs, .venv/ or .cache/."""
    names = ["dvc.yaml", "params.yaml", ".dvc", "data/plots", "bench/metrics/offpolicy.csv"]
    tracked = subprocess.run(["git", "ls-files", *names], cwd=ROOT, capture_output=True, text=True, check=True)
    tracked = tracked.stdout.split()
    assert ".dvc/plots_page.html" in tracked and "data/plots/frontier.csv" in tracked
    for name in tracked:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, path / name)
    env = isolated_env(path.parent / "home")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"]):
        run_ok(cmd, path, env)
    run_ok(["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "clone"], path, env)
    return env


def test_dvc_plots_show_draws_every_chart_offline_in_a_plain_clone(tmp_path):
    clone = tmp_path / "clone"
    env = plain_clone(clone)
    run_ok(["dvc", "plots", "show", "-o", "out"], clone, env)  # the suite's dvc: isolated_env puts it first
    assert not (clone / ".cache").exists()
    dom = drawn_offline(clone / "out" / "index.html", tmp_path)
    charts = dom.split("<svg")[1:]
    assert len(charts) >= 6, dom[:2000]  # 3 over episodes, the frontier, the off-policy grid, the eval bar chart
    (frontier,) = [c for c in charts if ">gold win-rate vs SFT against KL (the frontier)<" in c]
    # axis titles with units, not column names; the win-rate axis in percent and fitted to the points, not from 0
    assert ">KL(policy || SFT), nats per response<" in frontier and ">gold win-rate vs the SFT policy<" in frontier
    ticks = re.findall(r">(\d+)%<", frontier)
    assert ticks and "0" not in ticks, ticks
    assert 'class="mark-symbol role-mark' in frontier
    # the off-policy grid's committed table (make offpolicy): a panel per algorithm, a colour per N
    (grid,) = [c for c in charts if ">off-policy grid, win-rate vs KL per algorithm (make offpolicy)<" in c]
    assert all(f">{a}<" in grid for a in ("ppo", "rloo", "online_dpo", "bok")) and ">16<" in grid


def test_each_stage_depends_on_all_the_code_it_runs():
    """DVC reruns a stage when one of its deps changes, so every rlhf module the stage's module imports (transitively,
    function-level imports included: grimp, import-linter's graph) must lie under one of its deps; else an edit there
    (a default in rlhf/config, a device rule in rlhf/runtime.py) leaves the stage's outputs stale with `dvc status`
    saying all is up to date. rlhf/cli.py only parses the command line and dispatches: not a dep."""
    import importlib.util
    from pathlib import Path

    import grimp
    import yaml

    graph = grimp.build_graph("rlhf")
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    uncovered = {}
    for name, stage in stages.items():
        assert stage["cmd"] == f"exec python -m rlhf.cli {name}"  # rlhf.stages.<name>, of the folder it runs in
        module = f"rlhf.stages.{name}"
        code = {module} | {m for m in graph.find_upstream_modules(module) if m.startswith("rlhf.")}
        files = {Path(importlib.util.find_spec(m).origin) for m in code}
        deps = [ROOT / d for d in stage["deps"]]
        missing = [f for f in files if not any(f == d or d in f.parents for d in deps)]
        if missing:
            uncovered[name] = sorted(str(f.relative_to(ROOT)) for f in missing)
    assert not uncovered, f"dvc.yaml deps miss code their stage runs: {uncovered}"


@pytest.mark.slow
def test_a_queued_experiment_runs_the_code_as_it_was_queued_with_one_thread(tmp_path, dvc_cache):
    """`dvc exp run --queue` copies the project; its stages run that copy's code, not the checkout as edited since
    (the venv's `rlhf` script would: the editable install points at the checkout), with one torch thread (queued
    experiments run side by side) and the repository's cache."""
    repo = make_dvc_repo(tmp_path / "project", cache=dvc_cache)
    env = isolated_env(tmp_path)
    params = repo / "params.yaml"
    params.write_text(re.sub(r"^profile: \S+", "profile: ci", params.read_text(), count=1, flags=re.M))
    stage = repo / "rlhf" / "stages" / "prepare.py"
    code = stage.read_text()
    report = "from rlhf import runtime; print('code as queued', runtime.threads_alone(), runtime.CACHE, flush=True)"
    stage.write_text(f"{code}\n{report}\n")
    run_ok(["git", "commit", "-qam", "ci profile, prepare says what it runs"], repo, env)
    run_ok(["dvc", "exp", "run", "--queue", "--name", "snapshot", "prepare"], repo, env)
    stage.write_text(f"{code}\n{report.replace('as queued', 'edited after')}\n")  # the user goes on working
    run_ok(["dvc", "queue", "start", "--jobs", "1"], repo, {**env, "RLHF_TORCH_THREADS": ""})
    log = run_ok(["dvc", "queue", "logs", "--follow", "snapshot"], repo, env)
    assert f"code as queued 1 {repo.resolve() / '.cache'}" in log and "edited after" not in log, log[-2000:]
    assert "snapshot" in run_ok(["dvc", "exp", "list", "--name-only"], repo, env)
