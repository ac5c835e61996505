"""The contract every task meets: deterministic problems by index, and an exact reward.

The worker loop (tlt_cli/worker.py) asks a task for `problem(index)`; the same index always gives the same problem,
so a resumed run sees the same data order. `reward(problem, response)` scores a decoded
response; `solution` is the reference chain of thought used for supervised warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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

    def problem(self, index: int) -> Problem:
        """The problem at `index` (deterministic; indexes past the end wrap around)."""
        ...

    def reward(self, problem: Problem, response: str) -> float:
        """1.0 for a response whose final answer is exactly right, lower otherwise."""
        ...
