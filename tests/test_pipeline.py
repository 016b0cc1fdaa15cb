"""The DVC pipeline end to end on the `ci` profile, in a temporary git + DVC repository (real `dvc repro`)."""

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import warm
from conftest import ROOT, copy_pipeline, drawn_offline

from rlhf.tracking import logged_rows

# The tests on the module's `repo` build on each other ("after the change above"): one worker runs them in order.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pipeline")]

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
    *(f"diversity/{m}_{k}" for m in ("policy", "sft", "reference") for k in ("distinct_1", "distinct_2", "repeated")),
    "n_prompts",
}


def sh(*cmd, cwd, check=True):
    # the stages' `rlhf` commands are warm (tests/warm/); dvc, git and the rest are the venv's and the system's
    env = {**os.environ, "PATH": warm.path(f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=900)
    if check and proc.returncode:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def pipeline_repo(repo, dvc_cache, params_text: str):
    """A git + DVC repository of the project's pipeline at `repo` with `params_text` as params.yaml, reproduced."""
    repo.mkdir(parents=True, exist_ok=True)
    copy_pipeline(repo)  # the stages' code: a dep of theirs (the venv runs the same code)
    (repo / "params.yaml").write_text(params_text)
    sh("git", "init", "-q", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "empty", cwd=repo)
    sh("dvc", "init", "-q", cwd=repo)
    sh("dvc", "config", "core.analytics", "false", cwd=repo)
    sh("dvc", "config", "--local", "cache.dir", str(dvc_cache), cwd=repo)
    # the project's DVC settings, as a clone has them: its offline plots page and its plot templates
    shutil.copy(ROOT / ".dvc" / "config", repo / ".dvc" / "config")
    shutil.copy(ROOT / ".dvc" / "plots_page.html", repo / ".dvc" / "plots_page.html")
    shutil.copytree(ROOT / ".dvc" / "plots", repo / ".dvc" / "plots", dirs_exist_ok=True)
    sh("dvc", "repro", cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "ci pipeline", cwd=repo)
    return repo


def ci_params(**sections: str) -> str:
    """The project's params.yaml on the `ci` profile, W&B off, with top-level `sections` replaced (YAML flow text)."""
    text = (ROOT / "params.yaml").read_text().replace("profile: tiny ", "profile: ci   ", 1)
    sections = {"tracking": "{wandb_mode: disabled}", **sections}
    for name, value in sections.items():
        text, n = re.subn(rf"^{name}:( {{}}|\n(  .*\n)+)", f"{name}: {value}\n", text, count=1, flags=re.M)
        assert n == 1, name
    return text


@pytest.fixture(scope="module")
def repo(tmp_path_factory, dvc_cache):
    return pipeline_repo(tmp_path_factory.mktemp("pipeline"), dvc_cache, ci_params())


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
    with open(repo / "data" / "plots" / "frontier.csv") as f:
        frontier = list(csv.DictReader(f))
    # the SFT policy, the policy kept after batch 1 of 2 (train.eval_checkpoints), the final one: 8 prompts a batch
    assert [(int(r["episode"]), float(r["fraction"])) for r in frontier] == [(0, 0.0), (8, 0.5), (16, 1.0)]
    assert float(frontier[0]["kl"]) == 0.0 and float(frontier[0]["win_rate_vs_sft"]) == 0.5
    final = {k: float(v) for k, v in frontier[-1].items()}
    assert final["win_rate_vs_sft"] == ev["gold/win_rate_vs_sft"]
    assert math.isclose(final["kl"], ev["kl/policy_sft_mean"])
    for name in ("distinct_1", "distinct_2", "repeated"):
        assert final[name] == ev[f"diversity/policy_{name}"], name
    assert (repo / "data" / "train" / "frontier" / "episode-0000008" / "model.safetensors").is_file()


def test_the_metrics_are_what_the_saved_samples_and_scores_give(repo):
    """eval.json, frontier.csv and train.json recomputed here, independently, from what the stages saved: the
    responses (data/generations), their per-prompt scores (data/eval/results) and the per-batch rows (train.csv);
    the gold scores re-scored by the saved judge. A metric computed from the wrong model's rows, a win-rate that
    counts ties as wins, or a judge that is not the saved one fails here."""
    import pandas as pd

    from rlhf.data.schemas import EvalResults, Generations
    from rlhf.data.splits import load_split
    from rlhf.rewards.gold import GoldJudge

    ev = json.loads((repo / "data" / "metrics" / "eval.json").read_text())
    results = load_split(repo / "data" / "eval", "results", EvalResults)
    by = {m: g.sort_values("prompt_id").reset_index(drop=True) for m, g in results.groupby("model")}
    policy, sft = by["policy"], by["sft"]
    assert list(policy["prompt_id"]) == list(sft["prompt_id"]) and ev["n_prompts"] == len(policy)
    ties = (policy["gold"] == sft["gold"]).mean()
    assert ev["gold/win_rate_vs_sft"] == pytest.approx((policy["gold"] > sft["gold"]).mean() + 0.5 * ties)
    assert ev["gold/policy"] == pytest.approx(policy["gold"].mean()) and ev["gold/sft"] == pytest.approx(
        sft["gold"].mean()
    )
    assert ev["kl/policy_sft_mean"] == pytest.approx(policy["kl"].mean()) and (sft["kl"] == 0).all()
    assert ev["proxy/policy"] == pytest.approx(policy["proxy"].mean())
    generations = load_split(repo / "data" / "generations", "eval", Generations)
    judge = GoldJudge.load(repo / "data" / "gold")
    openings = load_split(repo / "data" / "prepared", "eval_prompts").set_index("prompt_id")["prompt"]
    for model, scored in by.items():
        texts = generations[generations["model"] == model].set_index("prompt_id").loc[scored["prompt_id"], "response"]
        prompts = list(openings.loc[scored["prompt_id"]])  # each response is judged as its prompt's continuation
        assert judge.score(prompts, list(texts)) == pytest.approx(scored["gold"].to_numpy(), abs=1e-6), model
    frontier = pd.read_csv(repo / "data" / "plots" / "frontier.csv").set_index("episode")
    kept = by["policy@8"]
    assert frontier.loc[8, "gold"] == pytest.approx(kept["gold"].mean())
    assert frontier.loc[8, "kl"] == pytest.approx(kept["kl"].mean())
    rows = pd.read_csv(repo / "data" / "plots" / "train.csv")
    train = json.loads((repo / "data" / "metrics" / "train.json").read_text())
    last = rows.iloc[len(rows) - max(1, len(rows) // 4) :]
    assert train["final/objective/scores"] == pytest.approx(last["objective/scores"].mean())
    assert train["first/objective/scores"] == pytest.approx(rows["objective/scores"].iloc[0])
    assert train["first/completions/eos_rate"] == pytest.approx(rows["completions/eos_rate"].iloc[0])


def test_a_second_repro_changes_nothing(repo):
    out = sh("dvc", "repro", cwd=repo).stdout
    assert "didn't change, skipping" in out and "Running stage" not in out
    assert sh("git", "status", "--porcelain", cwd=repo).stdout.strip() == ""


def test_dvc_plots_show_draws_every_chart_offline(repo, tmp_path):
    sh("dvc", "plots", "show", "-o", str(tmp_path / "plots"), cwd=repo)
    dom = drawn_offline(tmp_path / "plots" / "index.html", tmp_path)
    # vega-embed drew each chart as SVG: 3 line charts of train.csv, the frontier's points, the eval bar chart
    assert dom.count("<svg") >= 5, dom[:2000]
    assert dom.count('class="mark-line role-mark') >= 3 and 'class="mark-rect role-mark' in dom
    assert 'class="mark-symbol role-mark' in dom  # points: the frontier's, and the line charts' hover points
    assert dom.count("<path") > 20  # the marks have geometry


def test_the_report_stage_has_every_section_and_its_charts_load_offline(repo, tmp_path):
    """`dvc repro` ends in the report stage: its page, every section, each chart drawn (a DVC output, up to date)."""
    from rlhf.stages.report import SECTIONS

    page = repo / "data" / "report" / "index.html"
    html = page.read_text()
    assert "<h1>asyncrlhf: profile ci, trainer online_dpo</h1>" in html
    assert all(f"<h2>{title}</h2>" in html for title in SECTIONS)
    assert "Not an asynchronous run" in html  # online_dpo: the timeline section says why it has no chart
    assert "report" not in sh("dvc", "status", "report", cwd=repo).stdout  # "Data and pipelines are up to date."
    # Chromium reports each image's decoded width: a script added to a copy of the page, the network off
    probe = (
        "<script>onload = () => document.body.dataset.widths = [...document.images].map(i => i.naturalWidth)</script>"
    )
    (tmp_path / "probe.html").write_text(html.replace("</body>", probe + "</body>"))
    dom = drawn_offline(tmp_path / "probe.html", tmp_path)
    widths = re.search(r'data-widths="([\d,]*)"', dom).group(1).split(",")
    assert len(widths) == 4 and all(int(w) > 300 for w in widths), widths  # frontier, episodes, phases, off-policy


def test_changing_a_train_param_shows_in_params_and_metrics_diff(repo):
    text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(text.replace("trainer: online_dpo", "trainer: rloo", 1))
    out = sh("dvc", "repro", cwd=repo).stdout
    assert "Running stage 'train'" in out and "Running stage 'prepare'" not in out
    # the page follows the run: `dvc exp run` and `dvc repro` redraw it, no separate command to forget
    assert "Running stage 'report'" in out and "trainer rloo</h1>" in (repo / "data/report/index.html").read_text()
    params = sh("dvc", "params", "diff", "--json", cwd=repo).stdout
    assert json.loads(params)["params.yaml"]["train.trainer"] == {"old": "online_dpo", "new": "rloo"}
    metrics = json.loads(sh("dvc", "metrics", "diff", "--json", cwd=repo).stdout)
    # eval.json's results only: the stages' diagnostics are plain outs, and no run times (they change every run)
    assert set(metrics) == {"data/metrics/eval.json"} and set(metrics["data/metrics/eval.json"]) <= EVAL_KEYS
    table = sh("dvc", "metrics", "diff", "--md", cwd=repo).stdout
    assert "| data/metrics/eval.json |" in table and "nan" not in table.lower(), table


def test_dvc_plots_diff_overlays_the_workspace_and_head_offline(repo, tmp_path):
    """After the change above: one chart per plot with a line per revision, drawn with no network."""
    sh("dvc", "plots", "diff", "HEAD", "-o", str(tmp_path / "diff"), cwd=repo)
    dom = drawn_offline(tmp_path / "diff" / "index.html", tmp_path)
    assert dom.count('class="mark-line role-mark') >= 3 and 'class="mark-symbol role-mark' in dom
    assert ">workspace<" in dom and ">HEAD<" in dom  # the legend names both revisions


# The README's comparison: each experiment's trainer, profile and headline results (DVC names the columns by key).
EXP_SHOW = ["dvc", "exp", "show", "--drop", ".*", "--keep"]
EXP_SHOW += ["Experiment|profile$|train.trainer|gold/win_rate_vs_sft|kl/policy_sft_mean"]
HEADLINE = ["gold/win_rate_vs_sft", "kl/policy_sft_mean"]  # in DVC's column order
# As long as a Prefect run's experiment name can be: its run name (at most 26 characters) and a `-2` (rlhf_flow)
LONGEST_NAME = "rloo-ci-" + "x" * 20


def test_dvc_exp_show_compares_experiments_in_120_columns(repo):
    """After the change above, saved as an experiment named as long as the Prefect flow names them: a row per run,
    within a 120-column terminal (DVC folds what does not fit into "…", but never the names), both through its
    pager (the table at its own width) and without."""
    sh("dvc", "exp", "save", "-n", LONGEST_NAME, cwd=repo)
    ev = json.loads((repo / "data" / "metrics" / "eval.json").read_text())
    for pager in ([], ["--no-pager"]):
        out = sh("env", "COLUMNS=120", *EXP_SHOW, *pager, cwd=repo).stdout
        lines = out.strip("\n").splitlines()
        assert max(map(len, lines)) <= 120 and "…" not in out, out
        assert lines[1].split() == ["Experiment", *HEADLINE, "profile", "train.trainer"], out
        rows = [line.split() for line in lines[3:-1]]
        (saved,) = [row for row in rows if f"[{LONGEST_NAME}]" in row]
        values = [f"{ev[key]:.5g}" for key in HEADLINE]  # DVC's precision: 5 significant digits
        assert saved[-4:] == [*values, "ci", "rloo"], out
        assert ["ci", "online_dpo"] in [row[-2:] for row in rows], out  # the commit the experiment started from


def test_dvc_exp_apply_brings_back_an_experiments_results_and_report(repo):
    """The README's step 3 after the test above: another experiment writes its results and report over the
    workspace's; `dvc exp apply` of the saved one brings back its metrics and its page, and DVC has nothing to rerun."""
    saved = (repo / "data" / "metrics" / "eval.json").read_text()
    sh("dvc", "exp", "run", "-n", "bok-ci", "-S", "train.trainer=bok", cwd=repo)
    page = repo / "data" / "report" / "index.html"
    assert "trainer bok</h1>" in page.read_text()
    sh("dvc", "exp", "apply", LONGEST_NAME, cwd=repo)
    assert "trainer rloo</h1>" in page.read_text() and (repo / "data/metrics/eval.json").read_text() == saved
    assert "up to date" in sh("dvc", "status", cwd=repo).stdout


def test_the_math_task_end_to_end_with_dvc_repro(tmp_path, dvc_cache):
    """data.source: math through every stage of `dvc repro`: no reward model, GRPO on the rule reward scored in the
    async engine's process, accuracy / pass@k / KL from evaluate."""
    train = "{trainer: grpo, reward: rule, engine: vllm_async, score_in_engine: always}"
    sft = "{max_length: 48}"  # a problem is up to 34 word tokens here, its answer line 5, then EOS
    repo = pipeline_repo(tmp_path / "repo", dvc_cache, ci_params(data="{source: math}", sft=sft, train=train))
    metrics = {p.stem: json.loads(p.read_text()) for p in (repo / "data" / "metrics").glob("*.json")}
    assert metrics["prepare"]["split_sizes"] == {"eval_prompts": 16, "rl_prompts": 64, "sft": 400}
    assert metrics["gold"] == {"judge": "rule", "n_texts": 64, "verifier_reads_worked_answers": 1.0}
    assert metrics["reward"] == {"reward": "rule", "reward_model": None}
    assert not (repo / "data" / "reward" / "model").exists()
    ev = metrics["eval"]
    for key in ("accuracy/policy", "accuracy/sft", "pass_at_4/policy", "pass_at_4/sft", "accuracy/sft_difficulty_3"):
        assert 0.0 <= ev[key] <= 1.0, key
    assert ev["accuracy/gain"] == ev["accuracy/policy"] - ev["accuracy/sft"] and ev["n_prompts"] == 16
    rows = logged_rows(repo / "data")
    assert len(rows) == 2 and all(0.0 <= float(r["objective/gold"]) <= 1.0 for r in rows)  # the verifier's gold
    assert all(float(r["timing/scoring_engine"]) > 0 for r in rows)  # the engine process scored with the rule
    with open(repo / "data" / "plots" / "frontier.csv") as f:
        frontier = list(csv.DictReader(f))
    assert [int(r["episode"]) for r in frontier] == [0, 8, 16] and float(frontier[-1]["kl"]) == ev["kl/policy_sft_mean"]
