"""What the workflow costs on top of the stages: orchestration overhead of `dvc repro` and of a Prefect run,
and the peak memory (RSS) of every stage, the vLLM engine process included.

Usage:
    .venv/bin/python -m rlhf.runtime python bench/pipeline_costs.py [--profile tiny] [--runs dvc,prefect] \
        [--label LABEL] [section.key=value ...]
A throwaway clone of the project (HEAD, with the checkout's uncommitted changes to tracked files) with its
own empty DVC cache, so every stage really runs:
  prefect  a real Prefect server on 127.0.0.1 and the `rlhf` flow against it (as a deployment run executes
           it: its own clone, `dvc repro --single-item` per stage, `dvc exp save`);
  dvc      `dvc repro --force` in the clone.
Every stage process appends its own wall time (from process start) and peak RSS to a stats file
(RLHF_STAGE_STATS, rlhf/cli.py), so overhead = total wall - the stages' own time, measured in the same run.
Prints a table per run and writes bench/metrics/pipeline_costs_<profile>.json (DVC metrics): the runs made now
replace their own entries (each with the box's CPU flags and the date), the other runs' entries are kept.
Memory: `peak_rss` is the stage process, `child` its largest child (the vLLM engine when the trainer uses
one); they run at the same time, so their sum bounds the stage's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import cpu_flags, merged, run_main  # bench/ is sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # flows/
GIB = 2**30


def sh(cmd: list[str], cwd: Path, env: dict | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True)
    if proc.returncode:
        output = (proc.stdout + proc.stderr).decode(errors="replace")[-4000:]
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{output}")
    return proc.stdout.decode()


def make_project(root: Path, profile: str, overrides: list[str]) -> Path:
    """A clone of this project at HEAD + uncommitted tracked changes, params set and committed, its own (empty)
    DVC cache."""
    from flows.workspace import clone_at_head, set_params

    project = clone_at_head(ROOT, root / "project")
    set_params(project / "params.yaml", [f"profile={profile}", "tracking.wandb_mode=disabled", *overrides])
    for cmd in (
        ["git", "add", "-A"],
        ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-qm", "bench params"],
    ):
        sh(cmd, project)
    return project


def read_stats(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_dvc(project: Path, env: dict) -> float:
    start = time.perf_counter()
    sh([sys.executable, "-m", "dvc", "repro", "--force"], project, env)
    return time.perf_counter() - start


def run_prefect(project: Path, env: dict, trainer: str) -> float:
    """A real Prefect server, then the `rlhf` flow against it; returns the flow's wall time (server start-up
    excluded: a deployment run finds the server running)."""
    import socket

    from flows.deployments import start_server, stop_server, wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "RLHF_PROJECT_DIR": str(project)}
    os.environ["PREFECT_API_URL"] = env["PREFECT_API_URL"]
    server = start_server(port, project.parent / "prefect-server.log")
    try:
        wait_healthy(env["PREFECT_API_URL"], server)
        code = f"from flows.rlhf_flow import rlhf; rlhf(trainer={trainer!r}, experiment='bench-costs')"
        start = time.perf_counter()
        sh([sys.executable, "-c", code], ROOT, env)
        return time.perf_counter() - start
    finally:
        stop_server(server)


def summarise(name: str, total: float, stats: list[dict]) -> dict:
    own = sum(s["seconds"] for s in stats)
    overhead = total - own
    print(f"\n{name}: {len(stats)} stages, total {total:.1f} s, stages' own {own:.1f} s, ", end="")
    print(f"overhead {overhead:.1f} s = {100 * overhead / total:.1f}%")
    print(f"  {'stage':<10}{'seconds':>9}{'peak RSS GiB':>14}{'child GiB':>11}")
    for s in stats:
        own_gib, child_gib = s["peak_rss_bytes"] / GIB, s["peak_rss_child_bytes"] / GIB
        print(f"  {s['stage']:<10}{s['seconds']:>9.1f}{own_gib:>14.2f}{child_gib:>11.2f}")
    out = {
        f"{name}/cpu_flags": cpu_flags(),
        f"{name}/date": time.strftime("%Y-%m-%d"),
        f"{name}/total_seconds": total,
        f"{name}/stage_seconds": own,
        f"{name}/overhead_fraction": (total - own) / total,
    }
    for s in stats:
        out[f"{name}/{s['stage']}/seconds"] = s["seconds"]
        out[f"{name}/{s['stage']}/peak_rss_gib"] = s["peak_rss_bytes"] / GIB
        out[f"{name}/{s['stage']}/peak_rss_child_gib"] = s["peak_rss_child_bytes"] / GIB
    return out


def main() -> None:
    from rlhf import runtime
    from rlhf.config import load_config
    from rlhf.io import write_json

    runtime.configure()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--runs", default="prefect,dvc", help="comma-separated: prefect, dvc")
    ap.add_argument("--trainer", default=None, help="train.trainer (default: params.yaml's)")
    ap.add_argument(
        "--label",
        default="",
        help="suffix of the runs' names in the metrics (dvc-LABEL): a run under other conditions, e.g. one core",
    )
    ap.add_argument("overrides", nargs="*", help="section.key=value written into the clone's params.yaml")
    args = ap.parse_args()
    overrides = [*args.overrides, *([f"train.trainer={args.trainer}"] if args.trainer else [])]
    if unknown := [name for name in args.runs.split(",") if name not in ("prefect", "dvc")]:
        ap.error(f"--runs: unknown run {unknown[0]!r} (expected prefect or dvc)")
    load_config(ROOT / "params.yaml", args.profile, overrides)  # a bad profile or setting: refused before the clone
    tag = f"-{args.label}" if args.label else ""  # the runs' names in the metrics
    root = Path(tempfile.mkdtemp(prefix="rlhf-costs-", dir=ROOT / ".cache"))
    results = {}
    try:
        project = make_project(root, args.profile, overrides)
        trainer = yaml.safe_load((project / "params.yaml").read_text())["train"]["trainer"]
        bin_dir = str(Path(sys.executable).parent)
        for name in args.runs.split(","):
            stats_file = root / f"{name}.jsonl"
            path = bin_dir + os.pathsep + os.environ["PATH"]
            env = {**os.environ, "RLHF_STAGE_STATS": str(stats_file), "PATH": path}
            if name == "dvc":
                total = run_dvc(project, env)
            else:
                total = run_prefect(project, env, trainer)
            results.update(summarise(name + tag, total, read_stats(stats_file)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nprofile {args.profile}, trainer {trainer}, overrides {overrides or 'none'}")
    suffix = f"_{args.trainer}" if args.trainer else ""
    path = ROOT / "bench" / "metrics" / f"pipeline_costs_{args.profile}{suffix}.json"
    write_json(
        path, merged(path, results, [name + tag for name in args.runs.split(",")])
    )  # a dvc run alone keeps the Prefect run's


if __name__ == "__main__":
    sys.exit(run_main(main))
