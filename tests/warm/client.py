"""The suite's warm `python` (README.md): hands a command it knows to the warm server, anything else to the real one.

Standard library only: it runs as `python -SE` (no site-packages), so it starts in a fraction of a second even where
importing torch takes minutes. What it sends: its arguments, environment, working folder and every file descriptor
it holds (stdin/out/err, and the pipes multiprocessing passes a child it spawns). What it does while the command
runs: forwards the signals a parent sends (Ctrl-C, terminate) and exits the way the command did (its status, or
killed by the same signal). If it is killed itself, the server kills the command.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

# What the server runs in a fork of itself: the CLI (`python -m rlhf.cli`, the venv's `rlhf` script as DVC's stages
# start it, `rlhf.runtime` launching it), accelerate's launcher, and the child a multiprocessing "spawn" context
# starts (vLLM's engine process), torchrun, and pytest-xdist's workers. Anything else runs fresh.
WARM_MODULES = ("rlhf.cli", "rlhf.runtime", "accelerate.commands.accelerate_cli", "accelerate.commands.launch")
WARM_MODULES += ("torch.distributed.run",)
WARM_SCRIPTS = ("rlhf",)  # console scripts of the interpreter's own bin folder
SPAWNED_CHILD = "from multiprocessing.spawn import spawn_main"
XDIST_WORKER = "import sys;exec(eval(sys.stdin.readline()))"  # execnet's bootstrap of a pytest-xdist worker
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def target(argv: list[str], bin_folder: str) -> tuple[str, str, str, list[str]] | None:
    """(`-m`, `-c` or "script", the module, code or script, the one-letter flags before it, the arguments after
    it) of a python command line, when it is one the server runs; else None. bin_folder: the real python's."""
    flags, i = "", 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c") and i + 1 < len(argv):
            what, rest = argv[i + 1], argv[i + 2 :]
            known = what in WARM_MODULES if arg == "-m" else what.startswith(SPAWNED_CHILD) or what == XDIST_WORKER
            return (arg, what, flags, rest) if known and set(flags) <= set("uB") else None
        if arg in ("-W", "-X"):
            i += 2
        elif arg.startswith("-") and len(arg) > 1 and arg != "--" and not arg.startswith(("-m", "-c", "-W", "-X")):
            flags, i = flags + arg[1:], i + 1
        elif os.path.dirname(arg) == bin_folder and os.path.basename(arg) in WARM_SCRIPTS and set(flags) <= set("uB"):
            return "script", arg, flags, argv[i + 1 :]
        else:
            return None  # another script, `-`, or an option this client does not know: the real interpreter's job
    return None


def _connect(path: str, server_pid: int, wait: float) -> socket.socket | None:
    """A connection to the server once it has imported its libraries; None if it failed or is gone."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if os.path.exists(path):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                return conn
            except OSError:
                conn.close()
        try:
            os.kill(server_pid, 0)
        except OSError:
            return None
        if os.path.exists(path + ".failed"):
            return None
        time.sleep(0.2)
    return None


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            break
        data += chunk
    return data.decode().strip()


def _exit_like(status: str) -> None:
    kind, _, number = status.partition(" ")
    if kind == "signal":
        if int(number) not in (signal.SIGKILL, signal.SIGSTOP):  # their handlers cannot be set: they are the default
            signal.signal(int(number), signal.SIG_DFL)
        os.kill(os.getpid(), int(number))
        os._exit(128 + int(number))
    if kind == "exit":
        os._exit(int(number))
    print(f"tests/warm/client.py: the warm server stopped answering ({status!r})", file=sys.stderr)
    os._exit(1)


def main(path: str, server_pid: int, real_python: str) -> None:
    argv = sys.argv[1:]
    if target(argv, os.path.dirname(real_python)) is None:
        os.execv(real_python, [real_python, *argv])
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if _is_open(fd)]
    conn = _connect(path, server_pid, float(os.environ.get("RLHF_WARM_WAIT", "1800")))
    if conn is None:
        os.execv(real_python, [real_python, *argv])
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}).encode()
    socket.send_fds(conn, [len(request).to_bytes(8, "big")], fds)
    conn.sendall(request)
    reply = _line(conn)
    if reply == "fresh":
        conn.close()
        os.execv(real_python, [real_python, *argv])
    pid = int(reply.split()[1])
    for fd in fds:
        if fd > 2:
            os.close(fd)  # the command holds them now: a pipe's end closes when the command's does
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    _exit_like(_line(conn))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False  # the descriptor listdir itself used
