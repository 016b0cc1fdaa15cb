"""The warm server: imports the suite's libraries once, then forks each command a warm `python` hands it.

Started by `warm.start()` as `python tests/warm/server.py SOCKET PYTHON` (tests/warm/README.md). It imports what the
stages, accelerate's launcher, torchrun and vLLM's engine process import, freezes it, listens on SOCKET, and runs
each command it is sent in a fork of itself: its own arguments, environment, working folder, file descriptors, exit
status and signals, minus the imports. It stops when the process that started it exits (its stdin closes).

What differs from a fresh interpreter: the libraries were imported under the suite's environment (a command whose
environment differs in a variable read at import, IMPORT_TIME below, runs fresh); the process's parent is the
server, not the caller (the caller's `python` relays signals and the exit status); hash randomisation is shared.
Tests about the process itself (what it imports, its pid, its children) start the real interpreter.
"""

from __future__ import annotations

import atexit
import builtins
import fcntl
import gc
import importlib
import json
import multiprocessing.spawn
import os
import runpy
import select
import shutil
import signal
import socket
import sys
import threading
import traceback
import types
import weakref
from pathlib import Path

# Variables a preloaded library reads when imported: a command that sets them differently runs fresh.
IMPORT_TIME = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONSAFEPATH", "PYTHONHOME", "HF_", "HUGGINGFACE_", "TRANSFORMERS_")
IMPORT_TIME += ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LD_PRELOAD", "LD_LIBRARY_PATH", "RLHF_CACHE_DIR", "CUDA_")


def _serve(sock: str, python: str) -> None:
    from rlhf import runtime

    runtime.configure()
    before = dict(os.environ)
    from rlhf.cli import PIPELINE

    preload = [f"rlhf.stages.{s}" for s in PIPELINE] + ["rlhf.trainers.setup", "rlhf.trainers.loop", "deepspeed"]
    # Not wandb: importing it patches sys.stdout's write for its console log, and a pytest worker forked from here
    # writes to pytest's own stream, which a patch made here would miss (the run's output.log stayed empty).
    preload += ["rlhf.generation.engine_process", "accelerate.commands.accelerate_cli"]
    preload += ["accelerate.commands.launch", "torch.distributed.run"]
    try:
        for module in preload:
            importlib.import_module(module)
        sys.modules["rlhf.generation.engine_process"].import_ahead()  # vLLM's engine code (vLLM imports it lazily)
    except BaseException:
        Path(sock + ".failed").write_text(traceback.format_exc())
        raise
    # The imported objects are shared with every fork until written to, and a garbage collection writes to every
    # object it visits: a command's first full collection copied them all (minutes at 0.1 GB/s). Frozen objects are
    # never visited.
    gc.freeze()
    # What the imports made for the process to delete at exit (wandb's media folder, a TemporaryDirectory) is shared
    # by every fork: the first command to exit would delete it under the others. The server deletes them at its end.
    owned = list(weakref.finalize._registry)
    for finalizer in owned:
        finalizer.atexit = False
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    base_path = sys.path[1:]  # a fresh interpreter's, without this file's folder
    print(f"imported {len(sys.modules)} modules; threads: {threading.enumerate()}", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock + ".tmp")
    listener.listen(64)
    os.rename(sock + ".tmp", sock)  # clients connect once it is there
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the per-command managers
    while True:
        ready, _, _ = select.select([listener, 0], [], [])
        if 0 in ready and not os.read(0, 1):  # the pytest session is over
            shutil.rmtree(Path(sock).parent, ignore_errors=True)
            for finalizer in owned:
                finalizer()
            return
        if listener in ready:
            conn, _ = listener.accept()
            sys.stdout.flush()
            if os.fork() == 0:
                listener.close()
                _manage(conn, (before, set_by_imports, base_path, python))
                os._exit(0)
            conn.close()


