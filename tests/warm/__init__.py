"""A warm `python` for the processes the suite starts, forked from a server that has imported their libraries.

What, why, how and how to switch it off: README.md beside this file. This is the suite's side: `start()` (the
`python` to start instead of sys.executable) and `path()` (PATH with warm `rlhf`, `accelerate`, `torchrun`). With
RLHF_WARM=0 both hand back the plain interpreter and PATH, and no server starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
# The one switch: RLHF_WARM=0 and every process the suite starts is a plain `sys.executable` one.
ON = os.environ.get("RLHF_WARM", "1") != "0"

_server: dict = {}


def start() -> Path:
    """Start this process's server (once; it imports in the background) and return the `python` that uses it."""
    if not ON:
        return Path(sys.executable)
    if _server:
        return _server["python"]
    shared = os.environ.get("RLHF_WARM_PYTHON")
    if shared and Path(shared).exists():  # the server pytest-xdist's controller started, shared by its workers
        _server.update(python=Path(shared))
        return _server["python"]
    folder = Path(tempfile.mkdtemp(prefix="rlhf-warm-"))
    sock, python = folder / "server.sock", folder / "python"
    with open(folder / "server.log", "wb") as log:  # the server writes to its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(FOLDER / "server.py"), str(sock), str(python)],
            stdin=subprocess.PIPE,  # its end of life: this process's exit closes the pipe (kept open by `proc`)
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C meant for the suite's commands never reaches the server
        )
    # The client module alone (not this package): it runs as `python -SE` and must start in a fraction of a second.
    client = f"import sys; sys.path.insert(0, {str(FOLDER)!r}); import client\n"
    client += f"client.main({str(sock)!r}, {proc.pid}, {sys.executable!r})\n"
    python.write_text(f"#!{sys.executable} -SE\n{client}")
    bin_folder = Path(sys.executable).parent  # where the venv's console scripts are
    wrappers = [("accelerate", "-m accelerate.commands.accelerate_cli"), ("torchrun", "-m torch.distributed.run")]
    for name, how in [*wrappers, ("rlhf", f'"{bin_folder}/rlhf"')]:
        (folder / name).write_text(f'#!/bin/sh\nexec "{python}" {how} "$@"\n')  # found first on PATH: path()
        (folder / name).chmod(0o755)
    python.chmod(0o755)
    _server.update(python=python, proc=proc)
    os.environ["RLHF_WARM_PYTHON"] = str(python)  # inherited by the workers pytest-xdist starts after this
    os.environ["RLHF_WARM_REAL_PYTHON"] = sys.executable
    return python


def path(base: str) -> str:
    """PATH with the warm `python`, `rlhf` and `accelerate` first: DVC's stages run `exec python -m rlhf.cli STAGE`."""
    return f"{start().parent}{os.pathsep}{base}" if ON else base
