"""Process-wide settings every entry point applies first: offline, quiet, project-local caches, one thread."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def queued_from(cwd: Path | None = None) -> Path | None:
    """The repository when this process runs in a temporary copy of it that DVC's experiment queue (or `dvc exp run
    --temp`) made under its `.dvc/tmp` (DVC then sets DVC_ROOT to the repository); else None."""
    root = os.environ.get("DVC_ROOT")
    if not root:
        return None
    repo = Path(root).resolve()
    return repo if (cwd or Path.cwd()).resolve().is_relative_to(repo / ".dvc" / "tmp") else None


# A queued experiment's copy is deleted once it ran: its caches (W&B's offline runs among them) are the repository's.
CACHE = Path(os.environ.get("RLHF_CACHE_DIR") or (queued_from() or PROJECT_ROOT) / ".cache")

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_SILENT": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

CACHE_ENV = {
    "HF_HOME": "hf",
    "HF_DATASETS_CACHE": "hf/datasets",
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
    "VLLM_CACHE_ROOT": "vllm",
    "PREFECT_HOME": "prefect",
    "PREFECT_MEMO_STORE_PATH": "prefect/memo_store.toml",  # these two default to ~/.prefect, not PREFECT_HOME
    "PREFECT_LOCAL_STORAGE_PATH": "prefect/storage",
    "WANDB_DIR": "wandb",
    "WANDB_CACHE_DIR": "wandb/cache",
    "WANDB_CONFIG_DIR": "wandb/config",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",  # defaults to /tmp/torchinductor_<user>
    "WANDB_DATA_DIR": "wandb/data",  # defaults to ~/.local/share/wandb
    "XDG_CACHE_HOME": "xdg",
    "XDG_CONFIG_HOME": "xdg-config",  # DVC's telemetry id, chromium profiles
    "XDG_DATA_HOME": "xdg-data",
    "MPLCONFIGDIR": "matplotlib",
}


def seconds_since_start() -> float:
    """Wall-clock seconds since this process started, as the kernel recorded it (interpreter start included), to the
    kernel's clock tick (10 ms). On Linux both ends are read on the clock since boot: psutil's start time adds the
    boot time in whole seconds, up to 1 s off (the same for every process of a boot, so runs still compared)."""
    import time

    start = _process_start(os.getpid())
    if start is None:  # no /proc: a Unix time from psutil
        import psutil

        return time.time() - psutil.Process(os.getpid()).create_time()
    return time.clock_gettime(time.CLOCK_BOOTTIME) - start


@functools.cache
def _process_start(pid: int) -> float | None:
    """Process `pid`'s start in seconds since boot (/proc/<pid>/stat's starttime), read once (the training loop asks
    every iteration; keyed by pid, so a forked child never reads its parent's); None without /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
    except OSError:
        return None
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime; fields[0] is field 3


def configure() -> None:
    """Set the offline/quiet environment (without overriding what the user set), then torch's backend settings.

    GPU users who want the hub set HF_HUB_OFFLINE=0; W&B runs offline unless WANDB_API_KEY is set
    (rlhf/tracking.py).
    """
    configure_environment()
    configure_torch()


def configure_environment() -> None:
    """The offline/quiet environment and the project-local caches, without importing torch."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["HF_HUB_OFFLINE"] == "1":  # nothing to download, so transformers' and the hub's bars (one per
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # model loaded) are noise; ours are plain tqdm
    if "RAY_ADDRESS" not in os.environ:  # no Ray cluster to join: a local one binds 127.0.0.1 only (ray_engines)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    for key, sub in CACHE_ENV.items():
        os.environ.setdefault(key, str(CACHE / sub))


def configure_torch() -> None:
    """DeepSpeed's accelerator and one torch thread: imports torch (seconds; a minute or more on a slow box)."""
    import torch

    if not torch.cuda.is_available():  # DeepSpeed finds CUDA by itself; on a CPU-only box it must be told
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":  # set by `accelerate launch`
            skip_deepspeed_shm_op()
    torch.set_num_threads(torch_threads())


def torch_threads() -> int:
    """RLHF_TORCH_THREADS, else 1: processes that share the cores take one thread each (two per process were many
    times slower on 2 cores); a process alone takes more (`threads_alone`)."""
    return env_int("RLHF_TORCH_THREADS", 1, minimum=1)


def threads_alone() -> int:
    """Torch threads for a process that has its cores to itself (a stage that starts no engine or worker process
    beside it, as `dvc repro` runs the sft and reward stages): RLHF_TORCH_THREADS when set (the test suite sets 1:
    its workers share the cores), else one per core this process may use. The `tiny` SFT ran 1.7x faster on 2
    threads than on 1 (2-core AMD EPYC, AVX-512); two processes sharing two cores want one each (configure_torch).

    A stage of a queued DVC experiment takes one: the queue runs experiments side by side (`dvc queue start -j J`),
    and two `tiny` train stages at once on 2 cores took 6-8x as long with two threads each as with one (341 against
    40 s; alone: 33 s on two threads, 39 on one; bench/shared_cores.py). Fixed, not counted at run time: the thread
    count changes the rounding, so a run's results must not hang on what else ran beside it. A stage taking every
    core while another stage runs on them (a `make run` beside DVC's queue) says so in one line: it ran 4-40x slower."""
    if os.environ.get("RLHF_TORCH_THREADS"):
        return env_int("RLHF_TORCH_THREADS", 1, minimum=1)
    if queued_from():
        return 1
    threads = len(os.sched_getaffinity(0))
    if threads > 1 and (others := other_stages()):
        print(
            f"rlhf: warning: {threads} torch threads, one per core, but another rlhf stage runs on these cores "
            f"({', '.join(others)}): beside one, a stage on every core ran 4-40x slower (docs/benchmarks.md); "
            "RLHF_TORCH_THREADS=1 takes one thread (its results round differently)",
            file=sys.stderr,
        )
    return threads


def other_stages() -> list[str]:
    """Other `rlhf` stage processes (`python -m rlhf.cli ...` or the `rlhf` script) whose cores overlap this one's,
    as `pid <command>`; not this process nor its ancestors (`accelerate launch ... -m rlhf.cli train`)."""
    import psutil

    me = psutil.Process()
    kin = {me.pid, *(p.pid for p in me.parents())}
    cores = os.sched_getaffinity(0)
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "rlhf.cli" in cmd:
            stage = cmd[cmd.index("rlhf.cli") :]
        elif len(cmd) > 1 and Path(cmd[1]).name == "rlhf":
            stage = ["rlhf", *cmd[2:]]
        else:
            continue
        try:
            if proc.info["pid"] not in kin and cores & set(proc.cpu_affinity()):
                found.append(f"pid {proc.info['pid']} `{' '.join(stage)}`")
        except psutil.Error:  # gone since, or not ours to inspect
            continue
    return found


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed on CPU compiles a shared-memory all-reduce (C++) when its process group starts, for its
    tensor-parallel inference (inference_all_reduce) only: ZeRO training reduces through torch.distributed (gloo)
    either way. The build took 40 s on a fast box and over 25 min on a slow one, and a build killed half-way left a
    lock file that every later run waited on forever, silently. DeepSpeed skips an op marked incompatible."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # ShareMemCommBuilder.NAME


def bounded_int(text: str, minimum: int = 0, maximum: int | None = None) -> int:
    """`text` as an integer in [minimum, maximum] (maximum None: no upper bound); else ValueError saying which."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"{minimum}-{maximum}"
        raise ValueError(f"expected an integer {bounds}")
    return value


def int_argument(minimum: int = 0, maximum: int | None = None):
    """argparse type: an integer in [minimum, maximum], refused in argparse's one line naming the argument."""
    import argparse

    def parse(text: str) -> int:
        try:
            return bounded_int(text, minimum, maximum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{e}, got {text!r}") from None

    return parse


def env_int(name: str, default: int, minimum: int = 0, maximum: int | None = None) -> int:
    """An integer environment variable the project reads; a malformed one is a one-line error naming it."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return bounded_int(raw, minimum, maximum)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r}: {e}") from None


def device():
    """This process's device as accelerate decides it (cuda:<local rank> on a GPU machine, else the CPU): every
    model of a stage and every tensor entering one lives there. The train stage takes it from its Accelerator."""
    from accelerate import PartialState

    return PartialState().device


def adamw(params, device, **hyper):
    """torch's AdamW for parameters trained on `device`. On a GPU its fused kernel: the default multi-tensor path
    allocates float32 temporaries the size of the weights at every step, 4 bytes per parameter at the peak
    (docs/gpu.md, "Memory per GPU"). On the CPU the default path, which the recorded CPU results were made with."""
    import torch

    return torch.optim.AdamW(params, fused=True if torch.device(device).type == "cuda" else None, **hyper)


def visible_gpus(gpus: list[int], parent: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that must see exactly `gpus` of this process's GPUs, numbered as this
    process numbers them (cuda:i is the i-th entry of its own CUDA_VISIBLE_DEVICES), in that order. A bare index
    would land the child on another physical GPU whenever this process's list is not 0,1,2,... (e.g. a training GPU).
    parent: this process's CUDA_VISIBLE_DEVICES (default: read it; unset = every GPU, in order). Every process this
    project starts on a GPU of its choosing takes its list from here."""
    parent = os.environ.get("CUDA_VISIBLE_DEVICES") if parent is None else parent
    if parent is None:
        return ",".join(str(g) for g in gpus)
    ids = [i.strip() for i in parent.split(",") if i.strip()]
    for g in gpus:
        if not 0 <= g < len(ids):
            raise ValueError(
                f"cuda:{g}: this process sees {len(ids)} GPU(s) (CUDA_VISIBLE_DEVICES={parent!r}), so it has no GPU {g}"
            )
    return ",".join(ids[g] for g in gpus)


# Cores this process keeps off while an engine of its runs there (engine key -> cores), and the cores it had before
# the first of them started.
_engine_cores: dict[object, set[int]] = {}
_cores_before_engines: set[int] = set()


def keep_off_cores(engine, cores: set[int]) -> None:
    """Keep this process off `cores` while `engine` (any hashable key of its own) runs there in another process, so
    the scheduler does not put the two on one core; `give_back_cores(engine)` ends it. Engines may start and stop in
    any order: this process runs on its cores from before the first engine less those some engine still runs on (all
    of them when the engines run on every one)."""
    global _cores_before_engines
    if not _engine_cores:
        _cores_before_engines = os.sched_getaffinity(0)
    _engine_cores[engine] = set(cores)
    _set_cores_left()


def give_back_cores(engine) -> None:
    """End keep_off_cores(engine); safe to call twice."""
    if _engine_cores.pop(engine, None) is not None:
        _set_cores_left()


def _set_cores_left() -> None:
    taken = set().union(*_engine_cores.values())
    os.sched_setaffinity(0, (_cores_before_engines - taken) or _cores_before_engines)


def map_in_processes(fn, items: list, processes: int) -> list:
    """[fn(item) for item in items], in up to `processes` worker processes at once, each set up as this one (the
    environment variables it inherits, one torch thread), when that is more than 1 and more than one CPU core is
    allowed; else here, one after another, on every core this process may use (`threads_alone`: the tiny profile's
    generate stage 13.9 -> 11.5 s on 2 cores). fn: a module-level function (spawned workers import it by name); items
    and results are pickled. A worker's exception is raised here, as it was raised there (its type and message)."""
    processes = min(processes, len(items), len(os.sched_getaffinity(0)))
    if processes <= 1:
        import torch

        torch.set_num_threads(threads_alone())
        return [fn(item) for item in items]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: a forked copy of a process that has touched CUDA or started threads is not safe to use
    with ProcessPoolExecutor(processes, mp_context=mp.get_context("spawn"), initializer=configure_torch) as pool:
        return list(pool.map(fn, items))


@contextlib.contextmanager
def scheduled_gc(every: int) -> Iterator[None]:
    """Python's cyclic garbage collector on the training loop's schedule (torchtitan's gc_freq, Megatron-LM's
    --manual-gc): off inside, but for `collect_garbage` after every `every`-th batch, so no collection lands inside a
    step (a young generation's scan took 0.1-1.4 ms mid-update here, with the device's queue draining meanwhile on a
    GPU). What exists when it starts (modules, models, the engine: ~1.3M objects on `ci`) is frozen out of every
    scan (gc.freeze); a full scan of it took ~0.3 s. every=0: Python's own schedule, untouched."""
    if not every:
        yield
        return
    gc.collect()  # what setup left behind, once, before freezing what survives
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def collect_garbage(every: int, t: int) -> None:
    """After batch t, under `scheduled_gc(every)`: collect the young generations on every `every`-th batch."""
    if every and t % every == every - 1:
        gc.collect(1)


def crash_point(name: str, index: int) -> None:
    """Fault injection for the resume tests: RLHF_CRASH_AT=name:index SIGKILLs this process here, the way
    an OOM kill or a pulled plug would. Points: after_update:<batch> (optimizer stepped, nothing saved yet) and
    checkpoint_write:<batch> (checkpoint folder half-written). Unset (always, outside tests): does nothing."""
    if os.environ.get("RLHF_CRASH_AT") == f"{name}:{index}":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """`python -m rlhf.runtime CMD ...`: run CMD in the configured environment (used by the Makefile).

    With no CMD, print the environment as `export` lines (`eval "$(python -m rlhf.runtime)"`).
    """
    import shlex

    argv = sys.argv[1:] if argv is None else argv
    # No torch here: its settings belong to the process that imports it (rlhf.cli's stages set them), and importing
    # it only to exec the command took 2.5 min on a slow box (three times in `make test`).
    configure_environment()
    venv_bin = str(Path(sys.executable).parent)
    os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    if not argv:
        for key in [*OFFLINE_ENV, *CACHE_ENV, "PATH"]:
            print(f"export {key}={shlex.quote(os.environ[key])}")
        return
    try:
        os.execvp(argv[0], argv)
    except OSError as e:  # as a shell says it: one line; exit 127 for a command not found, 126 for one not runnable
        found = not isinstance(e, FileNotFoundError)
        print(f"rlhf.runtime: {argv[0]}: {e.strerror if found else 'command not found'}", file=sys.stderr)
        sys.exit(126 if found else 127)


if __name__ == "__main__":
    main()
