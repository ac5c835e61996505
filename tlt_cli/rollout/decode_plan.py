"""How the embedded rollout decodes, as plain values resolved once above it: the `DecodePlan`.

The composition root (tlt_cli/training/setup.py `decode_plan`) resolves the recipe's measured choices into one
frozen plan before any worker starts: the rollout dtype (`rollout.dtype`, auto measured by
tlt_cli/tuning/precision.py), the linear-form plan (`rollout.linear_forms`, tlt_cli/tuning/linear_forms.py) and,
when the rollout chooses its SD configuration from costs (`speculative.mode: auto`), the pass costs of this
machine, model and dtype (tlt_cli/tuning/pass_costs.py). The embedded rollout (embedded.py), `tlt profile`,
`tlt calibrate` and the TRL path take the plan and measure nothing themselves:

    plan = setup.decode_plan(recipe, drafter_folder)        # or setup.decode_plan_for(policy, drafter, ...)
    rollout = EmbeddedRollout(policy, eos_id, pad_id, speculative_plan, drafter, decode=plan)
    print(*plan.log_lines)       # what was chosen and why, for the run log
    plan.precision               # the trace's rollout_precision record

It is picklable: under `tlt train` it is part of the run's plan (tlt_cli/tuning/run_plan.py), which the driver
hands to every worker in the run's RunSpec (tlt_cli/processes/messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.speculative.costs import PassCosts

DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DecodePlan:
    """dtype: the rollout dtype's name (DECODE_DTYPES); linear_plan: the forms of the linear layers (None: plain
    F.linear); pass_costs: the measured pass costs the cost-model schedule chooses with (None: not measured, SD
    by rule table or off); precision: the record of how the dtype was chosen (the trace's rollout_precision);
    log_lines: the lines the run log shows about all of it; stochastic_rounding: bfloat16 copies of float32
    weights rounded as the learner's are (tlt_cli/engine/rounding.py), else to nearest."""

    dtype: str = "float32"
    linear_plan: LinearFormPlan | None = None
    pass_costs: PassCosts | None = None
    precision: dict = field(default_factory=dict)
    log_lines: tuple[str, ...] = ()
    stochastic_rounding: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return DECODE_DTYPES[self.dtype]

    def to_dict(self) -> dict:
        """Plain JSON values (a launched rank reads the plan from the run's launch files)."""
        return {
            "dtype": self.dtype,
            "linear_plan": self.linear_plan.to_dict() if self.linear_plan is not None else None,
            "pass_costs": self.pass_costs.to_dict() if self.pass_costs is not None else None,
            "precision": self.precision,
            "log_lines": list(self.log_lines),
            "stochastic_rounding": self.stochastic_rounding,
        }

    @classmethod
    def from_dict(cls, data: dict) -> DecodePlan:
        linear_plan, pass_costs = data.get("linear_plan"), data.get("pass_costs")
        return cls(
            data["dtype"],
            LinearFormPlan.from_dict(linear_plan) if linear_plan is not None else None,
            PassCosts.from_dict(pass_costs) if pass_costs is not None else None,
            dict(data.get("precision", {})),
            tuple(data.get("log_lines", ())),
            bool(data.get("stochastic_rounding", True)),
        )
