"""What a decode step costs on this machine, model and dtype: the measured pass costs and a step's predicted seconds.

`PassCosts` holds the milliseconds of the passes a speculative decode step is made of, measured once per
machine, model and rollout dtype (tlt_cli/tuning/pass_costs.py measures them; tlt_cli/training/setup.py is the
only caller): the target's forward over a grid of running rows x tokens per row (a plain step is 1 token per
row; a verify pass is the root and the drafted nodes), logits included, and the drafter's forward over a few
entry counts. Between grid points it interpolates linearly (in rows and in tokens); beyond the grid it
extrapolates from the last two points, never below the last one.

    costs = PassCosts.from_dict(record)
    costs.step_seconds(config, rows=4, accept_length=2.1)   # target verify + drafter passes, in seconds
    costs.step_seconds(None, rows=4)                        # a plain decode step

The adaptive engine (tlt_cli/speculative/cost_schedule.py) divides the tokens a configuration is expected to
emit by these seconds to pick the configuration per decode step.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tlt_cli.speculative.types import SpeculativeConfig

# a measured pass takes between a nanosecond and a quarter of an hour: a time outside is damage (a time of 5e-324 ms
# would make a plain step free and every ratio to it a division by zero)
MIN_PASS_MS = 1e-6
MAX_PASS_MS = 1e6
TIME_OUT_OF_RANGE = (
    f"the measured pass costs hold a time that is not a finite positive number in [{MIN_PASS_MS:g}, {MAX_PASS_MS:g}] ms"
)
# a grid axis has at most this many points, each at most MAX_AXIS_VALUE: choosing a configuration interpolates
# over the grid at every decode step, so a record of 20,000 rows would make each step's choice take 80 ms
MAX_AXIS_POINTS = 64
MAX_AXIS_VALUE = 1 << 16


@dataclass(frozen=True)
class PassCosts:
    """Measured pass costs (see the module docstring).

    rows, tokens: the grid, ascending; target_ms[i][j]: the target's forward over rows[i] rows of tokens[j]
    tokens each, with logits; drafter_entries, drafter_ms: the drafter's forward over that many entries (rows x
    tokens; empty without a drafter). dtype: the rollout dtype they were measured in.
    """

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    target_ms: tuple[tuple[float, ...], ...]
    drafter_entries: tuple[int, ...] = ()
    drafter_ms: tuple[float, ...] = ()
    dtype: str = "float32"

    def target_seconds(self, rows: int, tokens: int) -> float:
        """The target's forward over `rows` rows x `tokens` tokens, logits included."""
        by_rows = [_interpolate(self.tokens, row_costs, tokens) for row_costs in self.target_ms]
        return _interpolate(self.rows, by_rows, rows) / 1e3

    def drafter_seconds(self, entries: int) -> float:
        """One drafter forward over `entries` entries (0 without a measured drafter)."""
        if not self.drafter_entries:
            return 0.0
        return _interpolate(self.drafter_entries, self.drafter_ms, entries) / 1e3

    def step_seconds(
        self, config: SpeculativeConfig | None, rows: int, accept_length: float = 1.0, width: float | None = None
    ) -> float:
        """A decode step of `rows` rows in `config` (None: plain): the target's pass over the tokens each row
        verifies (`width`, the widest row's, as rows are padded to it; None: all `config` may draft), and the
        drafter's passes: steps - 1 drafting passes of `topk` entries per row (the first drafted token comes from
        the root's logits) and one catch-up over the kept tokens (about `accept_length`)."""
        if config is None:
            return self.target_seconds(rows, 1)
        seconds = self.target_seconds(rows, verified_tokens(config) if width is None else width)
        if config.uses_drafter:
            drafting = (config.steps - 1) * self.drafter_seconds(rows * config.topk)
            seconds += drafting + self.drafter_seconds(max(1, round(rows * accept_length)))
        return seconds

    def verify_ratio(self, tokens: int, rows: int = 1) -> float:
        """What verifying `tokens` tokens per row costs in plain steps at `rows` rows (1.0: speculation is free)."""
        return self.target_seconds(rows, tokens) / self.target_seconds(rows, 1)

    def describe(self) -> str:
        """One line for the run log: what a plain step and a 16-token verify cost at the smallest and largest rows."""
        most = self.rows[-1]
        figures = ", ".join(
            f"{rows} row{'s' if rows > 1 else ''}: step {self.target_seconds(rows, 1) * 1e3:.1f} ms, "
            f"16-token verify {self.verify_ratio(16, rows):.2f}x a step"
            for rows in sorted({1, most})
        )
        return f"SD pass costs ({self.dtype}): {figures}"

    def to_dict(self) -> dict:
        return {
            "rows": list(self.rows),
            "tokens": list(self.tokens),
            "target_ms": [list(row) for row in self.target_ms],
            "drafter_entries": list(self.drafter_entries),
            "drafter_ms": list(self.drafter_ms),
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: dict) -> PassCosts:
        """The costs of a record; ValueError when its grid is not ascending positive integers (at most
        MAX_AXIS_POINTS of at most MAX_AXIS_VALUE) with a time in [MIN_PASS_MS, MAX_PASS_MS] at every point."""
        costs = cls(
            _integers(data["rows"]),
            _integers(data["tokens"]),
            tuple(_times(row) for row in _sequence(data["target_ms"])),
            _integers(data.get("drafter_entries", ())),
            _times(data.get("drafter_ms", ())),
            str(data.get("dtype", "float32")),
        )
        costs.check()
        return costs

    def check(self) -> None:
        """Raise ValueError unless the grid is usable (see from_dict)."""
        _check_axis("rows", self.rows)
        _check_axis("tokens", self.tokens)
        _check_axis("drafter entries", self.drafter_entries, allow_empty=True)
        shape_ok = len(self.target_ms) == len(self.rows) and all(len(row) == len(self.tokens) for row in self.target_ms)
        if not shape_ok or len(self.drafter_ms) != len(self.drafter_entries):
            raise ValueError("the measured pass costs do not match their grid")
        if not all(MIN_PASS_MS <= value <= MAX_PASS_MS for row in self.target_ms for value in (*row, *self.drafter_ms)):
            raise ValueError(TIME_OUT_OF_RANGE)


