"""Atomic writes: a stage's output either exists whole or not at all (never half-written but valid-looking)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `path` by rename, on error it is removed.

    The old `path` stays intact until the new one is complete.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path.with_name(f".{path.name}.old-{os.getpid()}")
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path | str, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: Path | str):
    return json.loads(Path(path).read_text(encoding="utf-8"))
