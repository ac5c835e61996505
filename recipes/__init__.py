"""The shipped recipes (importable as tlt_recipes): YAML files installed with tlt as package data.

`tlt train tiny-cpu` finds them by name through tlt_cli/recipes.py; each file's first line is the
command that runs it.
"""
