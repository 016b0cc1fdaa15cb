"""Reward functions: the gold judge (independent of every trained model) and the proxy reward."""
