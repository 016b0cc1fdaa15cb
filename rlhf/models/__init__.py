"""Models: loading (local folder, hub id, packaged SmolLM2 GGUF) and the tiny-model factory, the batch layout
(`batch`) and the forward passes over it (`forward`).

Import the submodules directly (`rlhf.models.loading`, `rlhf.models.forward`, ...); this package imports nothing
so that importing it stays cheap.
"""
