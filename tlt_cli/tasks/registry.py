"""Tasks by name, as a recipe names them: `build_task("arithmetic", seed, options)`.

`options` are the task's keyword arguments from the recipe (for example `path` for
`jsonl_math`, `max_terms` for `arithmetic`); unknown or missing options raise
`TaskOptionError` naming them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from tlt_cli.tasks.arithmetic import ArithmeticTask
from tlt_cli.tasks.base import Task
from tlt_cli.tasks.jsonl_math import JsonlMathTask

TASKS: dict[str, Callable[..., Task]] = {
    ArithmeticTask.name: ArithmeticTask,
    JsonlMathTask.name: JsonlMathTask,
}


class UnknownTaskError(ValueError):
    """The recipe names a task that is not registered."""


class TaskOptionError(ValueError):
    """The recipe gives a task options it does not take, or omits one it needs."""


def build_task(name: str, seed: int, options: dict) -> Task:
    """The task registered as `name`, built with `seed` and the recipe's `options`."""
    if name not in TASKS:
        raise UnknownTaskError(f"Unknown task {name!r}; choose one of: {', '.join(sorted(TASKS))}.")
    task_class = TASKS[name]
    _check_options(name, task_class, options)
    return task_class(seed=seed, **options)


def _check_options(name: str, task_class: Callable[..., Task], options: dict) -> None:
    parameters = inspect.signature(task_class).parameters
    accepted = [parameter for parameter in parameters if parameter != "seed"]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TaskOptionError(f"Task {name!r} does not take option(s) {unknown}; it takes {accepted}.")
    required = [
        parameter.name
        for parameter in parameters.values()
        if parameter.default is inspect.Parameter.empty and parameter.name != "seed"
    ]
    missing = [option for option in required if option not in options]
    if missing:
        raise TaskOptionError(f"Task {name!r} needs option(s) {missing} in the recipe.")
