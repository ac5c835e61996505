"""The run's plan: every choice of a `tlt train` run that is resolved from the recipe for this machine, made once.

The composition root (tlt_cli/training/setup.py `planned_run`) makes the `RunPlan` in the driver, before any
worker starts, and nowhere else:
  update       the actor's precision (`actor.precision`, auto timed once per machine and model:
               tlt_cli/training/update_precision.py), as the `UpdatePrecision` the console and trace show
  decode       how the embedded rollout decodes (tlt_cli/rollout/decode_plan.py `DecodePlan`: the dtype, the
               linear forms and, in speculative.mode auto, the pass costs)
  speculative  what the rollout speculates with (tlt_cli/speculative/plan.py `SpeculativePlan`: the mode and
               its shape or checked rule table)
The driver hands it to every rank in the run's `RunSpec` (tlt_cli/processes/messages.py; a launched rank reads
it back from the run's launch files, tlt_cli/processes/launch_files.py, through `to_dict`/`from_dict`), so no
worker resolves a recipe choice: the native worker loop and TRL's rollout decode with the plan as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.config import Precision
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.speculative.plan import SpeculativePlan


@dataclass(frozen=True)
class UpdatePrecision:
    """The precision the actor runs in, how it was chosen, and the measured seconds per micro-batch."""

    precision: Precision
    reason: str
    seconds: dict[str, float] | None = None

    def describe(self) -> str:
        figures = ""
        if self.seconds:
            figures = ": " + ", ".join(f"{name} {value:.3f} s" for name, value in self.seconds.items())
            figures += " per micro-batch forward + backward"
        return f"actor precision {self.precision} ({self.reason}{figures})"

    def record(self) -> dict:
        """The trace's run-record entry (and the launch files' form of it)."""
        return {"precision": str(self.precision), "reason": self.reason, "micro_batch_seconds": self.seconds}

    @classmethod
    def from_record(cls, record: dict) -> UpdatePrecision:
        return cls(Precision(record["precision"]), record["reason"], record["micro_batch_seconds"])


@dataclass(frozen=True)
class RunPlan:
    """What setup resolved of the recipe for this run and machine (module docstring); picklable."""

    update: UpdatePrecision
    decode: DecodePlan
    speculative: SpeculativePlan

    @property
    def log_lines(self) -> tuple[str, ...]:
        """What was chosen and why, for the console and the run log."""
        return (self.update.describe(), *self.decode.log_lines)

    def to_dict(self) -> dict:
        """Plain JSON values (a launched rank reads the plan from the run's launch files)."""
        return {
            "update": self.update.record(),
            "decode": self.decode.to_dict(),
            "speculative": self.speculative.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> RunPlan:
        return cls(
            UpdatePrecision.from_record(data["update"]),
            DecodePlan.from_dict(data["decode"]),
            SpeculativePlan.from_dict(data["speculative"]),
        )
