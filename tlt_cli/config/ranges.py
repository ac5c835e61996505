"""A number key's range: declared once with the key, written into its help, and checked by one function.

`setting(default, help, minimum=..., maximum=...)` (schema.py) keeps the key's `Range` in its field's metadata
and ends its help with the same range (`RL steps; in 1..999999999 (what checkpoint names hold)`).
`number_problem(section, prefix)` refuses a float that is not finite (YAML reads .inf and .nan as floats) and an
integer past 64 bits (YAML integers have no bound; torch, NumPy and the trace's readers stop at 64 bits), nested
sections included. `range_problem(section, prefix)` reads a section's own keys against their ranges and returns the
one sentence that refuses the first value outside one, naming the key, or None. The recipe gate
(tlt_cli/recipe_checks.py) and `tlt_rollout()` (tlt_cli/integrations/trl.py) ask both for every section;
tlt_cli/sglang/config.py asks it for `rollout.sglang`, which is checked only when
that backend runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

# the metadata key of a field's range
RANGE = "range"
# the bits every integer key fits in
INTEGER_BITS = 64


@dataclass(frozen=True)
class Range:
    """The values a number key takes: from `minimum` to `maximum` (None: no bound on that side), each end
    included unless it is exclusive; `integer` keys read as 1..N, others as intervals like (0, 1]; `note` says
    why, after the range in the help and in the refusal."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    integer: bool = False
    note: str = ""

    def admits(self, value: float) -> bool:
        if self.minimum is not None and (value <= self.minimum if self.exclusive_minimum else value < self.minimum):
            return False
        return self.maximum is None or (value < self.maximum if self.exclusive_maximum else value <= self.maximum)

    def phrase(self) -> str:
        """The range as the words after "must be": "in 1..999999999", "in (0, 1]", "at least 2", "positive",
        "greater than 1", "at most 4", "less than 1"."""
        low, high = self.minimum, self.maximum
        if low is not None and high is not None:
            if self.integer and not (self.exclusive_minimum or self.exclusive_maximum):
                return f"in {low}..{high}"
            return f"in {'(' if self.exclusive_minimum else '['}{low}, {high}{')' if self.exclusive_maximum else ']'}"
        if low is not None:
            if not self.exclusive_minimum:
                return f"at least {low}"
            return "positive" if low == 0 else f"greater than {low}"
        return f"less than {high}" if self.exclusive_maximum else f"at most {high}"

    def described(self) -> str:
        """The phrase with its note: what the help text ends with and the refusal says."""
        return f"{self.phrase()} ({self.note})" if self.note else self.phrase()

    def refusal(self, key: str, value: Any) -> str:
        """The one sentence that refuses `value` for `key`."""
        return f"{key} must be {self.described()}, got {value}."


def range_problem(section: Any, prefix: str = "") -> str | None:
    """The refusal of the first of `section`'s own keys (a nested section's are its own) whose value is outside
    the range declared with it; None when every value fits. `prefix` names the section ("train.")."""
    for key_field in dataclasses.fields(section):
        declared = key_field.metadata.get(RANGE)
        value = getattr(section, key_field.name)
        if declared is not None and not declared.admits(value):
            return declared.refusal(f"{prefix}{key_field.name}", value)
    return None


def number_problem(section: Any, prefix: str = "") -> str | None:
    """The refusal of the first float key of `section` (nested sections included) that is not finite, or integer key
    that does not fit in INTEGER_BITS bits; None when every number is one."""
    for key_field in dataclasses.fields(section):
        value, key = getattr(section, key_field.name), f"{prefix}{key_field.name}"
        if dataclasses.is_dataclass(value):
            problem = number_problem(value, f"{key}.")
            if problem is not None:
                return problem
        elif isinstance(value, float) and not math.isfinite(value):
            return f"{key} must be a finite number, got {value}."
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -(2 ** (INTEGER_BITS - 1)) <= value < 2 ** (INTEGER_BITS - 1):
                return f"{key} must fit in {INTEGER_BITS} bits (below 2^{INTEGER_BITS - 1} in size), got {value}."
    return None
