"""Training checkpoints: model, optimizer, scheduler, RNG and loop state, written atomically.

A checkpoint folder is complete when its `trainer_state.json` exists: it is written last, inside a temporary
folder that is renamed into place, so a torn checkpoint is never picked up.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhf.io import read_json, write_json

STATE_FILE = "trainer_state.json"


@dataclass
class LoopState:
    batch: int = 0  # generated batches trained on so far (= the policy's weight version)
    episode: int = 0  # prompts consumed
    global_step: int = 0  # optimizer steps


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    if not folder.is_dir():
        return None
    done = [p for p in folder.glob("batch-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def save(accelerator, folder: Path, state: LoopState, extra_files: dict[str, str] | None = None) -> Path:
    """accelerate's save_state (model/optimizer/scheduler/RNG, DeepSpeed-aware) + our loop state, atomically."""
    final = folder / f"batch-{state.batch:06d}"
    tmp = folder / f".tmp-batch-{state.batch:06d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_json(tmp / STATE_FILE, asdict(state))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: Path) -> LoopState:
    accelerator.load_state(str(path))
    return LoopState(**read_json(path / STATE_FILE))
