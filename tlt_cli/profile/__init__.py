"""`tlt profile`: read (or record) rollouts, measure the long tail and idle workers, project what SD in the
tail would save.

records.py reads the inputs, recording.py records a fresh rollout of a recipe, analysis.py computes
the numbers, report.py prints them, plots.py draws the PNGs, profiler.py ties them together for the CLI.
"""
