"""`rlhf <stage> [key=value ...]`: run one pipeline stage with params.yaml (+ profile, + overrides).

Examples:
  rlhf prepare                                  # default profile from params.yaml
  rlhf --profile ci gold
  rlhf train --trainer ppo train.learning_rate=1e-4
  rlhf config train.k=4                         # print the resolved configuration
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import importlib
import os
import signal
import sys
import traceback
from pathlib import Path

from rlhf.config import DEFAULT_PARAMS, ConfigError, config_yaml, load_config
from rlhf.io import check_writable, published_together, stage_lock
from rlhf.presets import PRESETS, describe
from rlhf.stages import built_with
from rlhf.tracking import row_files

# The folder each stage writes under data_dir (besides metrics/<stage>.json and plots/), as dvc.yaml declares.
STAGE_OUTPUTS = {
    "prepare": "prepared",
    "gold": "gold",
    "sft": "sft",
    "reward": "reward",
    "train": "train",
    "generate": "generations",
    "evaluate": "eval",
    "report": "report",
}
PIPELINE = tuple(STAGE_OUTPUTS)
# Stages that never import torch (pandas, scikit-learn, numpy): importing it only to set its threads cost every run
# of them 1.1 s on an AVX-512 box and ~5.5 s on an AVX2-only one (tests/test_config.py holds them to it).
WITHOUT_TORCH = ("prepare", "gold", "report")
HELP = {
    "prepare": "build the prompt/SFT/gold splits of the task under data/prepared",
    "gold": "fit the gold judge on the human labels; held-out accuracy to data/metrics/gold.json",
    "sft": "build or load the SFT policy (optionally fine-tune) into data/sft",
    "reward": "sample pairs from the SFT policy, label them with gold, train the proxy reward model",
    "train": "online RL with a trainer preset (--trainer NAME)",
    "generate": "near-greedy generations of the trained and SFT policies on the eval prompts",
    "evaluate": "gold win-rates, KL to the SFT policy and proxy reward of the generations",
    "report": "print the headline metrics as a table and write data/report/index.html (charts)",
}


def lock_file(data_dir: str, stage: str) -> Path:
    """The lock of `rlhf <stage>` on `data_dir` (rlhf.io.stage_lock), in the project's cache, keyed by the folder."""
    from rlhf import runtime

    key = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:16]
    return runtime.CACHE / "locks" / f"{stage}-{key}.lock"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlhf", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--params", default=str(DEFAULT_PARAMS), help="params file (default: params.yaml)")
    parser.add_argument("--profile", default=None, help="profile in params.yaml (default: its `profile` key)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for stage in PIPELINE:
        if stage == "train":
            p = sub.add_parser(
                stage,
                help=HELP[stage],
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog=f"trainers (preset, the original's class, algorithm on engine):\n{describe()}",
            )
            p.add_argument(
                "--trainer",
                choices=list(PRESETS),
                metavar="NAME",
                help="the trainer preset (same as train.trainer=NAME): " + ", ".join(PRESETS),
            )
        else:
            p = sub.add_parser(stage, help=HELP[stage])
        p.add_argument("overrides", nargs="*", metavar="key=value", help="override a params.yaml key")
    p = sub.add_parser("config", help="print the resolved configuration as YAML")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    sub.add_parser("profiles", help="list the profiles in params.yaml")
    return parser


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def record_stage_cost(stage: str, profile: str) -> None:
    """With RLHF_STAGE_STATS=<file> (set by bench/pipeline_costs.py), append this stage's wall time since its
    process started and its peak RSS, and that of its largest child (the vLLM engine), as a JSON line."""
    path = os.environ.get("RLHF_STAGE_STATS")
    if not path:
        return
    import json
    import resource
    import time

    import psutil

    kib = 1024  # ru_maxrss is in KiB on Linux
    row = {
        "stage": stage,
        "profile": profile,
        "seconds": time.time() - psutil.Process().create_time(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib,
        "peak_rss_child_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * kib,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    """`rlhf ...`: the exit status. A rank of a distributed launch (WORLD_SIZE > 1) leaves through `_leave`."""
    from rlhf import runtime

    code = _run(argv)
    if runtime.env_int("WORLD_SIZE", 1, minimum=1) > 1:
        _leave(code)
    return code


def console() -> None:
    """The `rlhf` command and `python -m rlhf.cli`: main(), then exit without the interpreter's teardown (`_leave`)."""
    _leave(main())


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown, once everything is written. Freeing the modules of torch,
    transformers and DeepSpeed took ~1.1 s of every stage's wall clock on these CPUs (4.2 s against 5.3 s for a
    process that only imports them), for nothing the process needs. On a training rank it also avoids an abort:
    after a finished run (outputs written, process group destroyed) a rank still aborted now and then in the
    teardown (SIGABRT, "terminate called without an active exception", no Python frame: a C++ thread of the
    distributed stack torn down at exit), and torchrun then failed the whole run. What a normal exit does before the
    teardown still happens: the threads that are not daemons are waited for, then Python's exit hooks run (Ray's
    shutdown, W&B, logging, multiprocessing's children)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run(argv: list[str] | None) -> int:
    from rlhf import runtime

    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupted)  # a supervisor's stop cleans up like Ctrl-C: temp outputs removed
    try:
        # torch is imported only once a stage is about to run: `rlhf config` and a bad input answer at once
        runtime.configure_environment()
        if args.command == "profiles":
            from rlhf.config import profiles

            print("\n".join(profiles(args.params)))
            return 0
        overrides = list(args.overrides)
        if getattr(args, "trainer", None):
            overrides.append(f"train.trainer={args.trainer}")
        cfg = load_config(args.params, args.profile, overrides)
        if args.command == "config":
            print(config_yaml(cfg), end="")
            return 0
        outputs = [cfg.path(STAGE_OUTPUTS[args.command]), cfg.path("metrics"), cfg.path("plots")]
        outputs += [row_files(cfg.data_dir)[1].parent] if args.command == "train" else []  # rows' wall-clock columns
        check_writable(outputs + ([cfg.path("checkpoints")] if args.command == "train" else []))
        built_with.check_inputs(cfg, args.command)
        if args.command in WITHOUT_TORCH:
            runtime.torch_threads()  # unused here, but a malformed setting fails every stage alike
        else:
            runtime.configure_torch()  # inside the try: Ctrl-C while importing torch is an interrupt too
        if args.command == "train":  # what this machine cannot run fails now, before the engine's process starts
            _check_runnable_here(cfg)
        with stage_lock(lock_file(cfg.data_dir, args.command), args.command, cfg.data_dir, runtime.env_int("RANK", 0)):
            with published_together(outputs):  # the stage's outputs and its record move in together, or none
                stage = importlib.import_module(f"rlhf.stages.{args.command}")
                if args.command == "report":  # its header measures the settings against the params file's profile
                    stage.run(cfg, args.params)
                else:
                    stage.run(cfg)
                if runtime.env_int("RANK", 0) == 0:
                    built_with.record(cfg, args.command, STAGE_OUTPUTS[args.command])
        record_stage_cost(args.command, cfg.profile)
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError, ImportError, OSError) as e:
        # Known failure modes carry a message naming the key/file; tracebacks only on request.
        if os.environ.get("RLHF_DEBUG"):
            traceback.print_exc()
        print(f"rlhf {args.command}: error: {_describe(e)}{_set_by_dvc(e)}", file=sys.stderr)
        return 1


