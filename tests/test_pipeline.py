"""The DVC pipeline end to end on the `ci` profile, in a temporary git + DVC repository (real `dvc repro`)."""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow

EVAL_KEYS = {
    "gold/win_rate_vs_sft",
    "gold/win_rate_vs_reference",
    "gold/sft_win_rate_vs_reference",
    "gold/policy",
    "gold/sft",
    "gold/reference",
    "kl/policy_sft_mean",
    "kl/policy_sft_std",
    "proxy/policy",
    "proxy/sft",
    "n_prompts",
}


def sh(*cmd, cwd, check=True):
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="module")
def repo(tmp_path_factory, dvc_cache):
    repo = tmp_path_factory.mktemp("pipeline")
    for name in ("dvc.yaml", ".gitignore", ".dvcignore"):
        shutil.copy(ROOT / name, repo / name)
    # the stages depend on their code (dvc.yaml deps): the repo carries a copy, the venv runs the same code
    shutil.copytree(ROOT / "rlhf", repo / "rlhf", ignore=shutil.ignore_patterns("__pycache__"))
    text = (ROOT / "params.yaml").read_text().replace("profile: tiny ", "profile: ci   ", 1)
    (repo / "params.yaml").write_text(text.replace("tracking: {}", "tracking: {wandb_mode: disabled}"))
    sh("git", "init", "-q", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "empty", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    sh("dvc", "config", "core.analytics", "false", cwd=repo)
    sh("dvc", "config", "--local", "cache.dir", str(dvc_cache), cwd=repo)
    sh("dvc", "repro", cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "ci pipeline", cwd=repo)
    return repo


def test_metrics_files_have_their_keys_and_sane_values(repo):
    metrics = {p.stem: json.loads(p.read_text()) for p in (repo / "data" / "metrics").glob("*.json")}
    assert set(metrics) == {"prepare", "gold", "sft", "reward", "train", "eval"}
    ev = metrics["eval"]
    assert set(ev) == EVAL_KEYS
    for key in EVAL_KEYS - {"n_prompts", "kl/policy_sft_mean", "kl/policy_sft_std", "proxy/policy", "proxy/sft"}:
        assert 0.0 <= ev[key] <= 1.0, key
    assert all(math.isfinite(v) for v in ev.values())
    assert ev["kl/policy_sft_std"] >= 0
    assert 0.5 <= metrics["gold"]["accuracy"] <= 1.0
    assert 0.0 <= metrics["reward"]["agreement_heldout"] <= 1.0


def test_a_second_repro_changes_nothing(repo):
    out = sh("dvc", "repro", cwd=repo).stdout
    assert "didn't change, skipping" in out and "Running stage" not in out
    assert sh("git", "status", "--porcelain", cwd=repo).stdout.strip() == ""


def test_changing_a_train_param_shows_in_params_and_metrics_diff(repo):
    text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(text.replace("trainer: online_dpo", "trainer: rloo", 1))
    out = sh("dvc", "repro", cwd=repo).stdout
    assert "Running stage 'train'" in out and "Running stage 'prepare'" not in out
    params = sh("dvc", "params", "diff", "--json", cwd=repo).stdout
    assert json.loads(params)["params.yaml"]["train.trainer"] == {"old": "online_dpo", "new": "rloo"}
    metrics = json.loads(sh("dvc", "metrics", "diff", "--json", cwd=repo).stdout)
    assert "data/metrics/train.json" in metrics
