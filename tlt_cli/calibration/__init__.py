"""`tlt calibrate`: measure this machine and this model pair, and write the adaptive SD rule table.

measure.py times natural rollouts of a worker shard step by step, SD off and per configuration,
and sums them by running batch size; rules.py turns the measurements into `speculative.rules` (a pure function);
recipe_text.py rewrites the rules block of a recipe file in place; report.py prints the tables
and writes the JSON and the YAML fragment; calibrate.py ties them together for the CLI.
"""
