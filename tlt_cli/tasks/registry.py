"""Tasks by name, as a recipe names them: `build_task("arithmetic", seed, options)`.

`options` are the task's keyword arguments from the recipe's `task.options` (for example `path`
for `jsonl_math`, `max_terms` for `arithmetic`, `max_steps` for `word_arithmetic`), checked
against the options the task declares (`Task.options`: type, default, range) before it is built;
an unknown task raises `UnknownTaskError`, an unknown, missing, mistyped or out-of-range option
`TaskOptionError`, each naming the key. Building a task reads its data, so a bad data file fails
here too, naming the line.
"""

from __future__ import annotations

from collections.abc import Callable

from tlt_cli.errors import UserError
from tlt_cli.tasks.arithmetic import ArithmeticTask
from tlt_cli.tasks.base import REQUIRED, Task, TaskOptionError
from tlt_cli.tasks.jsonl_math import JsonlMathTask
from tlt_cli.tasks.word_arithmetic import WordArithmeticTask

TASKS: dict[str, Callable[..., Task]] = {
    ArithmeticTask.name: ArithmeticTask,
    JsonlMathTask.name: JsonlMathTask,
    WordArithmeticTask.name: WordArithmeticTask,
}


class UnknownTaskError(UserError):
    """The recipe names a task that is not registered."""


def build_task(name: str, seed: int, options: dict) -> Task:
    """The task registered as `name`, built with `seed` and the recipe's `options` (checked first)."""
    if name not in TASKS:
        raise UnknownTaskError(f"task.name {name!r} is not a task; choose one of: {', '.join(sorted(TASKS))}.")
    check_options(name, options)
    return TASKS[name](seed=seed, **options)


def check_options(name: str, options: dict) -> None:
    """Raise TaskOptionError naming the first option of `options` that task `name` does not take as given."""
    declared = {option.name: option for option in TASKS[name].options}
    for key in options:
        if key not in declared:
            raise TaskOptionError(
                f"task.options.{key} is not an option of task {name!r}; it takes: {', '.join(declared) or 'none'}."
            )
        declared[key].check(options[key])
    missing = [key for key, option in declared.items() if option.default is REQUIRED and key not in options]
    if missing:
        raise TaskOptionError(f"task {name!r} needs task.options.{missing[0]} in the recipe.")
