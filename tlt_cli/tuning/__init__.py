"""Measured per-machine choices and their cache.

What the fastest way to run something is depends on the machine (its CPU or GPU, its matrix units, cores,
threads, torch), so tlt measures it once per machine and model and caches the result on disk (cache.py: the
machine's key, one JSON record per key, written once under a file lock so concurrent ranks measure once).
Today: the linear-form plan (linear_forms.py), which the engine and the drafter receive as a plain
`LinearFormPlan`, the rollout's precision (precision.py: float32 or bfloat16) and the pass costs (pass_costs.py).
run_plan.py holds the run's plan, the one value `tlt train` makes of all its choices (these measurements, the
actor's update precision, the speculative plan) and hands every rank. The engine and the rollout below take
the results as plain values; the composition root above (tlt_cli/training/setup.py) asks this package.
"""
