"""`make offpolicy` (bench/offpolicy.py): every point of the grid is a valid run, the verdict follows the rule fixed
in advance, and points go through DVC's own experiment queue into `dvc exp show`, the tables and the figure."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import PARAMS, isolated_env, make_dvc_repo, run_ok

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import dvc_points  # noqa: E402
import offpolicy  # noqa: E402


def test_every_point_is_a_valid_run_of_its_own_seed_and_the_grid_is_the_papers():
    from rlhf.config import load_config

    points = offpolicy.points()
    grid = {(s[0], s[1]) for s in points.values() if len(s) == 3}
    assert len(grid) == 4 * 3 and len([s for s in points.values() if len(s) == 3]) == 4 * 3 * 2
    for name, settings in points.items():
        cfg = load_config(PARAMS, "tiny", settings)  # a point the config refuses fails here, not an hour in
        assert cfg.train.seed in (1, 2) and cfg.rl_seed == cfg.train.seed, name
    stalest = load_config(PARAMS, "tiny", points["op-async-rloo-S4-tis-s1"]).train
    assert (stalest.engine, stalest.max_staleness, stalest.tis_cap) == ("vllm_async", 4, offpolicy.TIS_CAP)


def _final(rates: dict[tuple[str, int, int], float], fraction: float = 1.0) -> pd.DataFrame:
    """Kept policies (the final ones by default) with these win-rates, keyed (algorithm, N, seed)."""
    rows = [
        dict(
            point=f"{a}-{n}-{s}",
            algorithm=a,
            N=n,
            S=0,
            tis_cap=float("nan"),
            seed=s,
            episode=round(64 * fraction),
            fraction=fraction,
            kl=1.0,
            win_rate_vs_sft=w,
        )
        for (a, n, s), w in rates.items()
    ]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("dpo_at_16, verdict", [(0.68, "holds"), (0.58, "does not hold")])
def test_the_verdict_is_the_rule_fixed_in_advance(dpo_at_16, verdict):
    # at N = 1 every algorithm gains 0.2 over SFT; at N = 16 PPO keeps 0.10 (0.09, 0.11: spread 0.05 of retention)
    rates = {(a, 1, s): 0.7 for a in ("ppo", "online_dpo") for s in (1, 2)}
    rates |= {("ppo", 16, 1): 0.59, ("ppo", 16, 2): 0.61, ("online_dpo", 16, 1): dpo_at_16}
    rates[("online_dpo", 16, 2)] = dpo_at_16
    text = offpolicy.tables(_final(rates))
    assert f"claim (online DPO the most robust) {verdict} by the rule" in text
    assert "| ppo | 16 | 0.600 | 0.590, 0.610 | 1.00 |" in text


@pytest.mark.parametrize("seeds", [(3, 4), (1, 2)])
@pytest.mark.parametrize("dpo_at_half, verdict", [(0.66, "holds"), (0.6, "does not hold")])
def test_the_second_rule_reads_the_early_kept_policies_and_names_the_seeds(seeds, dpo_at_half, verdict):
    # at 25% online DPO keeps 0.18 of 0.2, PPO 0.1; at 50% PPO keeps 0.14 (0.13, 0.15) and online DPO dpo_at_half - 0.5
    early = {(a, 1, s): 0.7 for a in ("ppo", "online_dpo") for s in seeds}
    quarter = early | {("ppo", 16, s): 0.6 for s in seeds} | {("online_dpo", 16, s): 0.68 for s in seeds}
    half = early | {("ppo", 16, seeds[0]): 0.63, ("ppo", 16, seeds[1]): 0.65}
    half |= {("online_dpo", 16, s): dpo_at_half for s in seeds}
    frames = [_final(quarter, 0.25), _final(half, 0.5), _final(half, 1.0)]
    text = offpolicy.tables(pd.concat(frames, ignore_index=True))
    assert "| 25% | 0.50 | 0.90 | online_dpo: 0.40, 0.00 |" in text
    sentence = f"the paper's claim {verdict} on seeds {seeds[0]}, {seeds[1]}"
    assert (
        sentence + (" (seeds 1 and 2 suggested the rule: this is no test of it)." if seeds == (1, 2) else ".") in text
    )
    assert "No verdict by the second rule" in offpolicy.tables(_final(half, 1.0))  # no early kept policies


@pytest.mark.slow
def test_points_run_through_the_dvc_queue_once_and_reach_the_tables(tmp_path, dvc_cache):
    repo = make_dvc_repo(tmp_path / "project", cache=dvc_cache)
    env = isolated_env(tmp_path)
    params = repo / "params.yaml"
    params.write_text(re.sub(r"^profile: \S+", "profile: ci", params.read_text(), count=1, flags=re.M))
    run_ok(["git", "commit", "-qam", "ci profile"], repo, env)
    script = [sys.executable, str(ROOT / "bench" / "offpolicy.py")]
    only = ["--only", "op-online_dpo-n4-s1"]  # one point: the whole pipeline runs in it (~1 min)
    first = run_ok([*script, "queue", "--jobs", "1", *only], repo, env)
    assert "1 points, 0 done, 1 to queue" in first and "0 point(s) failed" in first
    again = run_ok([*script, "queue", *only], repo, env)  # a point that ran is not queued twice
    assert "1 points, 1 done, 0 to queue" in again
    shown = json.loads(run_ok(["dvc", "exp", "show", "--json"], repo, env))
    names = {r["name"] for c in shown for e in c.get("experiments") or [] for r in e["revs"]}
    assert "op-online_dpo-n4-s1" in names
    # the project carries the committed grid (a dep of the report stage): its points are not this project's runs
    kept = subprocess.run([*script, "report", *only], cwd=repo, env=env, capture_output=True, text=True)
    assert kept.returncode == 1 and "point(s) not among this project's finished experiments" in kept.stderr
    # the finished point is kept in bench/metrics/points/: with its experiment gone (a new clone), it is still done
    kept_lock = repo / "bench" / "metrics" / "points" / "op-online_dpo-n4-s1" / "dvc.lock"
    assert "md5:" in kept_lock.read_text()
    wins = pd.read_csv(kept_lock.with_name("prompt_wins.csv"), index_col="prompt_id")  # from the DVC cache
    final = pd.read_csv(kept_lock.parent / "data" / "plots" / "frontier.csv").iloc[-1]
    assert wins["policy"].isin([0, 0.5, 1]).all() and wins["policy"].mean() == final["win_rate_vs_sft"]
    run_ok(["dvc", "exp", "remove", "op-online_dpo-n4-s1"], repo, env)
    assert "1 points, 1 done, 0 to queue" in run_ok([*script, "queue", *only], repo, env)
    report = run_ok([*script, "report", "--replace", *only], repo, env)
    assert "| online_dpo | 4 |" in report and "1 of 1 points" in report and "No verdict" in report
    frame = pd.read_csv(repo / "bench" / "metrics" / "offpolicy.csv")
    assert set(frame["N"]) == {4} and set(frame["seed"]) == {1} and (frame["fraction"] == 1.0).sum() == 1
    assert frame["win_rate_vs_sft"].between(0, 1).all()
    assert (repo / "bench" / "metrics" / "offpolicy.png").read_bytes()[:4] == b"\x89PNG"
    assert subprocess.run([*script, "queue", "--only", "op-nope"], cwd=repo, env=env).returncode != 0


def test_points_trained_on_other_inputs_are_refused_naming_two_of_them(monkeypatch):
    """A point queued after a change to the stages' code rebuilt the SFT policy (one thread: other rounding): its
    results are not comparable with the points before it (seen 2026-11-28, bench/rm_size.py). A bench that varies a
    stage on purpose (the policy's size) says by what; every other stage must be the same for all points."""
    hashes = {
        "ps-small-1": {"prepare": "p.dir", "sft": "small.dir", "reward": "rm-small.dir"},
        "ps-small-2": {"prepare": "p.dir", "sft": "small.dir", "reward": "rm-small.dir"},
        "ps-large-1": {"prepare": "p.dir", "sft": "large.dir", "reward": "rm-large.dir"},
        "rs-late-1": {"prepare": "p.dir", "sft": "small-rebuilt.dir", "reward": "rm-small.dir"},
    }
    monkeypatch.setattr(dvc_points, "input_hashes", lambda rev: hashes[rev])
    exps = {name: name for name in hashes}  # name -> revision (input_hashes reads it)
    size = {"sft": lambda n: n.split("-")[1], "reward": lambda n: n.split("-")[1]}
    dvc_points.check_same_inputs(exps, {n: [] for n in ("ps-small-1", "ps-small-2", "ps-large-1")}, size)
    with pytest.raises(SystemExit, match=r"points ps-small-1 and ps-large-1 trained on other `sft` outputs"):
        dvc_points.check_same_inputs(exps, {n: [] for n in ("ps-small-1", "ps-large-1")})  # nothing varied
    with pytest.raises(SystemExit, match=r"ps-small-1 and rs-late-1 trained on other `sft` outputs \(small\.d"):
        dvc_points.check_same_inputs(exps, {n: [] for n in ("ps-small-1", "rs-late-1")}, {"reward": size["reward"]})
    dvc_points.check_same_inputs(exps, {"ps-small-1": [], "not-run-yet": []})  # a point not run yet is not read


def test_no_point_is_queued_from_a_stale_dvc_lock_once_points_have_run(monkeypatch):
    """Queued from a workspace whose sft stage is not what dvc.lock records, every new point would rebuild it and be
    refused by check_same_inputs an hour later: refused at once instead, before anything is queued."""
    calls = []

    def dvc(*args):
        calls.append(args)
        return json.dumps({"sft": [{"changed deps": {"rlhf/runtime.py": "modified"}}], "train": []})

    monkeypatch.setattr(dvc_points, "dvc", dvc)
    monkeypatch.setattr(dvc_points, "experiments", lambda: {"op-a": "rev"})
    monkeypatch.setattr(dvc_points, "keep", lambda exps, pts: None)  # "rev" is no commit to copy from
    monkeypatch.setattr(dvc_points, "queued", set)
    with pytest.raises(SystemExit, match=r"offpolicy: sft: not what dvc.lock records .* unlike the 1 already run"):
        dvc_points.queue({"op-a": [], "op-b": ["train.seed=2"]}, jobs=1)
    assert calls == [("status", "--json")]  # nothing queued
    # points that build every stage themselves (bench/pipeline_seeds.py: a seed each) share none: queued
    monkeypatch.setattr(dvc_points, "start_workers", lambda jobs: None)
    calls.clear()
    assert dvc_points.queue({"op-a": [], "op-b": ["seed=2"]}, jobs=1, shared=()) == 1  # op-b: not run here
    assert calls[0][:3] == ("exp", "run", "--queue") and ("status", "--json") not in calls


@pytest.mark.parametrize(
    ("waiting", "workers", "restarts"),
    [
        ({"op-a"}, 0, 2),  # `dvc queue stop` ended them: the point would wait forever (seen 2026-11-28)
        ({"op-a", "op-b"}, 1, 2),  # one ended with a point still queued: it waited out the other's run (seen too)
        ({"op-a", "op-b"}, 2, 0),  # as many as asked for
        ({"op-a"}, 1, 0),  # one point left, one worker on it
    ],
)
def test_waiting_points_get_workers_again_when_fewer_run_than_asked_for(monkeypatch, waiting, workers, restarts):
    """After two polls with fewer queue workers than min(jobs, points waiting or running), workers are started
    again (`dvc queue start --jobs J` tops them up to J)."""
    polls = iter([waiting] * 5 + [set()])
    started = []
    monkeypatch.setattr(dvc_points, "experiments", lambda: dict.fromkeys(waiting, "rev") if started else {})
    monkeypatch.setattr(dvc_points, "queued", lambda: next(polls) if started else set())
    monkeypatch.setattr(dvc_points, "dvc", lambda *args: "")  # `dvc exp run --queue`: queued
    monkeypatch.setattr(dvc_points, "queue_workers", lambda: workers)
    monkeypatch.setattr(dvc_points, "keep", lambda exps, pts: None)  # "rev" is no commit to copy from
    monkeypatch.setattr(dvc_points, "start_workers", started.append)
    monkeypatch.setattr(dvc_points.time, "sleep", lambda seconds: None)
    assert dvc_points.queue(dict.fromkeys(waiting, []), jobs=2) == 0
    assert started == [2] * (1 + restarts)  # at the start, then after polls 2 and 4 short of workers


def test_a_report_keeps_the_points_its_committed_tables_hold_unless_told(monkeypatch, tmp_path):
    """bench/metrics/offpolicy*.csv are committed results, run on another machine: a report over the two points a
    fresh clone ran replaced them silently (seen 2026-11-28, `report --seeds 3,4`). It now refuses, naming one."""
    monkeypatch.setattr(offpolicy, "OUT", tmp_path)
    held = _final({("ppo", 1, 1): 0.7, ("ppo", 16, 1): 0.6})
    held.to_csv(tmp_path / "offpolicy.csv", index=False)
    ran_here = held[held["point"] == "ppo-1-1"]
    monkeypatch.setattr(dvc_points, "frontier_rows", lambda exps, pts: ran_here)
    with pytest.raises(SystemExit, match=r"holds 1 point\(s\) not among .* \(e\.g\. ppo-16-1\).*report --replace"):
        offpolicy.report({}, {})
    assert len(pd.read_csv(tmp_path / "offpolicy.csv")) == 2 and not (tmp_path / "offpolicy.md").exists()
    assert offpolicy.report({}, {}, replace=True) == 0
    assert list(pd.read_csv(tmp_path / "offpolicy.csv")["point"]) == ["ppo-1-1"]


def test_a_kept_point_is_read_like_its_commit_and_a_half_copied_one_is_not_kept(tmp_path):
    """bench/archive.py: a finished point's metrics, plots and dvc.lock outputs, copied from its experiment commit,
    read back as that commit would give them; a copy cut short (no dvc.lock yet) is no kept point."""
    import archive

    env = isolated_env(tmp_path)
    repo = tmp_path / "repo"
    files = {
        "data/metrics/eval.json": '{"win_rate_vs_sft": 0.7}\n',
        "data/plots/frontier.csv": "episode,fraction,kl,win_rate_vs_sft\n0,0.0,0.0,0.5\n",
        "dvc.lock": "schema: '2.0'\nstages:\n  sft:\n    cmd: python -m rlhf.stages.sft\n    deps: []\n"
        "    outs:\n    - path: data/sft\n      hash: md5\n      md5: abc.dir\n      size: 3\n",
        "rlhf/big.py": "not a result\n",
    }
    for path, text in files.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    run_ok(["git", "init", "-q"], repo, env)
    run_ok(["git", "add", "-A"], repo, env)
    run_ok(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "point"], repo, env)
    rev = run_ok(["git", "rev-parse", "HEAD"], repo, env).strip()
    kept = tmp_path / "points"
    assert archive.keep(repo, kept, {"op-a": rev, "op-b": "kept:op-b"}, ["op-a", "op-b", "op-c"]) == ["op-a"]
    assert archive.revisions(kept) == {"op-a": "kept:op-a"}
    assert archive.read(kept, "kept:op-a", "data/plots/frontier.csv") == files["data/plots/frontier.csv"]
    assert archive.read(kept, rev, "data/metrics/eval.json") is None  # a Git revision: git show's to read
    assert not (kept / "op-a" / "rlhf").exists()  # only what a report reads
    lock = archive.read(kept, "kept:op-a", "dvc.lock")
    assert "abc.dir" in lock and "cmd" not in lock
    assert archive.keep(repo, kept, {"op-a": rev}, ["op-a"]) == []  # kept once
    (kept / "op-d" / "data" / "metrics").mkdir(parents=True)  # cut short before its dvc.lock
    assert set(archive.revisions(kept)) == {"op-a"}
