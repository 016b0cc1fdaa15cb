"""The trainer's side of the engine process's channels, quiet when the engine dies mid-transfer.

multiprocessing moves a message to the engine with helper threads in the trainer: a queue's feeder thread writes it to
the pipe, and the fd server (multiprocessing.resource_sharer) hands the engine the file descriptors of the tensors a
message shares (torch.multiprocessing's default strategy). When the engine is killed while one of them is at work, the
thread's write or handshake fails and Python printed its traceback beside the one line the trainer says itself
(EngineProcess.dead: the engine's pid and signal). Seen in CI (2026-12-04): a SIGKILLed engine, a
ConnectionResetError from the fd server's handshake, printed through the trainer's error line.
"""

from __future__ import annotations

import multiprocessing.queues
import sys
from types import TracebackType

PEER_GONE = (BrokenPipeError, ConnectionError, EOFError)  # what a write or read to a dead process raises


class EngineInbox(multiprocessing.queues.Queue):
    """A multiprocessing Queue whose feeder thread drops, without a traceback, a message the engine can no longer
    take (its end of the pipe closed with it); any other failure (a message that does not pickle) is printed as
    before. The trainer finds the death on its own channel and says so once."""

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: object) -> None:
        if not isinstance(e, PEER_GONE):
            multiprocessing.queues.Queue._on_queue_feeder_error(e, obj)


def quiet_fd_server() -> None:
    """Drop the fd server's lost-peer errors from this process's `sys.excepthook` (the server thread catches its own
    exceptions and hands them to it, then serves on), passing every other exception to the hook before. Once."""
    previous = sys.excepthook
    if getattr(previous, "quiets_fd_server", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(exc_type, PEER_GONE) and _in_fd_server(tb):
            return
        previous(exc_type, exc, tb)

    hook.quiets_fd_server = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _in_fd_server(tb: TracebackType | None) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("multiprocessing/resource_sharer.py"):
            return True
        tb = tb.tb_next
    return False
