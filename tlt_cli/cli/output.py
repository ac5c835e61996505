"""What every `tlt` command prints through: the console, the error console and `fail`, its one-sentence error."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from tlt_cli.display import keeps_one_line

console = Console()
error_console = Console(stderr=True)

USAGE_ERROR = 2


def fail(message: str, code: int = USAGE_ERROR) -> typer.Exit:
    # escaped: a message can quote text with brackets (a gloo error's "[/path/pair.cc:537]"), which is not markup
    error_console.print(
        f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=keeps_one_line(error_console)
    )
    return typer.Exit(code)
