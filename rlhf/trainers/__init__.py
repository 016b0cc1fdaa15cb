"""The online loop (loop.py) and the trainer presets (presets.py)."""
