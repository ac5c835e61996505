"""`tlt calibrate`: measure this machine and this model pair, and write the adaptive SD rule table.

measure.py times fixed windows of decode steps at a fixed running batch size, SD off and per
configuration; rules.py turns the measurements into `speculative.rules` (a pure function);
recipe_text.py rewrites the rules block of a recipe file in place; report.py prints the tables
and writes the JSON and the YAML fragment; calibrate.py ties them together for the CLI.
"""
