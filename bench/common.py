"""What the benchmarks share: a scratch data dir over the pipeline's outputs, a timed `train` run's rows, a measured
child process, the interval a comparison's verdict is read from, and their command lines' checks: argument types
that refuse a bad value before any work, and `run_main`, which ends a bad setting or missing file in one line."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from rlhf.runtime import int_argument

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_INPUTS = ("prepared", "gold", "sft", "reward")


# argparse type: an integer > 0 (a count of seeds, rounds, prompts, episodes, jobs)
positive_int = int_argument(1)


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (a learning rate)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated integers > 0 (batch sizes, lengths)."""
    try:
        return [positive_int(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers > 0, got {text!r}") from None


def run_main(main: Callable[[], int | None]) -> int:
    """A bench's entry point: `main()`'s exit code; a bad setting (rlhf's ConfigError: an unknown profile, key or
    value) or a missing file ends in one line naming it, exit 1, with the traceback only under RLHF_DEBUG=1 (as
    `rlhf`'s own commands). Other errors keep their traceback: a benchmark's bug is not bad input."""
    from rlhf.config import ConfigError

    script = Path(sys.argv[0]).name
    try:
        return main() or 0
    except KeyboardInterrupt:
        print(f"{script}: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, FileNotFoundError) as e:
        if os.environ.get("RLHF_DEBUG"):
            traceback.print_exc()
        print(f"{script}: error: {e}", file=sys.stderr)
        return 1


def scratch_data(dst: Path, inputs: tuple[str, ...] = PIPELINE_INPUTS, source: Path | None = None) -> Path:
    """A data dir that shares `inputs` of `source` (default: the pipeline's data/) by symlinks to their files and
    gets its own train/ and metrics/. The stages' records of the settings they ran with are left out: benchmarks
    train with other seeds on the same inputs, which `rlhf train` would otherwise refuse."""
    from rlhf.stages.built_with import RECORD

    source = source or ROOT / "data"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for name in inputs:
        if not (source / name).exists():
            raise SystemExit(f"{source / name} is missing: run `make run` (or `dvc repro reward`) first")
        (dst / name).mkdir()
        for entry in (source / name).resolve().iterdir():
            if entry.name != RECORD:
                (dst / name / entry.name).symlink_to(entry)
    return dst


def merged(path: Path, results: dict, replaced: list[str]) -> dict:
    """A metrics file's entries with those under each of `replaced` (a key's first path part: a run, an algorithm)
    replaced by `results`, the others kept: a run of part of a benchmark keeps the last figures of the rest (each
    part's entries name their box and date)."""
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept = {k: v for k, v in kept.items() if k.split("/", 1)[0] not in replaced}
    return dict(sorted({**kept, **results}.items()))


def cpu_flags() -> str:
    """The vector/matrix extensions of this CPU that decide bf16 and vLLM speed (benchmark tables name them)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")
    return " ".join(f for f in wanted if f in flags) or "none of avx2/avx512/amx"


def timed_train(cfg, started=None) -> tuple[float, list[dict]]:
    """Run `train(cfg)` (with the engine placed and its process started earlier, rlhf.trainers.early): its wall
    seconds (model loading and engine start-up included) and its logged rows (rlhf.tracking.logged_rows)."""
    from rlhf.tracking import logged_rows
    from rlhf.trainers.loop import train

    start = time.perf_counter()
    train(cfg, started)
    wall = time.perf_counter() - start
    return wall, logged_rows(cfg.data_dir)


def column_sum(rows: list[dict], key: str) -> float:
    """Sum of a logged column over the run (a row without it counts 0)."""
    return sum(float(r.get(key) or 0) for r in rows)


def smollm2_data() -> Path:
    """prepare -> gold -> sft -> reward on the smollm2 profile, small, once (the pipeline's own stages)."""
    from rlhf.config import load_config
    from rlhf.stages import gold, prepare, reward, sft

    folder = ROOT / ".cache" / "bench" / "smollm2-data"
    cfg = load_config(ROOT / "params.yaml", "smollm2", [f"data_dir={folder}", "data.n_reward_prompts=128"])
    for stage, name in ((prepare, "prepared"), (gold, "gold"), (sft, "sft"), (reward, "reward")):
        if not (folder / name).exists():
            stage.run(cfg)
    return folder


def run_process_tree(cmd: list[str], log_path: Path, env: dict | None = None) -> tuple[float, int]:
    """Run cmd to completion, output to log_path: (wall seconds from spawn to exit, peak RSS bytes of its process
    tree sampled every 0.2 s). A failed run exits with the log's last lines."""
    import psutil

    start = time.perf_counter()
    peak = 0
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = 0
            try:
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                family = []
            for p in family:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            peak = max(peak, rss)
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); last lines of {log_path}:\n{tail}")
    return wall, peak


def interval90(diffs: list[float], ses: list[float]) -> tuple[float, float]:
    """90% interval of the mean of R per-round differences `diffs`, each with its measurement's standard error
    `ses`: the wider of the measurement-noise interval (normal) and, from 2 rounds on, the between-rounds one
    (Student t, R - 1 d.o.f.; rounds differ in seed, so it holds training noise too)."""
    from scipy import stats

    r = len(diffs)
    centre = sum(diffs) / r
    half = stats.norm.ppf(0.95) * math.sqrt(sum(se * se for se in ses)) / r
    if r > 1:
        half = max(half, stats.t.ppf(0.95, r - 1) * statistics.stdev(diffs) / math.sqrt(r))
    return centre - half, centre + half