def _set_by_dvc(e: BaseException) -> str:
    """A bad setting in a `dvc exp run` in the workspace: DVC wrote its -S values into params.yaml and leaves them
    there after a failure (the stage's outputs are untouched: dvc.yaml's `persist`), so say how to undo it."""
    in_workspace = ".dvc/tmp/exps" not in Path.cwd().as_posix()  # queued and --temp runs have their own copy
    if isinstance(e, ConfigError) and os.environ.get("DVC_EXP_NAME") and in_workspace:
        return "; params.yaml still holds the value `dvc exp run -S` set: fix it, or `git checkout params.yaml`"
    return ""


def _check_runnable_here(cfg) -> None:
    """Settings this machine cannot run (a CUDA engine device without CUDA, more Ray engines than a local cluster
    can place): refused here, in one line, instead of a traceback from the engine's process minutes later."""
    import torch

    from rlhf.generation.factory import check_runnable_here
    from rlhf.runtime import env_int

    world = env_int("WORLD_SIZE", 1, minimum=1)
    check_runnable_here(cfg.train, torch.cuda.device_count(), os.cpu_count() or 1, os.environ.get("RAY_ADDRESS"), world)


_OS_ADVICE = {
    errno.ENOSPC: "the disk is full: free space and re-run",
    errno.EDQUOT: "the disk quota is used up: free space and re-run",
    errno.EACCES: "permission denied: fix the permissions and re-run",
    errno.EPERM: "permission denied: fix the permissions and re-run",
    errno.EROFS: "the file system is read-only: point data_dir elsewhere",
    errno.EISDIR: "a folder is in the way of this file: move it away and re-run",
    errno.ENOTDIR: "a file is in the way of this folder: move it away and re-run",
}


def _describe(e: BaseException) -> str:
    """One line for the user: an OS error names the path and what to do, not an errno string."""
    if isinstance(e, OSError) and e.errno in _OS_ADVICE and (e.filename2 or e.filename):
        return f"{e.filename2 or e.filename}: {_OS_ADVICE[e.errno]}"
    return str(e)


if __name__ == "__main__":
    console()
