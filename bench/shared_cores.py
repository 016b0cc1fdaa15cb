"""Two stages sharing the cores: `rlhf train` (`tiny`) alone and two at once, with 1 and 2 torch threads each.

Why a queued DVC experiment's stages take one thread (rlhf.runtime.threads_alone): DVC's queue runs experiments side
by side (`dvc queue start -j 2`), and a stage cannot know what runs beside it. Each run is a fresh `rlhf train`
process over its own scratch copy of data/ (the pipeline's inputs must exist: `make run` first); the seconds are
from the first start to the last exit, one clock for all four runs.

  .venv/bin/python -m rlhf.runtime python bench/shared_cores.py      -> bench/metrics/shared_cores.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import ROOT, cpu_flags, scratch_data

RUNS = ((1, 2), (2, 2), (2, 1), (1, 1))  # (processes at once, torch threads each)


def at_once(folders: list, threads: int) -> float:
    """Seconds for `rlhf train` in every folder at once, each with `threads` torch threads."""
    env = {**os.environ, "RLHF_TORCH_THREADS": str(threads), "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    procs = []
    for folder in folders:
        cmd = [sys.executable, "-m", "rlhf.cli", "--profile", "tiny", "train", f"data_dir={folder}"]
        log = open(folder.parent / f"{folder.name}.log", "w")  # noqa: SIM115 (closed with the process below)
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for proc, log in procs:
        proc.wait()
        log.close()
        if proc.returncode != 0:
            sys.exit(f"shared_cores: `rlhf train` failed (exit {proc.returncode}): see {log.name}")
    return time.perf_counter() - start


def main() -> int:
    base = ROOT / ".cache" / "bench" / "shared_cores"
    folders = [scratch_data(base / f"data{i}") for i in range(2)]
    results = {"cpu_flags": cpu_flags(), "date": time.strftime("%Y-%m-%d")}
    for processes, threads in RUNS:
        seconds = at_once(folders[:processes], threads)
        results[f"{processes}_at_once/{threads}_threads/seconds"] = seconds
        print(f"shared_cores: {processes} at once, {threads} thread(s) each: {seconds:.1f} s", flush=True)
    slow = results["2_at_once/2_threads/seconds"] / results["2_at_once/1_threads/seconds"]
    results["2_at_once/2_over_1_threads"] = slow
    print(f"shared_cores: two at once, 2 threads each took {slow:.2f}x as long as 1 thread each ({cpu_flags()})")
    (ROOT / "bench" / "metrics" / "shared_cores.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
