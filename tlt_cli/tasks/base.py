"""The contract every task meets: deterministic problems by index, and an exact reward.

The worker loop (tlt_cli/training/worker_loop.py) asks a task for `problem(index)`; the same index always gives
the same problem, so a resumed run sees the same data order. `reward(problem, response)` scores a decoded
response; `solution` is the reference chain of thought used for supervised warm-up.
A task declares the options it takes from the recipe's `task.options` (`TaskOption`: name,
type, default, range); the registry checks a recipe's options against them before building it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from tlt_cli.errors import UserError

# the default of an option the recipe must give
REQUIRED = object()


class TaskOptionError(UserError):
    """The recipe gives a task an option it does not take, of the wrong type or out of range, or omits one it needs."""


@dataclass(frozen=True)
class TaskOption:
    """One keyword option of a task, as `task.options.<name>` in a recipe.

    kind: int, float or str (a float option takes an integer too); minimum/maximum bound a number.
    """

    name: str
    kind: type
    default: Any = REQUIRED
    minimum: float | None = None
    maximum: float | None = None

    def check(self, value: Any) -> None:
        """Raise TaskOptionError naming `task.options.<name>` unless `value` fits."""
        key = f"task.options.{self.name}"
        if isinstance(value, bool) or not isinstance(value, (int, float) if self.kind is float else self.kind):
            raise TaskOptionError(f"{key} must be {_KIND_NAMES[self.kind]}, got {value!r}.")
        if self.kind is str and not value.strip():
            raise TaskOptionError(f"{key} must not be empty.")
        if self.kind is float and not math.isfinite(value):
            raise TaskOptionError(f"{key} must be a finite number, got {value}.")
        if self.minimum is not None and value < self.minimum:
            raise TaskOptionError(f"{key} must be at least {self.minimum}, got {value}.")
        if self.maximum is not None and value > self.maximum:
            raise TaskOptionError(f"{key} must be at most {self.maximum}, got {value}.")


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string"}


def check_option_values(options: tuple[TaskOption, ...], **values: Any) -> None:
    """Each of `values` checked by the declaration of the same name (a task's constructor calls it)."""
    declared = {option.name: option for option in options}
    for name, value in values.items():
        declared[name].check(value)


@dataclass(frozen=True)
class Problem:
    """One prompt with its exact answer.

    prompt: text the model continues; answer: the exact final answer (e.g. "7");
    solution: a reference response (chain of thought ending with the answer) for warm-up.
    """

    index: int
    prompt: str
    answer: str
    solution: str


class Task(Protocol):
    """A source of problems and the reward that checks responses to them."""

    name: str
    # the keyword options of the constructor (besides seed), as the recipe gives them
    options: tuple[TaskOption, ...]

    def problem(self, index: int) -> Problem:
        """The problem at `index` (deterministic; indexes past the end wrap around)."""
        ...

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 for a response whose final answer is exactly right, lower otherwise."""
        ...
