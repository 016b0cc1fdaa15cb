"""Weight snapshots: the trainer's full weights copied out between optimizer steps, for an engine to load.

`snapshot_state_dict` gathers ZeRO-3 shards (a collective: every rank calls it) and clones, so later optimizer
steps cannot change the copy; `write_snapshot` writes it as safetensors into a new folder per version, atomically,
so an engine only ever sees complete folders.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from rlhf.io import atomic_dir

WEIGHTS_FILE = "model.safetensors"


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module):
    """Under ZeRO-3 each rank holds shards: gather the full weights for the duration of the block."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            yield
    else:
        yield


def snapshot_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of `model`'s full weights on the CPU (for I/O), {HF name: tensor}.

    Tied tensors become separate copies (safetensors refuses shared ones; vLLM skips lm_head.weight for tied
    models).
    """
    with gathered_parameters(model):
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in model.state_dict().items()}


def write_snapshot(state: dict[str, torch.Tensor], folder: Path) -> Path:
    """Write `state` as `folder`/model.safetensors, atomically: the folder appears only once it is complete."""
    from safetensors.torch import save_file

    with atomic_dir(folder) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE))
    return folder


def snapshot_folder(work_dir: Path, version: int) -> Path:
    """work_dir/policy-<pid>-v<version>: the pid keeps ranks sharing a work_dir apart; a new folder per version."""
    return Path(work_dir) / f"policy-{os.getpid()}-v{version:06d}"
