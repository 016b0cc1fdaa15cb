"""Keep transformers' model classes as they are while vLLM builds an engine in this process.

vLLM 0.32 has no model code of its own for GPT-NeoX (Pythia): its registry serves GPTNeoXForCausalLM with the
Transformers backend (vllm/model_executor/models/registry.py, "GPTNeoXForCausalLM": ("transformers", ...)), which
marks transformers' own decoder class for torch.compile IN PLACE (vllm/model_executor/models/transformers/base.py
`_decorate_for_torch_compile` -> vllm/compilation/decorators.py `_support_torch_compile`: it appends
TorchCompileWithNoGuardsWrapper to `GPTNeoXModel.__bases__` and replaces its `__init__` and `__call__`). From then
on every HF GPT-NeoX of the process fails: one built before (the trainer's policy, beside a colocated engine) with
"AttributeError: 'GPTNeoXModel' object has no attribute 'do_not_compile'" (decorators.py, the new __call__), one
built after (a reference or reward model) with "AssertionError: Current vLLM config is not set" (the new __init__).
Llama is unaffected: vLLM runs it with its own code (vllm/model_executor/models/llama.py).

Undoing the marks once the engine is built is exact here: our engines run eager (enforce_eager=True), so the engine's
own instance never compiles and its replaced __call__ only called `self.forward`, as nn.Module's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def hf_classes_kept(model_folder: Path) -> Iterator[None]:
    """Build a vLLM engine for `model_folder` inside: on exit the transformers class that vLLM's Transformers backend
    would decorate (the folder's AutoModel class) is restored as it was (its bases and every attribute the block set
    or replaced). A model vLLM runs with its own code (Llama) leaves it untouched: nothing to restore."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(model_folder, trust_remote_code=False)
    cls = AutoModel._model_mapping.get(type(config), None)
    saved = (cls.__bases__, dict(cls.__dict__)) if cls is not None else None
    try:
        yield
    finally:
        if saved is not None:
            _restore(cls, *saved)


def _restore(cls: type, bases: tuple[type, ...], attrs: dict) -> None:
    if cls.__bases__ != bases:
        cls.__bases__ = bases
    for name in set(cls.__dict__) - set(attrs):
        delattr(cls, name)
    for name, value in attrs.items():
        if cls.__dict__.get(name) is not value and name not in ("__dict__", "__weakref__", "__doc__"):
            setattr(cls, name, value)
