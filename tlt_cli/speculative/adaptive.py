"""Adaptive speculative decoding in one place: the rule table, its checks, the plan, the schedule, the decoder.

A `SpeculativePlan` (made once from the recipe's `speculative` section by the composition root,
tlt_cli/training/setup.py `speculative_plan`) becomes the embedded engine's decoder here
(`speculative_decoder(plan, drafter, seed)`): `off` is none, `fixed` one shape at every step,
`adaptive` an `AdaptiveSpeculativeDecoder` steered by an `AdaptiveSchedule`. The schedule is the
ConfigSchedule the decoder consults before every decode step with the running batch size, and
observes every `DecodeStep` the engine times (`observe_step`: its batch size, response tokens
and seconds from its start to its finished rows retired). It
  - walks the rule table (`build_rules`, checked once by `check_coverage`: first match on
    batch-size range and measured accept length) to the rule's configuration, or "off";
  - optionally refines it with an epsilon-greedy bandit per rule over the rule's candidates,
    rewarded by emitted tokens per second of the whole decode step (median over a window),
    state checkpointable;
  - turns SD off for a rule whose measured accept length has collapsed below a threshold (a stale
    or broken drafter, a bad weight sync), and back on only a margin above it (hysteresis,
    tlt_cli/speculative/collapse.py: the console hears of a bucket's first collapse and first
    recovery of the run, the trace counts every one), and re-probes it every so many steps;
  - accounts decode steps, tokens and seconds per configuration for the trace.
Accept length here is tokens emitted per verify pass (accepted drafts + the bonus token). The
SGLang mapping (tlt_cli/sglang/adaptive.py) reads the same table; `tlt calibrate` writes one.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from tlt_cli.errors import UserError
from tlt_cli.speculative.collapse import COLLAPSED, RECOVERED, CollapseWatch
from tlt_cli.speculative.cost_schedule import CostSchedule, candidate_configs
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.decoder import SpeculativeDecoder, StepCounts
from tlt_cli.speculative.types import (
    OFF,
    ConfigUsage,
    DecodeStep,
    ScheduleReports,
    SpeculativeConfig,
    draft_sources,
    label_of,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from tlt_cli.engine.running_batch import DecodeTarget, RunningBatch
    from tlt_cli.engine.sampling import SamplingParams

NGRAM_PREFIX = "ngram"  # model-free labels: ngram<tokens>, alone or after a drafter shape and a +
ACCEPT_SMOOTHING = 0.3  # weight of the newest step in the accept-length moving average
COLLAPSE_MIN_STEPS = 4  # SD steps a bucket must have measured before its accept length can count as collapsed
UNBOUNDED = float("inf")


class RuleTableError(UserError):
    """A rule table that cannot be used; the message names the rule (setup.py's `speculative_plan` names the key)."""


def parse_label(label: str) -> SpeculativeConfig | None:
    """'off' -> None; 's4-k1-t5' (steps, topk, draft tokens; '-tN' optional) -> a drafter shape;
    'ngram4' -> model-free (up to 4 n-gram tokens, no drafter pass); 's2-k1-t3+ngram4' -> hybrid
    (the drafter's shape and the n-gram branch verified in one pass); 's2-k1-t3|ngram4' -> each row
    verifies one chain, the drafter's or the n-gram index's, by its recent acceptance (picks_source)."""
    if label == OFF:
        return None
    try:
        picks_source = "|" in label
        drafter, _, ngram = label.partition("|" if picks_source else "+")
        if picks_source and not ngram:
            raise ValueError(label)
        if drafter.startswith(NGRAM_PREFIX) and not ngram:
            return SpeculativeConfig(steps=0, ngram_tokens=_ngram_tokens(drafter))
        parts = {part[0]: part[1:] for part in drafter.split("-") if part}
        if set(parts) - {"s", "k", "t"}:
            raise ValueError(drafter)
        return SpeculativeConfig(
            steps=int(parts["s"]),
            topk=int(parts.get("k", 1)),
            draft_tokens=int(parts.get("t", 0)),
            ngram_tokens=_ngram_tokens(ngram) if ngram else 0,
            picks_source=picks_source,
        )
    except (KeyError, ValueError):
        raise RuleTableError(
            f"'{label}' is not an SD configuration; write off, s<steps>-k<topk>-t<draft tokens> (e.g. s4-k1-t5), "
            "ngram<tokens> (model-free, e.g. ngram4), both joined by + (hybrid, e.g. s2-k1-t3+ngram4) or a chain "
            "and ngram<tokens> joined by | (one source per row, e.g. s2-k1-t3|ngram4)."
        ) from None


def _ngram_tokens(part: str) -> int:
    """'ngram4' -> 4 (at least 1)."""
    if not part.startswith(NGRAM_PREFIX) or int(part[len(NGRAM_PREFIX) :]) < 1:
        raise ValueError(part)
    return int(part[len(NGRAM_PREFIX) :])


@dataclass(frozen=True)
class Rule:
    """Batch sizes [batch_min, batch_max] and accept lengths [accept_min, accept_max) -> configs[0] (or a candidate)."""

    batch_min: int
    batch_max: float
    accept_min: float
    accept_max: float
    configs: tuple[SpeculativeConfig | None, ...]

    def matches(self, batch_size: int, accept_length: float) -> bool:
        below_max = (
            accept_length < self.accept_max or self.accept_max == UNBOUNDED
        )  # an unmeasured bucket counts as unbounded
        return self.batch_min <= batch_size <= self.batch_max and self.accept_min <= accept_length and below_max


def build_rules(entries: list[dict]) -> list[Rule]:
    """Rules from recipe entries {batch: [min, max|null], accept: [min, max|null], use: label, candidates: [labels]}."""
    rules = []
    for number, entry in enumerate(entries, start=1):
        batch = list(entry.get("batch") or [1, None])
        accept = list(entry.get("accept") or [0.0, None])
        if len(batch) != 2 or len(accept) != 2 or batch[0] is None or accept[0] is None:
            raise RuleTableError(
                f"rule {number}: batch and accept are [min, max] pairs (max may be null for no bound)."
            )
        configs = (
            parse_label(str(entry.get("use", OFF))),
            *(parse_label(str(label)) for label in entry.get("candidates") or []),
        )
        rule = Rule(
            int(batch[0]),
            UNBOUNDED if batch[1] is None else int(batch[1]),
            float(accept[0]),
            UNBOUNDED if accept[1] is None else float(accept[1]),
            configs,
        )
        if rule.batch_min < 1 or rule.batch_max < rule.batch_min:
            raise RuleTableError(f"rule {number}: batch range {batch} is empty or starts below 1.")
        if rule.accept_min < 0 or rule.accept_max <= rule.accept_min:
            raise RuleTableError(f"rule {number}: accept range {accept} is empty or negative.")
        rules.append(rule)
    check_coverage(rules)
    return rules


def bucket_edges(rules: list[Rule]) -> list[int]:
    """Sorted first batch sizes of the intervals on which the set of covering rules is constant."""
    return sorted(
        {
            1,
            *(rule.batch_min for rule in rules),
            *(int(rule.batch_max) + 1 for rule in rules if rule.batch_max < UNBOUNDED),
        }
    )


def check_coverage(rules: list[Rule]) -> None:
    """Every (batch size >= 1, accept length >= 0) is matched by exactly one rule: no gaps, no overlaps."""
    if not rules:
        raise RuleTableError("the rule table is empty; add at least one rule covering batch [1, null].")
    for batch_size in bucket_edges(rules):
        covering = sorted(
            (rule.accept_min, rule.accept_max, number)
            for number, rule in enumerate(rules, start=1)
            if rule.batch_min <= batch_size <= rule.batch_max
        )
        reach = 0.0
        for accept_min, accept_max, number in covering:
            if accept_min > reach:
                raise RuleTableError(
                    f"no rule covers batch size {batch_size} with accept length in [{reach}, {accept_min}) "
                    f"(gap before rule {number})."
                )
            if accept_min < reach:
                raise RuleTableError(
                    f"rule {number} overlaps an earlier rule at batch size {batch_size}, accept length {accept_min}."
                )
            reach = accept_max
        if reach < UNBOUNDED:
            raise RuleTableError(f"no rule covers batch size {batch_size} with accept length >= {reach}.")


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


@dataclass
class BucketState:
    """What the schedule has learned about one batch-size bucket (checkpointed)."""

    accept_length: float = UNBOUNDED  # optimistic until measured
    measured_steps: int = 0
    collapsed: bool = False
    steps_since_probe: int = 0
    rewards: dict[str, deque] = field(default_factory=dict)


class AdaptiveSchedule(ScheduleReports):
    """Rule table + bandit + collapse detection; the speculative decoder calls it every decode step.

    Buckets are the batch-size intervals between the rules' edges; each keeps its own measured
    accept length (a moving average over its SD steps), collapse flag and bandit rewards.
    """

    def __init__(
        self,
        rules: list[Rule],
        collapse_accept_length: float = 1.3,
        reprobe_steps: int = 64,
        epsilon: float = 0.0,
        reward_window: int = 300,
        seed: int = 0,
    ):
        self.rules = rules
        self.collapse_accept_length = collapse_accept_length
        self.reprobe_steps = reprobe_steps
        self.epsilon = epsilon
        self.reward_window = reward_window
        self.random = random.Random(seed)
        self.edges = bucket_edges(rules)
        self.states = [BucketState() for _ in self.edges]
        self.watch = CollapseWatch(
            collapse_accept_length, healthy=(self._range(bucket) for bucket in range(len(self.edges)))
        )
        super().__init__()
        self._last: tuple[int, SpeculativeConfig | None] | None = None

    def __call__(self, batch_size: int) -> SpeculativeConfig | None:
        bucket = bisect.bisect_right(self.edges, batch_size) - 1
        config = self._choose(bucket, batch_size)
        self._last = (bucket, config)
        return config

    def _rule_for(self, batch_size: int, accept_length: float) -> Rule:
        return next(rule for rule in self.rules if rule.matches(batch_size, accept_length))

    def _choose(self, bucket: int, batch_size: int) -> SpeculativeConfig | None:
        state = self.states[bucket]
        if state.collapsed:
            state.steps_since_probe += 1
            if state.steps_since_probe < self.reprobe_steps:
                return None
            state.steps_since_probe = 0  # re-probe with the configuration an unmeasured bucket would use
            return self._rule_for(batch_size, UNBOUNDED).configs[0]
        rule = self._rule_for(batch_size, state.accept_length)
        if len(rule.configs) == 1:
            return rule.configs[0]
        if self.random.random() < self.epsilon:
            return self.random.choice(rule.configs)
        return max(rule.configs, key=lambda config: self._median_reward(state, config))

    def _median_reward(self, state: BucketState, config: SpeculativeConfig | None) -> float:
        rewards = state.rewards.get(label_of(config))
        return statistics.median(rewards) if rewards else UNBOUNDED  # untried candidates first

    @property
    def uses_ngram(self) -> bool:
        """Whether any configuration of the table drafts with the n-gram index."""
        return "ngram" in draft_sources(config for rule in self.rules for config in rule.configs)

    def observe_step(self, step: DecodeStep, counts: StepCounts | None = None) -> None:
        """The engine's record of the decode step the last choice was for (every row verified if SD
        ran), with the decoder's counts of its verify pass (None: a plain step)."""
        speculated = self._last is not None and self._last[1] is not None
        self.observe(step.tokens, step.batch_size if speculated else 0, step.seconds)
        if counts is not None and speculated:
            usage = self.usage[label_of(self._last[1])]
            usage.drafter_verify_passes += counts.passes_by_source["drafter"]
            usage.drafter_accepted_tokens += counts.accepted_by_source["drafter"]
            usage.ngram_verify_passes += counts.passes_by_source["ngram"]
            usage.ngram_accepted_tokens += counts.accepted_by_source["ngram"]

    def observe(self, emitted_tokens: int, verify_passes: int, seconds: float) -> None:
        """What the last chosen step did: tokens emitted over the batch, verify passes (rows that speculated), time."""
        if self._last is None:
            return
        bucket, config = self._last
        label = label_of(config)
        usage = self.usage[label]
        usage.decode_steps += 1
        usage.tokens += emitted_tokens
        usage.seconds += seconds
        state = self.states[bucket]
        state.rewards.setdefault(label, deque(maxlen=self.reward_window)).append(emitted_tokens / max(seconds, 1e-9))
        if config is not None and verify_passes > 0:
            self._measure(bucket, emitted_tokens / verify_passes, usage)

    def _measure(self, bucket: int, accept_length: float, usage: ConfigUsage) -> None:
        state = self.states[bucket]
        previous = state.accept_length
        state.accept_length = (
            accept_length
            if previous == UNBOUNDED
            else (1 - ACCEPT_SMOOTHING) * previous + ACCEPT_SMOOTHING * accept_length
        )
        state.measured_steps += 1
        # one unlucky first step is not a collapse: judge only a bucket measured a few times
        if state.measured_steps < COLLAPSE_MIN_STEPS:
            return
        key = self._range(bucket)
        change = self.watch.change(key, state.collapsed, state.accept_length)
        if change == COLLAPSED:
            usage.collapses += 1
            message = (
                f"SD accept length collapsed to {state.accept_length:.2f} at batch sizes {key}: SD off there, "
                f"re-probed every {self.reprobe_steps} decode steps (later collapses go to the trace only)"
            )
        elif change == RECOVERED:
            usage.recoveries += 1
            message = f"SD accept length recovered to {state.accept_length:.2f} at batch sizes {key}: SD back on"
        else:
            return
        state.collapsed = change == COLLAPSED
        if self.watch.is_news(key, change):
            self.warnings.append(message)

    def _range(self, bucket: int) -> str:
        upper = self.edges[bucket + 1] - 1 if bucket + 1 < len(self.edges) else None
        return f"{self.edges[bucket]}-{upper if upper is not None else 'up'}"

    def state_dict(self) -> dict:
        return {
            "states": [
                (
                    state.accept_length,
                    state.collapsed,
                    state.steps_since_probe,
                    {label: list(values) for label, values in state.rewards.items()},
                    state.measured_steps,
                )
                for state in self.states
            ],
            "random": self.random.getstate(),
            "shown": self.watch.state_dict(),
        }

    def load_state_dict(self, saved: dict) -> None:
        self.watch.load_state_dict(saved.get("shown", {"shown": [], "healthy": []}))
        for state, (accept_length, collapsed, steps_since_probe, rewards, *measured) in zip(
            self.states, saved["states"]
        ):
            state.accept_length, state.collapsed, state.steps_since_probe = accept_length, collapsed, steps_since_probe
            state.rewards = {label: deque(values, maxlen=self.reward_window) for label, values in rewards.items()}
            # checkpoints written before measured_steps existed: a measured bucket counts as measured enough
            state.measured_steps = (
                measured[0] if measured else (COLLAPSE_MIN_STEPS if accept_length != UNBOUNDED else 0)
            )
        self.random.setstate(saved["random"])


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
        if drafter is None and "drafter" in plan.draft_sources:
            return None
        return AdaptiveSpeculativeDecoder(drafter, adaptive_schedule(plan, seed))
    if drafter is None:
        return None
    return SpeculativeDecoder(drafter, plan.shape)
