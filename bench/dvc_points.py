"""A bench's points as DVC experiments: queue them (`dvc exp run --queue`, DVC's own workers), find them when they
end (`dvc exp show`, every commit's, and the points kept in bench/metrics/points/: bench/archive.py), read their
committed files, and refuse points trained on other inputs than the rest. bench/offpolicy.py's grid and every bench of
queued points (bench/ppo_epochs.py, decoupled.py, policy_size.py, ...) run through these.
"""

from __future__ import annotations

import argparse
import functools
import io
import itertools
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import archive
import pandas as pd
import yaml
from common import positive_int  # bench/ is sys.path[0]

ROOT = Path.cwd()  # the DVC project: `make offpolicy` runs in this one; a test runs it in a copy
OUT = ROOT / "bench" / "metrics"
KEPT = OUT / "points"  # finished points' files, committed (bench/archive.py): they outlive the experiment refs
INPUTS = ("prepare", "gold", "sft", "reward")  # the stages before `train`: what a point trains on, not what it varies


def point_lines(pts: dict[str, list[str]]) -> str:
    """One line per point: its name and its `-S` settings (`list`)."""
    return "\n".join(f"{n}: {' '.join(s)}" for n, s in pts.items())


def dvc(*args: str) -> str:
    """Run `dvc ARGS` in the project; its stdout. A failure ends this script with DVC's own message."""
    proc = subprocess.run(["dvc", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        error = " ".join(line.strip() for line in (proc.stderr or "").strip().splitlines()[-4:])
        sys.exit(f"offpolicy: `dvc {' '.join(args)}` failed: {error}")
    return proc.stdout or ""


def experiments() -> dict[str, str]:
    """The project's finished experiments, name -> revision, from every commit they were run from (`dvc exp show
    --json`; a queued, running or failed one carries its queue task's state, a finished one none or "success").
    Of two of one name, the later listed wins; a point kept in bench/metrics/points/ (bench/archive.py) counts too,
    an experiment of its name in this clone before it."""
    out = archive.revisions(KEPT)
    # every commit experiments were run from, not only HEAD's: points stay found after a `git pull` or a commit
    baselines = [line.rstrip(":") for line in dvc("exp", "list", "--all-commits").splitlines() if line.endswith(":")]
    revs = itertools.chain.from_iterable(("--rev", b) for b in baselines)
    for commit in json.loads(dvc("exp", "show", "--json", "--no-fetch", *revs) or "[]"):
        for exp in commit.get("experiments") or []:
            if (exp.get("executor") or {}).get("state", "success") != "success":
                continue
            for rev in exp.get("revs") or []:
                if rev.get("name") and not rev.get("error"):
                    out[rev["name"]] = rev["rev"]
    return out


def queued() -> set[str]:
    """Names of experiments waiting or running in DVC's queue (`dvc queue status`)."""
    rows = dvc("queue", "status").splitlines()[1:]
    return {r.split()[1] for r in rows if re.search(r"\b(Queued|Running)\b", r) and len(r.split()) > 1}


def stale(stages) -> list[str]:
    """Those of `stages` whose inputs or outputs are not what the workspace's dvc.lock records (`dvc status`)."""
    return sorted(set(json.loads(dvc("status", "--json") or "{}")) & set(stages))


def queue_workers() -> int:
    """DVC's queue workers, busy or idle (`dvc queue status`'s `Worker status: N active, M idle`)."""
    found = re.search(r"Worker status: (\d+) active, (\d+) idle", dvc("queue", "status"))
    return int(found.group(1)) + int(found.group(2)) if found else 0


def start_workers(jobs: int) -> None:
    """`dvc queue start --jobs J`: as many new workers as make J; they are daemons: given our stdout, they would hold
    it open until they end."""
    subprocess.run(["dvc", "queue", "start", "--jobs", str(jobs)], cwd=ROOT, stdout=subprocess.DEVNULL, check=True)


def queue(pts: dict[str, list[str]], jobs: int, targets: dict[str, str] | None = None, shared=INPUTS) -> int:
    """Queue the points not run yet, start `jobs` workers, wait until the queue is empty. `targets`: a point's
    last stage (`dvc exp run <stage>`: it and the stages before it), where not the whole pipeline. `shared`: the
    stages whose outputs the points share (none where each point builds its own, e.g. a seed of the whole pipeline);
    not queued while one of them is not what dvc.lock records and points have run."""
    done, waiting = set(experiments()), queued()
    todo = {name: s for name, s in pts.items() if name not in done | waiting}
    ran = done & set(pts)
    print(f"offpolicy: {len(pts)} points, {len(ran)} done, {len(todo)} to queue")
    if shared and todo and ran and (changed := stale(shared)):
        sys.exit(
            f"offpolicy: {', '.join(changed)}: not what dvc.lock records (`dvc status`), so each point queued now "
            f"would build it again, unlike the {len(ran)} already run (check_same_inputs); `make run`, commit "
            "dvc.lock, then queue"
        )
    for name, settings in todo.items():
        # `++key=value`: set the key whether params.yaml's section has it or not (Hydra's override grammar)
        overrides = itertools.chain.from_iterable(("-S", f"++{s}") for s in settings)
        stage = [targets[name]] if targets and name in targets else []
        dvc("exp", "run", "--queue", "--name", name, *overrides, *stage)
    if todo or waiting:
        start_workers(jobs)
    start, short_polls, ended = time.perf_counter(), 0, 0
    while left := queued() & set(pts):  # other experiments in the queue are not ours to wait for
        print(f"offpolicy: {len(left)} queued or running, {time.perf_counter() - start:.0f} s", flush=True)
        if len(pts) - len(left) > ended:  # kept as they end: a session cut short keeps what finished
            keep(experiments(), pts)
            ended = len(pts) - len(left)
        # Fewer workers than points to run: `dvc queue stop` ends every worker after its task, and a worker also
        # ended with a point still queued (seen 2026-11-28: the last point then waited for the other's 13 min).
        workers = queue_workers()
        short_polls = short_polls + 1 if workers < min(jobs, len(left)) else 0
        if short_polls == 2:
            print(f"offpolicy: {workers} queue worker(s) for {len(left)} points for 30 s: starting more", flush=True)
            start_workers(jobs)
            short_polls = 0
        time.sleep(30)
    finished = experiments()  # `dvc exp show` over every commit: seconds, asked once
    keep(finished, pts)
    failed = [n for n in pts if n not in finished]
    print(f"offpolicy: queue empty after {time.perf_counter() - start:.0f} s; {len(failed)} point(s) failed {failed}")
    if failed:
        print(f"offpolicy: `dvc queue logs {failed[0]}` shows why; `make offpolicy` runs only the missing points again")
    return 1 if failed else 0


@functools.cache
def committed(rev: str, path: str) -> str:
    """The text of `path` as experiment revision `rev` committed it (a metrics or plots file: `cache: false`), or as
    bench/metrics/points/ keeps it for a kept point's revision."""
    if (text := archive.read(KEPT, rev, path)) is not None:
        return text
    return archive.git(ROOT, "show", f"{rev}:{path}")


def built_profile() -> str | None:
    """The profile the workspace's dvc.lock built the INPUTS stages with (its `prepare` stage's `profile` param);
    None before anything was built. Points queued from it reuse those outputs only for that profile: every output
    is `persist: true` (dvc.yaml), and DVC's run cache skips such stages, so each point of another profile builds
    its own inputs."""
    lock = ROOT / "dvc.lock"
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {}) if lock.is_file() else {}
    return ((stages.get("prepare") or {}).get("params") or {}).get("params.yaml", {}).get("profile")


def input_hashes(rev: str) -> dict[str, str]:
    """Each INPUTS stage's output folders (data/prepared, data/sft, ...) as experiment revision `rev`'s dvc.lock
    records them: stage -> their md5s."""
    stages = yaml.safe_load(committed(rev, "dvc.lock"))["stages"]
    return {
        s: " ".join(o["md5"] for o in stages[s]["outs"] if o["md5"].endswith(".dir")) for s in INPUTS if s in stages
    }


def check_same_inputs(exps: dict[str, str], pts: dict[str, list[str]], varied: dict | None = None) -> None:
    """Exit, naming two points, if finished points trained on other INPUTS outputs: e.g. queued before and after a
    change to the stages' code, the later ones rebuilt the SFT policy on one thread (other rounding). varied: stage
    -> a function of the point's name whose value the stage's outputs may differ by (a bench varying the SFT policy's
    size: its size); every other stage must be the same for all."""
    first: dict[tuple[str, str], tuple[str, str]] = {}  # (stage, group) -> the first point seen and its md5s
    for name in (n for n in pts if n in exps):
        for stage, md5 in input_hashes(exps[name]).items():
            group = (varied or {}).get(stage, lambda _: "")(name)
            other, expected = first.setdefault((stage, group), (name, md5))
            if md5 != expected:
                sys.exit(
                    f"bench: points {other} and {name} trained on other `{stage}` outputs ({expected[:7]} against "
                    f"{md5[:7]}: queued from other dvc.locks?), so they are not comparable; `dvc exp remove` the "
                    "stale ones, `make run`, commit dvc.lock and queue them again"
                )


def frontier_rows(exps: dict[str, str], pts: dict[str, list[str]], varied: dict | None = None) -> pd.DataFrame:
    """One row per kept policy (data/plots/frontier.csv, read from each experiment's commit) of every finished
    point, with the point's settings: algorithm, N, S (0 = synchronous), tis_cap, seed. The points must have
    trained on the same inputs but where `varied` says (check_same_inputs)."""
    check_same_inputs(exps, pts, varied)
    frames = []
    for name in (n for n in pts if n in exps):
        settings = dict(s.split("=", 1) for s in pts[name])
        frame = pd.read_csv(io.StringIO(committed(exps[name], "data/plots/frontier.csv")))
        frame.insert(0, "point", name)
        frame.insert(1, "algorithm", settings["train.trainer"])
        frame.insert(2, "N", int(settings.get("train.num_mini_batches", 1)))
        asynchronous = settings.get("train.engine") == "vllm_async"
        frame.insert(3, "S", int(settings["train.max_staleness"]) if asynchronous else 0)
        frame.insert(4, "tis_cap", float(settings.get("train.tis_cap", "nan")))
        frame.insert(5, "seed", int(settings["train.seed"]))
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def add_jobs(parser: argparse.ArgumentParser) -> None:
    """`--jobs`: the queue workers of a bench's `queue` command."""
    parser.add_argument(
        "--jobs", type=positive_int, default=2, help="queue workers running at once (default 2: one per core)"
    )


def point_parser(doc: str, *commands: str) -> argparse.ArgumentParser:
    """The command line of a bench of queued points (bench/ppo_epochs.py and others): `list`, `queue`, `report` and
    `commands`, and `--jobs`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["list", "queue", "report", *commands])
    add_jobs(ap)
    return ap


def keep(exps: dict[str, str], pts: dict[str, list[str]]) -> None:
    """Copy the finished points of `pts` not yet kept to bench/metrics/points/ (bench/archive.py); commit them."""
    if copied := archive.keep(ROOT, KEPT, exps, pts):
        print(f"offpolicy: {len(copied)} finished point(s) kept in {KEPT.relative_to(ROOT)}/ (commit them)", flush=True)


def run_points(command: str, pts: dict[str, list[str]], jobs: int, report, shared=INPUTS) -> int:
    """point_parser's commands: `list` prints the points, `queue` runs the missing ones (`shared`: queue's),
    `report` keeps the finished points (`keep`) and calls `report()`."""
    if command == "list":
        print(point_lines(pts))
        return 0
    if command == "queue":
        return queue(pts, jobs, shared=shared)
    keep(experiments(), pts)
    return report()
