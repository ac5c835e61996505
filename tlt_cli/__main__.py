"""`python -m tlt_cli` runs the `tlt` command line."""

from tlt_cli.cli import app

app()
