"""Model loading (local folder, hub id, packaged SmolLM2 GGUF), reward/value heads and the tiny-model factory.

Import the submodules directly (`rlhf.models.loading`, `rlhf.models.tiny`); this package imports nothing so
that importing it stays cheap.
"""
