"""Pure-tensor RL math: one module per algorithm plus shared masked helpers (common). Imports nothing."""
