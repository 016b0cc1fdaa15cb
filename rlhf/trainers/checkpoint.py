"""Training checkpoints: model, optimizer, scheduler, RNG and loop state, written atomically.

A checkpoint folder is complete when its `trainer_state.json` exists: it is written last, inside a temporary
folder that is renamed into place, so a torn checkpoint is never picked up. Everything a resumed run needs to
continue exactly as an uninterrupted one is here: accelerate's state (model, optimizer, scheduler, the
random/numpy/torch RNGs), the loop's own shuffle RNG, the metric rows logged so far (the final metrics average
the last quarter of them), and for the async engine the weights of the batches it was sampling ahead.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate.utils import broadcast_object_list

from rlhf.io import read_json, write_json
from rlhf.runtime import crash_point

STATE_FILE = "trainer_state.json"


@dataclass
class LoopState:
    batch: int = 0  # generated batches trained on so far (= the policy's weight version)
    episode: int = 0  # prompts consumed
    global_step: int = 0  # optimizer steps
    wandb_run_id: str | None = None  # a resumed run logs into the same W&B run


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    if not folder.is_dir():
        return None
    done = [p for p in folder.glob("batch-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save(
    accelerator,
    folder: Path,
    state: LoopState,
    rank_state: dict,
    extra_files: dict[str, str] | None = None,
    extra_dirs: dict[str, Path] | None = None,
    keep: int = 2,
) -> Path:
    """accelerate's save_state (model/optimizer/scheduler/RNG, DeepSpeed-aware) + our loop state, atomically.

    rank_state: this process's own state (every rank saves one); extra_files: name -> text; extra_dirs:
    name -> a folder copied in (hard links where the disk allows). Main process only for the extras. Once the
    new checkpoint is complete, only the newest `keep` remain.
    """
    final = folder / f"batch-{state.batch:06d}"
    # unique per run (rank 0's pid, shared with the other ranks): two runs never touch each other's temp folder
    tmp = folder / broadcast_object_list([f".tmp-batch-{state.batch:06d}-{os.getpid()}"])[0]
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        write_json(tmp / f"rank_state_{accelerator.process_index}.json", rank_state)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            for name, src in (extra_dirs or {}).items():
                shutil.copytree(src, tmp / name, copy_function=_link_or_copy)
            crash_point("checkpoint_write", state.batch)
            write_json(tmp / STATE_FILE, asdict(state))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _prune(folder, keep)
    except BaseException as e:
        # A full disk must not stay full of a checkpoint that can never be loaded; earlier ones are untouched.
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            cause = "disk full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise OSError(
                e.errno,
                f"checkpoint {final} not written ({cause}); its partial folder was removed, the checkpoints already "
                f"in {folder} are intact",
            ) from e
        raise
    accelerator.wait_for_everyone()
    return final


def _prune(folder: Path, keep: int) -> None:
    """Delete complete checkpoints older than the newest `keep` (a resume needs the newest one only)."""
    done = sorted((p for p in folder.glob("batch-*") if (p / STATE_FILE).is_file()), key=lambda p: p.name)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the source is never modified in place (new folder per version): safe to share
    except OSError:
        shutil.copy2(src, dst)


def load(accelerator, path: Path) -> tuple[LoopState, dict]:
    """The loop state and this process's rank_state."""
    accelerator.load_state(str(path))
    return LoopState(**read_json(path / STATE_FILE)), read_json(path / f"rank_state_{accelerator.process_index}.json")