def _manage(conn: socket.socket, state: tuple) -> None:
    """One command: check it can run warm, fork it, then report how it ended (killing it if the client dies)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    length, fds, _, _ = socket.recv_fds(conn, 8, 253)
    size, data = int.from_bytes(length, "big"), b""
    while len(data) < size:
        data += conn.recv(size - len(data))
    request = json.loads(data)
    target, (before, set_by_imports) = client.target(request["argv"], str(Path(sys.executable).parent)), state[:2]
    keys = {k for k in {*before, *request["env"]} if k.startswith(IMPORT_TIME)}
    # a value the imports here set themselves is theirs (vLLM extends LD_LIBRARY_PATH), not a different setting
    differ = {k for k in keys if request["env"].get(k) not in (before.get(k), set_by_imports.get(k, before.get(k)))}
    if differ == {"PYTHONPATH"} and not before.get("PYTHONPATH") and not _shadowed(_python_path(request["env"])):
        differ = set()  # folders put before the libraries (accelerate adds the working folder) hiding none of them
    if target is None or differ:
        print(f"fresh: {request['argv'][:3]} (import-time variables {sorted(differ)})", flush=True)
        conn.sendall(b"fresh\n")
        return
    pid = os.fork()
    if pid == 0:
        conn.close()
        _command(request, fds, target, state)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"pid {pid}\n".encode())
    watched = [conn, os.pidfd_open(pid)]
    while watched[-1] not in select.select(watched, [], [])[0]:
        if not conn.recv(1):  # the client was killed: so is its command
            os.kill(pid, signal.SIGKILL)
            watched = watched[1:]
    _, status = os.waitpid(pid, 0)
    end = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    try:
        conn.sendall(f"{end}\n".encode())
    except OSError:
        pass


def _python_path(env: dict) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _shadowed(folders: list[str]) -> bool:
    """Whether a module or package in `folders` has the name of one imported here from elsewhere."""
    for folder in folders:
        names = {n.removesuffix(".py") for n in (os.listdir(folder) if os.path.isdir(folder) else [])}
        for name in names & set(sys.modules):
            origin = getattr(sys.modules[name], "__file__", None) or ""
            if not origin.startswith(os.path.join(folder, name)):
                return True
    return False


def _command(request: dict, fds: list[int], target: tuple, state: tuple) -> None:
    """The forked command: take the client's descriptors, folder, environment and arguments, run, exit."""
    option, what, flags, rest = target
    _, set_by_imports, base_path, python = state
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1000) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, number in zip(high, request["fds"], strict=True):
        os.dup2(fd, number)
        os.close(fd)
    for number in {0, 1, 2} - set(request["fds"]):
        os.close(number)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**set_by_imports, **request["env"]})
    sys.executable = python
    multiprocessing.spawn.set_executable(python)
    sys.dont_write_bytecode = "B" in flags or bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    unbuffered = "u" in flags or bool(os.environ.get("PYTHONUNBUFFERED"))
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=stream is sys.stderr or stream.isatty(), write_through=unbuffered)
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    first = {"-m": os.getcwd(), "-c": "", "script": os.path.dirname(what)}[option]
    sys.path[:] = [first, *_python_path(os.environ), *base_path]
    sys.argv = [what if option == "script" else option, *rest]
    os._exit(_run(option, what, main))


def _run(option: str, what: str, main: types.ModuleType) -> int:
    """Run the module or code as the interpreter would, and end the way it ends (exit hooks included)."""
    code, interrupted = 1, False
    try:
        if option == "-m":
            sys.modules.pop(what, None)  # imported here as a library; a fresh `python -m` has it as __main__ only
            runpy._run_module_as_main(what)
        elif option == "script":
            runpy.run_path(what, run_name="__main__")
        else:
            exec(compile(what, "<string>", "exec"), main.__dict__)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        traceback.print_exc()
        interrupted = True
    except BaseException:
        sys.excepthook(*sys.exc_info())
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # as CPython ends on an uncaught KeyboardInterrupt: killed by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code & 0xFF


if __name__ == "__main__":
    # Python put this file's folder (tests/warm) first on sys.path: tests/ goes there instead, so that `warm` imports
    # as the package the suite's processes (forked from here) know, and base_path (sys.path[1:]) is still a fresh
    # interpreter's.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from warm import client

    _serve(sys.argv[1], sys.argv[2])
