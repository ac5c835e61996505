"""What a decode step costs beyond its timed passes, learned from the run's own steps, by configuration and rows.

The pass costs (tlt_cli/speculative/costs.py) time the target's and the drafter's forwards alone. A decode step
also samples, drafts n-grams and builds the tree in Python, judges and commits the verify pass, and retires
finished rows: on a small model at few rows that is as much again as the passes (issue 48: the trace's predicted
SD tokens/s were 1.5-2.1x the measured). Most of that work is per row (Python loops over the rows, the proposals
as lists) on top of a fixed part, so a multiplicative correction learned at one batch size mispredicts another.
`StepOverheads` learns, per configuration label, measured minus pass seconds as `fixed + per_row x rows` by
decayed least squares over the steps that label ran (about the last 1 / (1 - DECAY)):

    overheads = StepOverheads()
    overheads.observe("ngram4", rows=4, pass_seconds=0.010, measured_seconds=0.018)
    overheads.seconds("ngram4", rows=8)    # the fixed part plus 8 rows' share

A label not measured yet borrows its family's fit (configurations drafting from the same sources: `ngram4` from
`ngram8`), else the mean over the measured speculative labels; plain decoding (`off`) only ever its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.speculative.types import OFF

# weight an older step keeps per newer step of the same label
DECAY = 0.98
# decayed steps a label needs before its own fit is used
MIN_STEPS = 3.0
# a spread of rows under this (in rows squared, weighted) fits the fixed part alone
MIN_ROW_VARIANCE = 0.25


@dataclass
class OverheadFit:
    """Decayed sums of (rows, overhead seconds) over one key's steps: weight, rows, rows^2, seconds, rows x seconds."""

    weight: float = 0.0
    rows: float = 0.0
    rows_squared: float = 0.0
    seconds: float = 0.0
    rows_seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        self.weight = self.weight * DECAY + 1.0
        self.rows = self.rows * DECAY + rows
        self.rows_squared = self.rows_squared * DECAY + rows * rows
        self.seconds = self.seconds * DECAY + seconds
        self.rows_seconds = self.rows_seconds * DECAY + rows * seconds

    def at(self, rows: int) -> float:
        """The fitted overhead at `rows` (the mean where the rows seen barely vary; never a per-row part below 0)."""
        mean_rows, mean_seconds = self.rows / self.weight, self.seconds / self.weight
        variance = self.rows_squared / self.weight - mean_rows**2
        if variance < MIN_ROW_VARIANCE:
            return mean_seconds
        per_row = max((self.rows_seconds / self.weight - mean_rows * mean_seconds) / variance, 0.0)
        return mean_seconds + per_row * (rows - mean_rows)

    def to_list(self) -> list[float]:
        return [self.weight, self.rows, self.rows_squared, self.seconds, self.rows_seconds]


class StepOverheads:
    """Per configuration label and per family, the seconds a step takes beyond its passes (module docstring)."""

    def __init__(self) -> None:
        self.fits: dict[str, OverheadFit] = {}

    def observe(self, label: str, family: str, rows: int, pass_seconds: float, measured_seconds: float) -> None:
        """One timed step of `label` (of `family`, its draft sources) at `rows` rows whose passes cost pass_seconds."""
        overhead = measured_seconds - pass_seconds
        self.fits.setdefault(label, OverheadFit()).add(rows, overhead)
        if label != OFF:
            self.fits.setdefault(_family_key(family), OverheadFit()).add(rows, overhead)

    def seconds(self, label: str, family: str, rows: int) -> float:
        """Predicted seconds beyond the passes of a `label` step at `rows` rows (0 with nothing measured to go by)."""
        own = self.fits.get(label)
        if own is not None and own.weight >= MIN_STEPS:
            return own.at(rows)
        if label == OFF:
            return own.at(rows) if own is not None else 0.0
        related = self.fits.get(_family_key(family))
        if related is not None and related.weight >= MIN_STEPS:
            return related.at(rows)
        measured = [fit.at(rows) for key, fit in self.fits.items() if _is_family(key) and fit.weight >= MIN_STEPS]
        return sum(measured) / len(measured) if measured else 0.0

    def state_dict(self) -> dict[str, list[float]]:
        return {key: fit.to_list() for key, fit in self.fits.items()}

    def load_state_dict(self, saved: dict[str, list[float]]) -> None:
        self.fits = {key: OverheadFit(*values) for key, values in saved.items()}


def _family_key(family: str) -> str:
    return f"family:{family}"


def _is_family(key: str) -> bool:
    return key.startswith("family:")
