"""`make offpolicy`: the paper's off-policy experiment (its Fig. 3/4) as a grid of DVC experiments.

Each point is one `dvc exp run --queue` of the pipeline with `-S` settings, named for what it varies:
  grid:       PPO, RLOO, online DPO and best-of-2 x N in {1, 4, 16} (train.num_mini_batches: N mini-batches sampled
              with one policy, then N updates, each more off-policy; the same episodes and updates for every N)
              x 2 RL seeds (train.seed: the data, SFT and reward model are shared, not rebuilt);
  staleness:  the asynchronous engine generating up to S = 1, 2, 4 batches ahead (train.max_staleness) for online
              DPO and RLOO, and at S = 4 RLOO with truncated importance weights (train.tis_cap) against without.
Points already run (an experiment of that name exists) are not queued again, so adding a value to a list below and
running `make offpolicy` again runs only the new points; `dvc exp show` lists them all.

  python bench/offpolicy.py queue [--jobs J]   queue the missing points, start J queue workers, wait for them
  python bench/offpolicy.py report             the table and figures from the experiments (bench/metrics/offpolicy*)
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALGORITHMS = ("ppo", "rloo", "online_dpo", "bok")  # bok: best-of-2 SFT, the paper's control for DPO's two samples
MINI_BATCHES = (1, 4, 16)  # N
SEEDS = (1, 2)
STALENESS = (1, 2, 4)  # S, the asynchronous engine's lookahead
ASYNC_ALGORITHMS = ("online_dpo", "rloo")
TIS_CAP = 2.0  # truncation of the per-sequence importance weight pi_learner / pi_engine (rlhf/trainers/loop.py)
PREFIX = "op"  # experiment names: op-<algorithm>-n<N>-s<seed>, op-async-<algorithm>-S<S>[-tis]-s<seed>
OUT = ROOT / "bench" / "metrics"


def points() -> dict[str, list[str]]:
    """Every point of the experiment: its name and its `-S` settings."""
    out = {}
    for algorithm, n, seed in itertools.product(ALGORITHMS, MINI_BATCHES, SEEDS):
        settings = [f"train.trainer={algorithm}", f"train.num_mini_batches={n}", f"train.seed={seed}"]
        out[f"{PREFIX}-{algorithm}-n{n}-s{seed}"] = settings
    for algorithm, s in itertools.product(ASYNC_ALGORITHMS, STALENESS):
        settings = [f"train.trainer={algorithm}", "train.engine=vllm_async", f"train.max_staleness={s}"]
        out[f"{PREFIX}-async-{algorithm}-S{s}-s1"] = [*settings, "train.seed=1"]
    stalest = ["train.trainer=rloo", "train.engine=vllm_async", f"train.max_staleness={max(STALENESS)}"]
    out[f"{PREFIX}-async-rloo-S{max(STALENESS)}-tis-s1"] = [*stalest, f"train.tis_cap={TIS_CAP}", "train.seed=1"]
    return out


def dvc(*args: str, capture: bool = True) -> str:
    """Run `dvc ARGS` in the project; its stdout. A failure ends this script with DVC's own message."""
    proc = subprocess.run(["dvc", *args], cwd=ROOT, capture_output=capture, text=True)
    if proc.returncode != 0:
        sys.exit(f"offpolicy: `dvc {' '.join(args)}` failed: {(proc.stderr or '').strip().splitlines()[-1:]}")
    return proc.stdout or ""


def experiments() -> dict[str, dict]:
    """The project's experiments by name: their revision, params and eval metrics (`dvc exp show --json`)."""
    out = {}
    for commit in json.loads(dvc("exp", "show", "--json", "--no-fetch") or "[]"):
        for exp in commit.get("experiments") or []:
            for rev in exp.get("revs") or []:
                data = rev.get("data") or {}
                if rev.get("name") and data.get("status") == "Success":
                    out[rev["name"]] = {"rev": rev["rev"], **data}
    return out


def queued() -> set[str]:
    """Names of experiments waiting or running in DVC's queue (`dvc queue status`)."""
    rows = dvc("queue", "status").splitlines()[1:]
    return {r.split()[1] for r in rows if re.search(r"\b(Queued|Running)\b", r) and len(r.split()) > 1}


def queue(jobs: int) -> int:
    """Queue the points not run yet, start `jobs` workers, wait until the queue is empty."""
    done, waiting = set(experiments()), queued()
    todo = {name: s for name, s in points().items() if name not in done | waiting}
    print(f"offpolicy: {len(points())} points, {len(done & set(points()))} done, {len(todo)} to queue")
    for name, settings in todo.items():
        dvc("exp", "run", "--queue", "--name", name, *itertools.chain.from_iterable(("-S", s) for s in settings))
    if todo or waiting:
        dvc("queue", "start", "--jobs", str(jobs))
    start = time.perf_counter()
    while left := queued():
        print(f"offpolicy: {len(left)} queued or running, {time.perf_counter() - start:.0f} s", flush=True)
        time.sleep(30)
    failed = [n for n in points() if n not in experiments()]
    print(f"offpolicy: queue empty after {time.perf_counter() - start:.0f} s; {len(failed)} point(s) failed {failed}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("queue", help="queue the missing points and run them")
    q.add_argument("--jobs", type=int, default=2, help="queue workers running at once (default 2: one per core)")
    sub.add_parser("report", help="the table and the figures")
    args = ap.parse_args(argv)
    if args.command == "queue":
        return queue(args.jobs)
    from offpolicy_report import report

    return report(experiments(), points())


if __name__ == "__main__":
    sys.exit(main())
