"""Measured per-machine choices and their cache: the rollout's precision (precision.py), keyed and cached by
machine.py. Measured once per machine and model, then read back."""
