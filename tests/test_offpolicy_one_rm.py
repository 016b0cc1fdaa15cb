"""bench/offpolicy_one_rm.py (issue 57 item 2): its points are the grid's settings with new seeds, and its rules read
as its docstring fixed them before any point ran: checked on synthetic frames where the answer is known."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
from conftest import PARAMS

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import offpolicy  # noqa: E402
import offpolicy_one_rm as grid  # noqa: E402

FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def test_the_points_are_the_grids_settings_with_seeds_no_earlier_run_used():
    from rlhf.config import load_config

    points = grid.points()
    assert len(points) == 4 * 3 * 4 and set(grid.SEEDS).isdisjoint({1, 2, 3, 4})
    old = offpolicy.points((5,))
    assert all(old[name.replace("og-", "op-")] == settings for name, settings in points.items() if name.endswith("s5"))
    cfg = load_config(PARAMS, "tiny", points["og-online_dpo-n16-s8"])
    assert (cfg.train.num_mini_batches, cfg.train.seed, cfg.train.eval_checkpoints) == (16, 8, list(FRACTIONS))


def _kept(slopes: dict[tuple[str, int], float], reach: dict[tuple[str, int], float]) -> pd.DataFrame:
    """Four seeds alike, every algorithm and N; at fraction f a policy sits at KL reach*f and win-rate
    0.5 + slope*KL (so N's loss at equal KL is (slope(1) - slope(N)) x its KL)."""
    rows = []
    for (a, n), slope in slopes.items():
        for seed in grid.SEEDS:
            for f in FRACTIONS:
                kl = reach[(a, n)] * f
                rows.append(dict(algorithm=a, N=n, seed=seed, fraction=f, kl=kl, win_rate_vs_sft=0.5 + slope * kl))
    return pd.DataFrame(rows)


def _grid(dpo16: float) -> pd.DataFrame:
    """Every algorithm on the same N = 1 frontier (slope 0.05); off-policy, PPO/RLOO/BoK lose slope, online DPO's
    N = 16 slope is `dpo16`."""
    slopes, reach = {}, {}
    for a in offpolicy.ALGORITHMS:
        for n in grid.MINI_BATCHES:
            slopes[(a, n)] = 0.05 if n == 1 else 0.02
            reach[(a, n)] = 4.0
        slopes[(a, 16)] = dpo16 if a == "online_dpo" else 0.02
    return _kept(slopes, reach)


def test_rule_one_names_online_dpo_only_when_its_off_policy_frontier_stays_on_the_on_policy_one():
    held = grid.rule_one(_grid(dpo16=0.05))[-1]
    assert "smallest loss at N = 16 is online_dpo's (+0.000" in held and "holds by R1" in held, held
    failed = grid.rule_one(_grid(dpo16=0.02))[-1]  # every algorithm loses alike: no lead
    assert "does not hold by R1" in failed, failed
    lines = grid.rule_one(_grid(dpo16=0.05))
    assert any(line.startswith("| ppo | +0.075 | +0.075 | False |") for line in lines), lines  # 0.03 x 2.5 nats


def test_rule_one_is_not_testable_when_off_policy_runs_reach_past_the_on_policy_frontier():
    frame = _grid(dpo16=0.05)
    frame.loc[frame["N"] > 1, "kl"] += 100  # every off-policy policy beyond N = 1's largest KL
    assert "R1: not testable" in grid.rule_one(frame)[-1]


def test_rule_two_needs_online_dpo_ahead_at_every_kept_policy():
    held = grid.rule_two(_grid(dpo16=0.05))
    assert held[-1].endswith("claim holds by R2 (online DPO the most retained at 25%, 50% and 100%, each time by more "
                             "than the seeds' spread).")  # fmt: skip
    assert all(line.endswith("| yes |") for line in held[2:5])
    assert "does not hold" in grid.rule_two(_grid(dpo16=0.02))[-1]


def test_the_smollm2_half_is_the_same_algorithms_at_n_1_and_16_on_the_profiles_seeds_and_kept_policies():
    from rlhf.config import load_config
    from rlhf.trainers.setup import Sizes

    points = grid.SMOLLM2.points()
    assert len(points) == 4 * 2 * 2 and all(name.startswith("og-smol-") for name in points)
    settings = points["og-smol-ppo-n16-s1235"]
    cfg = load_config(PARAMS, None, settings)  # the profile comes from the settings, as `-S profile=...` does
    assert (cfg.profile, cfg.train.trainer, cfg.train.num_mini_batches, cfg.train.seed) == ("smollm2", "ppo", 16, 1235)
    assert tuple(cfg.train.eval_checkpoints) == grid.SMOLLM2.kept and cfg.data.n_eval_prompts == 128
    sizes = Sizes.derive(cfg.train, 1)  # 16 mini-batches of 8 prompts a generated batch: sizes that divide
    assert (sizes.local_batch, sizes.num_batches) == (128, 2)  # the same 32 updates as N = 1's 32 batches
    assert "train.eval_checkpoints" not in " ".join(settings)  # N = 16: the profile's 50% and 100%
    from rlhf.trainers.frontier import frontier_batches

    on_policy = load_config(PARAMS, None, points["og-smol-online_dpo-n1-s1234"]).train
    assert on_policy.eval_checkpoints == [0.125, 0.25, 0.5, 1.0]  # N = 1's frontier: where N = 16's policies sit too
    assert frontier_batches(on_policy.eval_checkpoints, Sizes.derive(on_policy, 1).num_batches) == {4, 8, 16}
    assert all("eval_checkpoints" not in " ".join(s) for s in grid.TINY.points().values())  # tiny's ran as they were


def test_the_smollm2_rules_read_its_n_values_and_kept_policies():
    fractions = grid.SMOLLM2.kept
    rows = []
    for a in offpolicy.ALGORITHMS:
        for n in grid.SMOLLM2.mini_batches:
            slope = 0.05 if n == 1 or a == "online_dpo" else 0.02
            for seed in grid.SMOLLM2.seeds:
                for f in fractions:
                    rows.append(
                        dict(algorithm=a, N=n, seed=seed, fraction=f, kl=4 * f, win_rate_vs_sft=0.5 + slope * 4 * f)
                    )
    kept = pd.DataFrame(rows)
    one = grid.rule_one(kept, grid.SMOLLM2)
    assert one[0] == "| algorithm | loss at equal KL, N = 16 | robust at 16 (<= MARGIN) |" and "holds by R1" in one[-1]
    two = grid.rule_two(kept, grid.SMOLLM2)
    assert "holds by R2 (online DPO the most retained at 50% and 100%, each time" in two[-1] and len(two) == 2 + 2 + 2
    assert any("+-0.061 |" in line for line in grid.win_table(kept, grid.SMOLLM2))  # 1.96 sqrt(.25 / 128) / sqrt(2)


def test_bootstrap_intervals_resample_the_prompts_alike_for_every_point_and_need_every_points_outcomes(monkeypatch):
    """Intervals over eval prompts from each point's per-prompt outcomes (bench/archive.py's WINS): one resample of
    the prompts shared by every row, so two points with the same outcomes move together; no intervals when a point's
    outcomes are missing or do not give its win-rate (another eval set)."""
    import numpy as np

    rng = np.random.default_rng(1)
    wins = {p: pd.DataFrame({"policy@2": rng.integers(0, 3, 64) / 2, "policy": rng.integers(0, 3, 64) / 2})
            for p in ("a", "b")}  # fmt: skip
    wins["c"] = wins["a"].copy()
    rows = [dict(point=p, algorithm=p, N=1, seed=5, fraction=f, episode=e, kl=f, win_rate_vs_sft=wins[p][m].mean())
            for p in wins for f, e, m in ((0.5, 2, "policy@2"), (1.0, 4, "policy"))]  # fmt: skip
    kept = pd.DataFrame(rows)
    monkeypatch.setattr(grid.archive, "wins_of", lambda root, folder, rev: wins.get(rev))
    outcomes = grid.prompt_outcomes(kept, {p: p for p in wins})
    assert outcomes.shape == (6, 64)
    draws = grid.resampled_win_rates(outcomes, resamples=400)
    assert draws.shape == (400, 6) and (draws[:, 0] == draws[:, 4]).all()  # a and c: the same outcomes, resample
    assert abs(draws.mean(0) - kept["win_rate_vs_sft"]).max() < 0.02
    line = next(x for x in grid.win_table(kept, grid.TINY, draws) if x.startswith("| a | 1 | 50% |"))
    low, high = (float(v) for v in line.split("| [")[1].split("]")[0].split(", "))
    assert low < kept.loc[0, "win_rate_vs_sft"] < high and 0.1 < high - low < 0.4  # ~ +-1.96 x 0.5 / 8
    assert grid.prompt_outcomes(kept, {"a": "a", "b": "missing", "c": "c"}) is None
    wins["b"] = wins["b"].assign(policy=0.5)  # not the win-rate the point logged
    assert grid.prompt_outcomes(kept, {p: p for p in wins}) is None


def test_the_smollm2_grid_queues_with_two_threads_and_not_beside_other_workers(monkeypatch):
    """Its points' rounding depends on the stages' torch threads: every point runs with two, in every sitting, so
    `queue` sets RLHF_TORCH_THREADS for the workers it starts, and refuses where workers already run (they keep
    their own) or the environment asks for other threads."""
    import os

    import pytest

    monkeypatch.setattr(grid.dvc_points, "queue_workers", lambda: 1)
    monkeypatch.delenv("RLHF_TORCH_THREADS", raising=False)
    with pytest.raises(SystemExit, match=r"1 DVC queue worker\(s\) running"):
        grid.use_threads(grid.SMOLLM2.threads)
    monkeypatch.setattr(grid.dvc_points, "queue_workers", lambda: 0)
    monkeypatch.setenv("RLHF_TORCH_THREADS", "1")
    with pytest.raises(SystemExit, match="RLHF_TORCH_THREADS=2, not the environment's"):
        grid.use_threads(grid.SMOLLM2.threads)
    monkeypatch.delenv("RLHF_TORCH_THREADS")
    grid.use_threads(grid.SMOLLM2.threads)
    assert os.environ["RLHF_TORCH_THREADS"] == "2" and grid.TINY.threads is None


def test_r1_dense_reads_the_grids_n1_runs_again_kept_early_and_checks_they_are_the_same_runs():
    """R1-dense: the grid's N = 1 runs with their policies also kept at batches 2-12 of 64; its N = 1 frontier from
    them, the grid's N > 1 policies as they are; void unless its 25-100% policies are the grid's own."""
    from rlhf.config import load_config
    from rlhf.trainers.frontier import frontier_batches
    from rlhf.trainers.setup import Sizes

    dense = grid.TINY_FRONTIER.points()
    assert len(dense) == 4 * 4 and all("-n1-" in name and name.startswith("og-front-") for name in dense)
    cfg = load_config(PARAMS, "tiny", dense["og-front-rloo-n1-s7"]).train
    base = load_config(PARAMS, "tiny", grid.points()["og-rloo-n1-s7"]).train
    assert cfg.model_copy(update={"eval_checkpoints": base.eval_checkpoints}) == base  # the same run otherwise
    assert frontier_batches(cfg.eval_checkpoints, Sizes.derive(cfg, 1).num_batches) == {2, 4, 6, 8, 12, 16, 32, 48}
    rows = []
    for point, n, fractions in (("og-ppo-n1-s5", 1, FRACTIONS), ("og-ppo-n16-s5", 16, FRACTIONS),
                                ("og-front-ppo-n1-s5", 1, (0.0625, *FRACTIONS))):  # fmt: skip
        for f in (0.0, *fractions):
            kl = 4 * f if n == 1 else f
            rows.append(
                dict(point=point, algorithm="ppo", N=n, seed=5, fraction=f, kl=kl, win_rate_vs_sft=0.5 + kl / 10)
            )
    frame = pd.DataFrame(rows)
    kept, same = grid.dense_frontier(frame)
    assert same and set(kept["point"]) == {"og-front-ppo-n1-s5", "og-ppo-n16-s5"} and (kept["fraction"] > 0).all()
    assert len(kept[kept["N"] == 1]) == 5  # 1/16 besides the grid's four
    frame.loc[(frame["point"] == "og-front-ppo-n1-s5") & (frame["fraction"] == 0.5), "kl"] += 1e-9
    assert grid.dense_frontier(frame)[1] is False


def test_a_profile_grid_is_queued_only_from_a_workspace_holding_that_profiles_inputs(monkeypatch, tmp_path):
    """Every output is persist (dvc.yaml), so DVC's run cache skips the stages: points queued from tiny's dvc.lock
    each built their own SmolLM2 inputs (~22 min each, seen 2026-12-03). `queue` refuses there, naming the recipe."""
    import pytest

    lock = tmp_path / "dvc.lock"
    lock.write_text("schema: '2.0'\nstages:\n  prepare:\n    params:\n      params.yaml:\n        profile: tiny\n")
    monkeypatch.setattr(grid.dvc_points, "ROOT", tmp_path)
    assert grid.dvc_points.built_profile() == "tiny"
    with pytest.raises(SystemExit, match=r"holds tiny's inputs, so every smollm2 point would build its own.*repro"):
        grid.main(["--profile", "smollm2", "queue"])
    lock.write_text(lock.read_text().replace("tiny", "smollm2"))
    queued = []
    monkeypatch.setattr(grid.dvc_points, "queue_workers", lambda: 0)
    monkeypatch.setattr(grid.dvc_points, "run_points", lambda command, pts, jobs, reading: queued.append(len(pts)))
    monkeypatch.delenv("RLHF_TORCH_THREADS", raising=False)
    grid.main(["--profile", "smollm2", "queue"])
    assert queued == [16]
    lock.unlink()
    assert grid.dvc_points.built_profile() is None
