"""Measured per-machine choices and their cache.

What the fastest way to run something is depends on the machine (its CPU or GPU, its matrix units, cores,
threads, torch), so tlt measures it once per machine and model and caches the result on disk (cache.py: the
machine's key, one JSON record per key, written once under a file lock so concurrent ranks measure once).
Today: the linear-form plan (linear_forms.py), which the engine and the drafter receive as a plain
`LinearFormPlan`, and the rollout's precision (precision.py: float32 or bfloat16). The engine below stays pure
tensors; the rollout backends above ask this package.
"""
