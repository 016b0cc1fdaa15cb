"""Two stages sharing the cores: `rlhf train` (`tiny`) alone and two at once, with 1 and 2 torch threads each, and a
stage on two threads beside one on one thread.

Why a queued DVC experiment's stages take one thread (rlhf.runtime.threads_alone): DVC's queue runs experiments side
by side (`dvc queue start -j 2`), and a stage cannot know what runs beside it; and why a stage taking every core warns
when another stage runs (a `make run` beside a queued experiment: the last case). Each run is a fresh `rlhf train`
process over its own scratch copy of data/ (the pipeline's inputs must exist: `make run` first); the seconds are from
the first start to the last exit, and each process's own from its start to its exit, one clock for all.

  .venv/bin/python -m rlhf.runtime python bench/shared_cores.py      -> bench/metrics/shared_cores.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, cpu_flags, run_main, scratch_data

from rlhf.io import write_text

RUNS = ((2,), (1,), (1, 1), (2, 2), (2, 1))  # torch threads of each process started at once


def at_once(folders: list, threads: tuple[int, ...]) -> list[float]:
    """Each process's seconds, start to exit, for `rlhf train` in folders[i] with threads[i] torch threads, all
    started at once."""
    procs = []
    for folder, n in zip(folders, threads):
        env = {**os.environ, "RLHF_TORCH_THREADS": str(n), "WANDB_MODE": "disabled"}
        cmd = [sys.executable, "-m", "rlhf.cli", "--profile", "tiny", "train", f"data_dir={folder}"]
        log = open(folder.parent / f"{folder.name}.log", "w")  # noqa: SIM115 (closed with the process below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log, time.perf_counter()))
    seconds = [0.0] * len(procs)
    while not all(seconds):
        for i, (proc, log, start) in enumerate(procs):
            if not seconds[i] and proc.poll() is not None:
                seconds[i] = time.perf_counter() - start
                log.close()
                if proc.returncode != 0:
                    sys.exit(f"shared_cores: `rlhf train` failed (exit {proc.returncode}): see {log.name}")
        time.sleep(0.05)
    return seconds


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    base = ROOT / ".cache" / "bench" / "shared_cores"
    folders = [scratch_data(base / f"data{i}") for i in range(2)]
    results = {"cpu_flags": cpu_flags(), "date": time.strftime("%Y-%m-%d")}
    for threads in RUNS:
        seconds = at_once(folders[: len(threads)], threads)
        run = f"{len(threads)}_at_once"
        if len(set(threads)) == 1:
            results[f"{run}/{threads[0]}_threads/seconds"] = max(seconds)
            print(
                f"shared_cores: {len(threads)} at once, {threads[0]} thread(s) each: {max(seconds):.1f} s", flush=True
            )
            continue
        mix = "_and_".join(map(str, threads))
        results.update({f"{run}/{mix}_threads/{n}_thread_stage_seconds": own for n, own in zip(threads, seconds)})
        print(f"shared_cores: at once, {mix} threads: " + ", ".join(f"{x:.1f} s" for x in seconds), flush=True)
    slow = results["2_at_once/2_threads/seconds"] / results["2_at_once/1_threads/seconds"]
    results["2_at_once/2_over_1_threads"] = slow
    beside = results["2_at_once/2_and_1_threads/2_thread_stage_seconds"] / results["1_at_once/2_threads/seconds"]
    results["2_thread_stage_beside_a_1_thread_stage_over_alone"] = beside
    print(
        f"shared_cores: two at once, 2 threads each took {slow:.2f}x as long as 1 thread each; a stage on 2 threads "
        f"beside one on 1 took {beside:.2f}x as long as alone ({cpu_flags()})"
    )
    write_text(ROOT / "bench" / "metrics" / "shared_cores.json", json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
