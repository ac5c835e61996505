"""What a rollout speculates with, as plain values: the mode and, per mode, its shape or its checked rule table.

A `SpeculativePlan` is made once from the recipe's `speculative` section by the composition root
(tlt_cli/training/setup.py `speculative_plan`, part of the run's plan) and read by the decoder factory
(modes.py), the SGLang mapping and the recipe checks, never the recipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from tlt_cli.speculative.rules import UNBOUNDED, Rule
from tlt_cli.speculative.types import SpeculativeConfig, draft_sources


class SpeculationMode(str, Enum):
    """How a rollout speculates: off (plain decoding), fixed (one shape at every decode step), adaptive (the rule
    table), auto (per decode step from measured pass costs and acceptance: cost_schedule.py). The recipe's
    `speculative.mode` as a plan carries it."""

    off = "off"
    fixed = "fixed"
    adaptive = "adaptive"
    auto = "auto"


@dataclass(frozen=True)
class SpeculativePlan:
    """What a rollout speculates with, as plain values: made once from the recipe by tlt_cli/training/setup.py
    (`speculative_plan`); the decoder, the SGLang mapping and the recipe checks read it, never the recipe.

    shape: the shape of mode fixed (kept in every mode, as the recipe's keys are); rules: the checked rule table of
    mode adaptive (empty in the other modes, where the table is unused); collapse_accept_length, reprobe_steps and
    bandit_epsilon: the adaptive schedule's collapse threshold, re-probe interval and exploration share.
    """

    mode: SpeculationMode
    shape: SpeculativeConfig
    rules: tuple[Rule, ...]
    collapse_accept_length: float
    reprobe_steps: int
    bandit_epsilon: float

    @property
    def configs(self) -> tuple[SpeculativeConfig, ...]:
        """Every SD configuration the plan may run: none when off, the shape when fixed, each rule's `use` and
        candidates (off left out) when adaptive."""
        if self.mode == SpeculationMode.off:
            return ()
        if self.mode == SpeculationMode.fixed:
            return (self.shape,)
        return tuple(config for rule in self.rules for config in rule.configs if config is not None)

    @property
    def draft_sources(self) -> frozenset[str]:
        """The draft sources (DRAFT_SOURCES) its configurations draft from."""
        return draft_sources(self.configs)

    def to_dict(self) -> dict:
        """Plain JSON values (a launched rank reads the run's plan from its launch files); unbounded ranges as
        None."""
        data = asdict(self)
        data["mode"] = self.mode.value
        for rule in data["rules"]:
            for bound in ("batch_max", "accept_max"):
                rule[bound] = None if rule[bound] == UNBOUNDED else rule[bound]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativePlan:
        def config(values: dict | None) -> SpeculativeConfig | None:
            return SpeculativeConfig(**values) if values is not None else None

        def bound(value: float | None) -> float:
            return UNBOUNDED if value is None else value

        rules = tuple(
            Rule(
                rule["batch_min"],
                bound(rule["batch_max"]),
                rule["accept_min"],
                bound(rule["accept_max"]),
                tuple(config(values) for values in rule["configs"]),
            )
            for rule in data["rules"]
        )
        return cls(
            SpeculationMode(data["mode"]),
            SpeculativeConfig(**data["shape"]),
            rules,
            data["collapse_accept_length"],
            data["reprobe_steps"],
            data["bandit_epsilon"],
        )
