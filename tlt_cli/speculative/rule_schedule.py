"""The rule table's schedule (`speculative.mode: adaptive`): rules, an epsilon-greedy bandit, collapse detection.

The decoder (modes.py) consults an `AdaptiveSchedule` before every decode step with the running batch size,
and hands it every `DecodeStep` the engine times (`observe_step`: its batch size, response tokens and seconds
from its start to its finished rows retired). It
  - walks the rule table (rules.py: first match on batch-size range and measured accept length) to the
    rule's configuration, or "off";
  - optionally refines it with an epsilon-greedy bandit per rule over the rule's candidates,
    rewarded by emitted tokens per second of the whole decode step (median over a window),
    state checkpointable;
  - turns SD off for a rule whose measured accept length has collapsed below a threshold (a stale
    or broken drafter, a bad weight sync), and back on only a margin above it (hysteresis,
    tlt_cli/speculative/collapse.py: the console hears of a bucket's first collapse and first
    recovery of the run, the trace counts every one), and re-probes it every so many steps;
  - accounts decode steps, tokens and seconds per configuration in the usage ledger it shares with mode
    auto's schedule (types.py `ScheduleReports`).
Accept length here is tokens emitted per verify pass (accepted drafts + the bonus token).
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from tlt_cli.speculative.collapse import COLLAPSE_MIN_STEPS, COLLAPSED, RECOVERED, CollapseWatch
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.rules import UNBOUNDED, Rule, bucket_edges
from tlt_cli.speculative.types import (
    NGRAM_SOURCE,
    ConfigUsage,
    DecodeStep,
    ScheduleReports,
    SpeculativeConfig,
    draft_sources,
    label_of,
)

ACCEPT_SMOOTHING = 0.3  # weight of the newest step in the accept-length moving average


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
        return NGRAM_SOURCE in draft_sources(config for rule in self.rules for config in rule.configs)

    def observe_step(self, step: DecodeStep, counts: StepCounts | None = None) -> None:
        """The engine's record of the decode step the last choice was for (every row verified if SD
        ran), with the decoder's counts of its verify pass (None: a plain step)."""
        speculated = self._last is not None and self._last[1] is not None
        if self._last is not None:
            self.usage[label_of(self._last[1])].add_step_at(step.batch_size, step.seconds, step.tokens)
        self.observe(step.tokens, step.batch_size if speculated else 0, step.seconds)
        if counts is not None and speculated:
            self.usage[label_of(self._last[1])].add_draft_counts(counts.passes_by_source, counts.accepted_by_source)

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
