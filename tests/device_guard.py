"""A second device on a CPU-only machine, for tests: the training device becomes `meta` while the default device
stays the CPU, as on a GPU machine (training device cuda, default device cpu).

- `ACCELERATE_TORCH_DEVICE=meta`: accelerate's device (the one the project threads through) is `meta`, so
  `Accelerator.prepare` puts the model there and every `.to(acc.device)` moves to it.
- `DeviceAudit`, a TorchFunctionMode: every torch op whose tensor arguments sit on more than one device raises
  DeviceMismatch, naming the op and the project's line that called it. CUDA's own exceptions are allowed (a 0-dim
  CPU tensor in an op, CPU index tensors in indexing); the cases meta alone lets through silently (an embedding
  lookup with CPU indices into meta weights, a CPU tensor indexed by a meta one) are caught.
- Meta tensors hold no values: reading one into Python (item, tolist, bool, int, float, a copy to the CPU) gives
  zeros (True for bool, a large int so counts pass their checks), so the code runs on through its data-dependent
  steps. The results are meaningless; only where tensors live is checked. `numpy()` of a device tensor raises,
  as on CUDA: it must be copied to the CPU first.

This stands in for a GPU, which cannot exist here (shared/reference/platform.md: CPU torch cannot make CUDA
tensors). What it cannot see: vLLM's own internals (they run on the CPU here), and value-dependent paths that
only real data takes.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

PROJECT = Path(__file__).resolve().parent.parent
DUMMY_INT = 1 << 20  # large enough for every count checked against a minimum

_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}
_INDEX = (torch.long, torch.int, torch.bool)
# Ops that legitimately take tensors on two devices: moves and copies between them (and torch's own check
# inside Module.to).
_CROSS_DEVICE = {"to", "copy_", "_has_compatible_shallow_copy_type", "__set__", "set_", "swap_tensors"}
_TO_PYTHON = {
    torch.Tensor.item: lambda t: 0 if not t.is_floating_point() else 0.0,
    torch.Tensor.__bool__: lambda t: True,
    torch.Tensor.__int__: lambda t: DUMMY_INT,
    torch.Tensor.__index__: lambda t: DUMMY_INT,
    torch.Tensor.__float__: lambda t: 0.0,
    torch.Tensor.tolist: lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist(),
}


# Whole-tensor any()/all() on meta answer as benign data would: nothing anomalous (any -> False), everything
# as expected (all -> True), so checks like `if (x < 0).any(): raise` and `if not isfinite(x).all(): raise` pass.
_BENIGN = {torch.any: False, torch.Tensor.any: False, torch.all: True, torch.Tensor.all: True}


class DeviceMismatch(RuntimeError):
    pass


def _where() -> str:
    """The innermost frame in the project's own code (not tests/), for the message."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename).resolve()
        if PROJECT in path.parents and "tests" not in path.relative_to(PROJECT).parts[:1]:
            return f"{path.relative_to(PROJECT)}:{frame.lineno} ({frame.line})"
    return "outside the project"


def _is_cpu_move(func, args, kwargs) -> bool:
    """t.cpu(), t.to("cpu"), t.to(torch.device("cpu")), t.to(device="cpu") (dtype-only moves are not moves)."""
    if func is torch.Tensor.cpu:
        return True
    if func is torch.Tensor.to:
        target = kwargs.get("device", args[1] if len(args) > 1 else None)
        return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"
    return False


def _is_blocking_upload(func, args, kwargs) -> bool:
    """A copy from the host to the device that waits: `t.to(device)` of a CPU tensor without non_blocking=True, or
    `torch.tensor(data, device=device)`. On CUDA, PyTorch synchronises the stream after such a copy: the host waits
    for every kernel queued before it, as at a read."""
    if func is torch.tensor or func is torch.as_tensor:
        target = kwargs.get("device")
        on_host = not isinstance(args[0], torch.Tensor) or args[0].device.type == "cpu"
        return on_host and target is not None and torch.device(target).type == "meta"
    if func is not torch.Tensor.to or args[0].device.type != "cpu":
        return False
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    waits = not kwargs.get("non_blocking", any(a is True for a in args[2:]))
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "meta" and waits


class DeviceAudit(TorchFunctionMode):
    """Audits every torch op; `on_device` counts the ops that ran on the training device: a run whose tensors never
    reached it (the device setting ignored, everything on the CPU) would pass the audit with none."""

    device = torch.device("meta")

    def __init__(self):
        super().__init__()
        self.on_device = 0
        self.blocking_copies: Counter[str] = Counter()  # project line -> host-to-device copies that wait

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.on_device += any(t.is_meta for t in tensors)
        if _is_blocking_upload(func, args, kwargs):
            self.blocking_copies[_where()] += 1
        if func is torch.Tensor.numpy and tensors[0].is_meta:  # as CUDA does: numpy() reads host memory only
            raise DeviceMismatch(f"numpy() of a tensor on the device (call .cpu() first) at {_where()}")
        if func in _TO_PYTHON and tensors and tensors[0].is_meta:
            return _TO_PYTHON[func](tensors[0])
        if func in _BENIGN and tensors[0].is_meta and len(args) == 1 and not kwargs:
            return torch.tensor(_BENIGN[func])
        if _is_cpu_move(func, args, kwargs) and tensors[0].is_meta:  # I/O: values leave the device
            return torch.zeros(tensors[0].shape, dtype=kwargs.get("dtype", tensors[0].dtype))
        if func is torch.Tensor.copy_ and args[0].device.type == "cpu" and args[1].is_meta:  # into host memory
            with torch.no_grad():
                return args[0].zero_()
        if func in _INDEXING:  # CUDA takes CPU integer/bool index tensors into a device tensor
            tensors = tensors[:1] + [t for t in tensors[1:] if not (t.device.type == "cpu" and t.dtype in _INDEX)]
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        name = getattr(func, "__name__", str(func))
        if len(devices) > 1 and name not in _CROSS_DEVICE:
            raise DeviceMismatch(f"{name} mixes tensors on {sorted(devices)} at {_where()}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def training_device_elsewhere():
    """The training device is `meta` (accelerate's), the default device the CPU, every op audited: yields the
    DeviceAudit (its `device`, and `on_device`, the count of ops that ran there)."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    before = os.environ.get("ACCELERATE_TORCH_DEVICE")
    os.environ["ACCELERATE_TORCH_DEVICE"] = "meta"
    try:
        with DeviceAudit() as audit:
            yield audit
    finally:
        if before is None:
            os.environ.pop("ACCELERATE_TORCH_DEVICE", None)
        else:
            os.environ["ACCELERATE_TORCH_DEVICE"] = before
        AcceleratorState._reset_state(reset_partial_state=True)
