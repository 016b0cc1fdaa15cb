"""Training checkpoints: model, optimizer, scheduler, RNG and loop state, written atomically.

A checkpoint folder is complete when its `trainer_state.json` exists: it is written last, inside a temporary
folder that is renamed into place, so a torn checkpoint is never picked up. Just before it, `files.json` records
every file's size: a checkpoint damaged later (a file cut short, deleted or edited into invalid JSON) is passed over
for the newest intact one, and the run says which. Everything a resumed run needs to
continue exactly as an uninterrupted one is here: accelerate's state (model, optimizer, scheduler, the
random/numpy/torch RNGs), the loop's own shuffle RNG, the metric rows logged so far (the final metrics average
the last quarter of them), and for the async engine the weights of the batches it was sampling ahead.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from accelerate.utils import broadcast_object_list

from rlhf.io import link_or_copy, read_json, write_json
from rlhf.models import lora
from rlhf.runtime import crash_point

STATE_FILE = "trainer_state.json"
MANIFEST = "files.json"  # relative path -> size in bytes, of every file the save wrote


@dataclass
class LoopState:
    batch: int = 0  # generated batches trained on so far (= the policy's weight version)
    episode: int = 0  # prompts consumed
    global_step: int = 0  # optimizer steps
    wandb_run_id: str | None = None  # a resumed run logs into the same W&B run


def _complete(folder: Path) -> list[Path]:
    """The checkpoints under `folder` whose save finished, oldest first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.glob("batch-*") if (p / STATE_FILE).is_file()), key=lambda p: p.name)


def damage(path: Path) -> str | None:
    """Why the complete checkpoint at `path` cannot be resumed from, or None: a file its save recorded is missing or
    has another size, or one of its JSON files does not parse. (A checkpoint saved before files.json existed is
    checked for its JSON files only.)"""
    recorded = {}
    try:
        read_json(path / STATE_FILE)
        if (path / MANIFEST).is_file():
            recorded = read_json(path / MANIFEST)
        for f in sorted(path.glob("*.json")):
            read_json(f)
    except ValueError as e:
        return str(e).split("; ")[0]  # "<file>: damaged JSON (...)"
    for name, size in recorded.items():
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, its save wrote {size}"
    return None


def latest(folder: Path) -> tuple[Path | None, list[str]]:
    """The newest complete and intact checkpoint under `folder` (or None), and one line for each newer damaged one
    that was passed over."""
    passed_over = []
    for path in reversed(_complete(folder)):
        why = damage(path)
        if why is None:
            return path, passed_over
        passed_over.append(f"checkpoint {path.name} is damaged ({why}): passed over")
    return None, passed_over


def save(
    accelerator,
    folder: Path,
    state: LoopState,
    rank_state: dict,
    extra_files: dict[str, str] | None = None,
    extra_dirs: dict[str, Path] | None = None,
    keep: int = 2,
    trainable_only: bool = False,
) -> Path:
    """accelerate's save_state (model/optimizer/scheduler/RNG, DeepSpeed-aware) + our loop state, atomically.

    rank_state: this process's own state (every rank saves one); extra_files: name -> text; extra_dirs:
    name -> a folder copied in (hard links where the disk allows). Main process only for the extras. Once the
    new checkpoint is complete, only the newest `keep` remain. trainable_only (LoRA): the frozen weights, which a
    resumed run loads from the SFT folder anyway, are left out.
    """
    final = folder / f"batch-{state.batch:06d}"
    # unique per run (rank 0's pid, shared with the other ranks): two runs never touch each other's temp folder
    tmp = folder / broadcast_object_list([f".tmp-batch-{state.batch:06d}-{os.getpid()}"])[0]
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        with _frozen_weights_left_out(accelerator, trainable_only) as kwargs:
            accelerator.save_state(str(tmp), **kwargs)
        write_json(tmp / f"rank_state_{accelerator.process_index}.json", rank_state)
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for name, text in (extra_files or {}).items():
                (tmp / name).write_text(text, encoding="utf-8")
            for name, src in (extra_dirs or {}).items():
                shutil.copytree(src, tmp / name, copy_function=link_or_copy)  # never modified in place
            crash_point("checkpoint_write", state.batch)
            sizes = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
            write_json(tmp / MANIFEST, sizes)
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
    for old in _complete(folder)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _trainable_only_kwargs(accelerator) -> tuple[dict, dict]:
    """save_state and load_state keyword arguments for a checkpoint of the trainable weights only (LoRA)."""
    if accelerator.state.deepspeed_plugin is not None:
        return {"exclude_frozen_parameters": True}, {"load_module_strict": False}
    return {}, {"strict": False}  # saving: the pre-hook of _frozen_weights_left_out drops them


@contextlib.contextmanager
def _frozen_weights_left_out(accelerator, trainable_only: bool):
    """save_state's keyword arguments; without DeepSpeed a hook that drops the frozen weights from what it saves."""
    save_kwargs = _trainable_only_kwargs(accelerator)[0] if trainable_only else {}
    if not trainable_only or accelerator.state.deepspeed_plugin is not None:
        yield save_kwargs
        return

    def drop_frozen(models, weights, output_dir):
        for model, state in zip(models, weights):
            trainable = lora.trainable_names(model)
            for name in [n for n in state if n not in trainable]:
                del state[name]

    hook = accelerator.register_save_state_pre_hook(drop_frozen)
    try:
        yield save_kwargs
    finally:
        hook.remove()


def load(accelerator, path: Path, trainable_only: bool = False) -> tuple[LoopState, dict]:
    """The loop state and this process's rank_state. trainable_only: the checkpoint holds only the weights that
    train (the others are the SFT's, already loaded), so the weights present are loaded by name. A file that does not
    load (damaged without a change of size) is a RuntimeError naming the checkpoint and the way out."""
    try:
        accelerator.load_state(str(path), **(_trainable_only_kwargs(accelerator)[1] if trainable_only else {}))
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        raise RuntimeError(
            f"checkpoint {path} could not be loaded ({type(e).__name__}: {first}); move it out of {path.parent} to "
            f"resume from an older one, or delete {path.parent} to start over"
        ) from e
    return LoopState(**read_json(path / STATE_FILE)), read_json(path / f"rank_state_{accelerator.process_index}.json")
