"""The bench scripts' command lines, run as a user runs them (a fresh `python bench/X.py`): every one answers
`--help`, and a bad value or setting is refused before any work, in one line naming it, without a traceback and
without touching a results table."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import COMMAND_TIMEOUT, ROOT

BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, f"bench/{script}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)


@pytest.mark.parametrize("script", BENCHES)
def test_every_bench_answers_help_without_running(script):
    """`--help` prints the usage and exits: a script without a parser would start measuring (one did)."""
    shown = bench(script, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith(f"usage: {script}"), shown.stdout[:500] + shown.stderr


@pytest.mark.parametrize(
    ("script", "args", "rc", "names"),
    [
        ("async_vs_sync.py", ["--seeds", "0"], 2, "argument --seeds: expected an integer >= 1, got '0'"),
        ("vs_trl.py", ["--repeats", "0"], 2, "argument --repeats"),
        ("policy_size.py", ["queue", "--jobs", "0"], 2, "argument --jobs: expected an integer >= 1, got '0'"),
        ("scaling.py", ["--batches", "8,a"], 2, "argument --batches: expected comma-separated integers > 0"),
        ("policy_size.py", ["list", "--large-sft-lr", "-1"], 2, "argument --large-sft-lr: expected a number > 0"),
        ("pipeline_costs.py", ["--runs", "dvc,nosuch"], 2, "--runs: unknown run 'nosuch'"),
        ("pipeline_costs.py", ["--profile", "nosuch"], 1, "unknown profile 'nosuch'"),  # before its minutes of clone
        ("scaling.py", ["train.nosuch=1"], 1, "train.nosuch: unknown key"),
        ("engines.py", ["--model", "no/such/folder"], 1, "no/such/folder: model folder not found"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_before_any_work(script, args, rc, names):
    before = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
    proc = bench(script, *args)
    assert proc.returncode == rc and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert names in proc.stderr and proc.stderr.startswith(("usage:", f"{script}: error:")), proc.stderr
    assert subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout == before
