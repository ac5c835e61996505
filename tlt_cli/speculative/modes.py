"""The decoder of each speculation mode: what the embedded engine decodes a `SpeculativePlan` with.

`speculative_decoder(plan, drafter, seed, pass_costs)`: `off` is none, `fixed` a `SpeculativeDecoder` of one
shape at every step, `adaptive` an `AdaptiveSpeculativeDecoder` steered by the rule table's schedule
(rule_schedule.py), `auto` one steered by the cost model's schedule (cost_schedule.py). Both schedules keep
the one usage ledger (types.py `ScheduleReports`) the engine reads per rollout step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tlt_cli.speculative.cost_schedule import CostSchedule, candidate_configs
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.plan import SpeculationMode, SpeculativePlan
from tlt_cli.speculative.rule_schedule import AdaptiveSchedule
from tlt_cli.speculative.types import DRAFTER_SOURCE, DecodeStep

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tlt_cli.engine.running_batch import DecodeTarget, RunningBatch
    from tlt_cli.engine.sampling import SamplingParams


class AdaptiveSpeculativeDecoder(SpeculativeDecoder):
    """A SpeculativeDecoder whose configuration comes from, and whose timed decode steps feed, a schedule: the rule
    table's AdaptiveSchedule or mode auto's CostSchedule (cost_schedule.py).

    Outputs are those of any SpeculativeDecoder: the schedule only chooses among lossless
    configurations (or plain decoding).
    """

    def __init__(self, drafter: nn.Module | None, schedule: AdaptiveSchedule | CostSchedule) -> None:
        super().__init__(drafter, schedule, uses_ngram=schedule.uses_ngram)
        self.adaptive_schedule = schedule

    def step(
        self, target: DecodeTarget, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SpeculativeDecoder.step; the cost model first hears what the drafter's catch-up would cost now."""
        if isinstance(self.adaptive_schedule, CostSchedule) and self.drafter_proposer is not None:
            self.adaptive_schedule.drafter_lag_entries = self.drafter_proposer.lag_entries(batch)
        return super().step(target, batch, sampling, generator)

    def observe_step(self, step: DecodeStep) -> None:
        self.adaptive_schedule.observe_step(step, self.last_step)


def adaptive_schedule(plan: SpeculativePlan, seed: int = 0) -> AdaptiveSchedule:
    """The schedule of an adaptive plan (its rule table already checked when the plan was made)."""
    return AdaptiveSchedule(
        list(plan.rules), plan.collapse_accept_length, plan.reprobe_steps, plan.bandit_epsilon, seed=seed
    )


def speculative_decoder(
    plan: SpeculativePlan, drafter: nn.Module | None, seed: int = 0, pass_costs: PassCosts | None = None
) -> SpeculativeDecoder | None:
    """The embedded engine's decoder for `plan` (None when off, or without a drafter when a configuration needs
    one: a table of model-free configurations needs none). Mode auto chooses with `pass_costs` (None: this model
    has no measured costs, the owned forward does not decode it: plain decoding)."""
    if plan.mode == SpeculationMode.off:
        return None
    if plan.mode == SpeculationMode.auto:
        if pass_costs is None:
            return None
        candidates = candidate_configs(pass_costs, has_drafter=drafter is not None)
        schedule = CostSchedule(candidates, pass_costs, plan.collapse_accept_length, plan.reprobe_steps, seed=seed)
        return AdaptiveSpeculativeDecoder(drafter, schedule)
    if plan.mode == SpeculationMode.adaptive:
        if drafter is None and DRAFTER_SOURCE in plan.draft_sources:
            return None
        return AdaptiveSpeculativeDecoder(drafter, adaptive_schedule(plan, seed))
    if drafter is None:
        return None
    return SpeculativeDecoder(drafter, plan.shape)