def verified_tokens(config: SpeculativeConfig) -> int:
    """Tokens per row a verify pass of `config` runs through the target: the root and every drafted node (the
    n-gram branch's up to ngram_tokens; a per-row choice of source verifies the longer of the two chains)."""
    if not config.uses_drafter:
        return 1 + config.ngram_tokens
    if config.picks_source:
        return max(config.verified_tokens, 1 + config.ngram_tokens)
    return config.verified_tokens + config.ngram_tokens


def _sequence(values: object) -> Sequence:
    if not isinstance(values, (list, tuple)) or len(values) > MAX_AXIS_POINTS:
        raise ValueError(f"the measured pass costs hold a grid that is not a list of at most {MAX_AXIS_POINTS} points")
    return values


def _integers(values: object) -> tuple[int, ...]:
    """A grid axis: integers (no bools, no floats such as Infinity)."""
    values = _sequence(values)
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in values):
        raise ValueError("the measured pass costs' grid holds a value that is not an integer")
    return tuple(values)


def _times(values: object) -> tuple[float, ...]:
    """Measured milliseconds: numbers a float holds (an integer too large for one is refused, not an overflow)."""
    values = _sequence(values)
    if not all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values):
        raise ValueError("the measured pass costs hold a time that is not a number")
    if not all(math.isfinite(value) and value <= MAX_PASS_MS for value in values if isinstance(value, float)) or any(
        abs(value) > MAX_PASS_MS for value in values if isinstance(value, int)
    ):
        raise ValueError(TIME_OUT_OF_RANGE)
    return tuple(float(value) for value in values)


def _check_axis(name: str, values: Sequence[int], allow_empty: bool = False) -> None:
    if not values and allow_empty:
        return
    if (
        not values
        or len(values) > MAX_AXIS_POINTS
        or values[0] < 1
        or values[-1] > MAX_AXIS_VALUE
        or any(later <= earlier for earlier, later in zip(values, values[1:]))
    ):
        raise ValueError(
            f"the measured pass costs' {name} are not ascending positive numbers (at most {MAX_AXIS_POINTS} of at "
            f"most {MAX_AXIS_VALUE})"
        )


def _interpolate(points: Sequence[int], values: Sequence[float], at: float) -> float:
    """Piecewise-linear through (points, values); outside, the nearest segment extended (never below the nearest
    measured value beyond the last point, never below 0 before the first)."""
    if len(points) == 1:
        return values[0] * (at / points[0]) if at > points[0] else values[0]
    index = min(max(bisect.bisect_left(points, at), 1), len(points) - 1)
    left, right = points[index - 1], points[index]
    slope = (values[index] - values[index - 1]) / (right - left)
    value = values[index - 1] + slope * (at - left)
    if at > points[-1]:
        return max(value, values[-1])
    return max(value, 0.0) if at < points[0] else value
