"""`rlhf report` and the Prefect headline table: what a person reads first about a run.

A real git checkout with the project's params.yaml and hand-written metrics files (no stage runs: seconds)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import COMMAND_TIMEOUT, PARAMS

EVAL = {
    "gold/policy": 0.7117129186734505,
    "gold/sft": 0.551503217696538,
    "gold/win_rate_vs_sft": 0.7041015625,
    "kl/policy_sft_mean": 5.029486656188965,
    "n_prompts": 512,
    "proxy/policy": 1.9993816640853882,  # reads 2.00 (three digits), not 2 beside a neighbour's 2.01
}
# Training order (episode) is not KL order: the 50% policy drifted less than the 25% one.
FRONTIER = pd.DataFrame(
    {
        "episode": [0, 8, 16, 24],
        "fraction": [0.0, 0.25, 0.5, 1.0],
        "kl": [0.0, 3.0, 2.0, 4.0],
        "win_rate_vs_sft": [0.5, 0.6, 0.55, 0.7],
    }
)


@pytest.fixture
def checkout(tmp_path):
    """A git checkout at one commit holding params.yaml (profile ci, trainer rloo, two settings changed on top)."""
    text = PARAMS.read_text().replace("profile: tiny", "profile: ci", 1).replace("trainer: online_dpo", "trainer: rloo")
    (tmp_path / "params.yaml").write_text(text.replace("eval: {}", "eval:\n  max_new_tokens: 9", 1))
    (tmp_path / "code.py").write_text("x = 1\n")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", *cmd], cwd=tmp_path, check=True)
    (tmp_path / "data" / "metrics").mkdir(parents=True)
    (tmp_path / "data" / "plots").mkdir()
    (tmp_path / "data" / "metrics" / "eval.json").write_text(json.dumps(EVAL))
    FRONTIER.to_csv(tmp_path / "data" / "plots" / "frontier.csv", index=False)
    return tmp_path


def report(cwd) -> str:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "rlhf.cli", "report"]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_report_header_names_date_commit_profile_trainer_and_changed_parameters(checkout):
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    out = report(checkout)
    assert re.search(r"^date: \d{4}-\d\d-\d\d \d\d:\d\d UTC$", out, re.M), out
    assert f"commit: {head.stdout.strip()}\n" in out  # params.yaml and data/ are the run's, not code changes
    assert "profile: ci\ntrainer: rloo\n" in out
    assert "note: profile ci: a plumbing check" in out and "numbers are not meaningful" in out
    changed = re.search(r"^changed parameters: (.*)$", out, re.M).group(1)
    assert changed.startswith("eval.max_new_tokens=9 (profile: ") and "train.trainer" not in changed, changed
    page = (checkout / "data" / "report" / "index.html").read_text()
    assert "<th>commit</th>" in page and "plumbing check" in page and "eval.max_new_tokens=9" in page
    (checkout / "code.py").write_text("x = 2\n")
    assert f"commit: {head.stdout.strip()} + changes\n" in report(checkout)


def test_headline_table_has_a_header_row_units_meanings_and_three_digits(checkout):
    report(checkout)
    page = (checkout / "data" / "report" / "index.html").read_text()
    assert "<tr><th>stage</th><th>metric</th><th>value</th><th>unit</th><th>meaning</th></tr>" in page
    row = "<tr><td>eval</td><td>gold win-rate vs SFT</td><td>0.704</td><td>share of eval prompts</td><td>"
    assert row in page and "<td>KL to SFT</td><td>5.03</td><td>nats/sequence</td>" in page
    assert "<td>train</td><td>(not run)</td>" in page  # a stage's metrics missing: said, not a crash
    assert "Not run yet: `make offpolicy`" in page  # no bench/metrics/offpolicy.csv in this checkout
    assert "<td>proxy reward, policy</td><td>2.00</td>" in page
    assert "0.7041" not in page


def test_frontier_joins_points_in_training_order_and_names_them_in_a_legend():
    from matplotlib.figure import Figure

    from rlhf.stages.report import _frontier_chart

    ax = Figure().subplots()
    _frontier_chart(ax, FRONTIER.sort_values("kl"))  # frontier.csv's row order is no promise
    assert list(ax.lines[0].get_xdata()) == [0.0, 3.0, 2.0, 4.0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["SFT (episode 0)", "episode 8 (25% of the run)", "episode 16 (50% of the run)",
                      "episode 24 (100% of the run)"]  # fmt: skip
    assert not ax.texts  # no labels beside the points to overlap


def test_prefect_headline_artifact_rows_are_rounded_with_meanings():
    from flows.rlhf_flow import _rounded, headline_table

    rows = headline_table(EVAL)
    assert [r["metric"] for r in rows] == [
        "gold win-rate vs SFT",
        "gold score, policy",
        "gold score, SFT",
        "KL to SFT",
        "proxy reward, policy",
        "eval prompts",
    ]
    assert rows[0] == {
        "metric": "gold win-rate vs SFT",
        "value": "0.704",
        "unit": "share of eval prompts",
        "meaning": "gold prefers the policy's answer to SFT's (0.5: even)",
    }
    assert [r["value"] for r in rows[1:]] == ["0.712", "0.552", "5.03", "2.00", "512"]
    assert all(r["meaning"] for r in rows)
    assert (_rounded("4.272078037261963"), _rounded("16"), _rounded("ppo")) == (4.27, 16, "ppo")


def test_ci_profile_says_it_is_a_plumbing_check():
    from rlhf.config import profile_note

    assert profile_note("ci") == (
        "profile ci: a plumbing check (micro sizes, seconds per stage): its numbers are not meaningful"
    )
    assert profile_note("tiny") is None


def test_report_outside_a_git_checkout_says_so(checkout):
    shutil.rmtree(checkout / ".git")
    assert "commit: unknown (not a git checkout)" in report(checkout)
