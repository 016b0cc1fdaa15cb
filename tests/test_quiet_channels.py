"""The trainer's channels to the engine process stay quiet when the engine dies mid-transfer
(rlhf.generation.quiet_channels): the trainer's own one line says so. Real multiprocessing helpers, real sockets and
pipes, each case in a fresh interpreter (the hooks are per process)."""

from __future__ import annotations

import subprocess
import sys

FD_SERVER_PEER_RESETS = """
import os, socket, sys, time
from multiprocessing import resource_sharer
from rlhf.generation.quiet_channels import quiet_fd_server

def handshake_reset():
    # a peer that connects and dies before answering the server's challenge (a SIGKILLed engine): the server's read
    # of the answer fails with ECONNRESET, as seen in CI
    s = socket.socket(socket.AF_UNIX)
    s.connect(resource_sharer._resource_sharer._address)
    time.sleep(0.3)  # the challenge arrives, unread
    s.close()
    time.sleep(0.5)

resource_sharer.DupFd(os.pipe()[0])  # starts the fd server thread, as sharing a tensor does
handshake_reset()
print("=== hooked", file=sys.stderr, flush=True)
quiet_fd_server()
quiet_fd_server()  # once per process
handshake_reset()
sys.excepthook(ValueError, ValueError("other errors still print"), None)
"""

FEEDER_PEER_GONE = """
import multiprocessing as mp, pickle, sys, time
from rlhf.generation.quiet_channels import EngineInbox

def feed(queue, obj):
    queue._reader.close()  # the engine's end of the pipe, gone with it
    queue.put(obj)
    time.sleep(0.5)  # the feeder thread writes, fails, reports

ctx = mp.get_context("spawn")
feed(ctx.Queue(), "weights")
print("=== engine inbox", file=sys.stderr, flush=True)
feed(EngineInbox(ctx=ctx), "weights")
print("=== a message that does not pickle", file=sys.stderr, flush=True)
feed(EngineInbox(ctx=ctx), lambda: None)
"""


def _stderr(script: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr


def test_the_fd_servers_lost_peer_is_not_printed_and_other_errors_are():
    before, after = _stderr(FD_SERVER_PEER_RESETS).split("=== hooked")
    assert "ConnectionResetError" in before and "resource_sharer.py" in before  # what the trainer printed unhooked
    assert "ConnectionResetError" not in after and "Traceback" not in after
    assert "ValueError: other errors still print" in after


def test_the_engine_inbox_drops_a_message_to_a_dead_engine_quietly_and_reports_one_that_does_not_pickle():
    plain, rest = _stderr(FEEDER_PEER_GONE).split("=== engine inbox")
    inbox, unpicklable = rest.split("=== a message that does not pickle")
    assert "BrokenPipeError" in plain  # multiprocessing's own Queue: the feeder thread's traceback
    assert inbox.strip() == ""
    assert "Traceback" in unpicklable and "pickle" in unpicklable
