"""Speculative decoding chosen per decode step from what passes cost here and what the run accepts (`mode: auto`).

What a configuration gains is (rows x tokens it emits per verify pass) / (target pass + drafter passes). The
costs are properties of the machine, model and dtype (tlt_cli/speculative/costs.py `PassCosts`, measured once
and cached); the tokens per pass are a property of the run (tlt_cli/speculative/acceptance_estimates.py, learned
from its own verify passes). Before every decode step `CostSchedule` predicts tokens per second for plain
decoding and for each candidate configuration at the running batch size, and picks the highest:

    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    config = schedule(batch_size)          # None: a plain step
    schedule.observe_step(step, counts)    # the engine's timed step and the decoder's counts of its verify pass

The candidates are sized by the costs (`candidate_configs`): model-free n-gram chains always, drafter chains and
hybrids with a drafter, and trees only where verifying 16 tokens costs under TREE_VERIFY_RATIO plain steps (bfloat16
on matrix units, GPUs). Exploration keeps every candidate's acceptance measured: a share EXPLORE_SHARE of steps runs
the least recently run candidate among those predicted within PLAUSIBLE of the best, and every reprobe_steps steps
the least recently run candidate of all (so a drafter whose acceptance collapsed, and which the costs therefore
turned off, is tried again). A draft source whose recent tokens per verify pass (a moving average over the steps
it drafted in) fall under the collapse threshold is warned about once, and again when it recovers; while it is
collapsed, its configurations are predicted with that recent figure, so SD goes off at once. Each configuration's
predicted seconds are corrected by the ratio of its measured to predicted step times (the Python around the
passes), and the usage records keep the uncorrected prediction beside what was measured, so the cost model's error
stays visible in the trace.
"""

from __future__ import annotations

import random

from tlt_cli.speculative.acceptance_estimates import AcceptanceEstimates
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.types import (
    DRAFT_SOURCES,
    OFF,
    DecodeStep,
    ScheduleReports,
    SpeculativeConfig,
    draft_sources,
    label_of,
)

EXPLORE_SHARE = 0.05
PLAUSIBLE = 0.7
# trees are candidates only where a 16-token verify costs less than this many plain steps at one row
TREE_VERIFY_RATIO = 1.6
# weight of the newest step in a configuration's measured / predicted seconds
CORRECTION_SMOOTHING = 0.1
# a source's recent tokens per verify pass: weight of the newest step (as the rule table's schedule weighs it), and
# the steps it must have drafted in before it can count as collapsed
RECENT_SMOOTHING = 0.3
COLLAPSE_MIN_STEPS = 4

NGRAM_CHAINS = (2, 4, 8)
DRAFTER_CHAINS = (1, 2, 3, 4, 6)
HYBRIDS = ((2, 4), (4, 4))
TREES = ((4, 4, 16), (6, 4, 24))


def candidate_configs(costs: PassCosts, has_drafter: bool) -> tuple[SpeculativeConfig, ...]:
    """The configurations `mode: auto` chooses among (plain decoding besides): see the module docstring."""
    configs = [SpeculativeConfig(steps=0, ngram_tokens=tokens) for tokens in NGRAM_CHAINS]
    if has_drafter:
        configs += [SpeculativeConfig(steps=steps) for steps in DRAFTER_CHAINS]
        configs += [SpeculativeConfig(steps=steps, ngram_tokens=tokens) for steps, tokens in HYBRIDS]
        if costs.verify_ratio(16) < TREE_VERIFY_RATIO:
            configs += [SpeculativeConfig(steps, topk, draft_tokens) for steps, topk, draft_tokens in TREES]
    return tuple(configs)


class CostSchedule(ScheduleReports):
    """The decoder's ConfigSchedule in `mode: auto` (see the module docstring)."""

    def __init__(
        self,
        candidates: tuple[SpeculativeConfig, ...],
        costs: PassCosts,
        collapse_accept_length: float = 1.15,
        reprobe_steps: int = 64,
        seed: int = 0,
    ) -> None:
        self.candidates = candidates
        self.costs = costs
        self.collapse_accept_length = collapse_accept_length
        self.reprobe_steps = reprobe_steps
        self.random = random.Random(seed)
        self.acceptance = AcceptanceEstimates()
        self.correction: dict[str, float] = {}
        self.last_run: dict[str, int] = {}
        self.collapsed: set[str] = set()
        # per draft source: (SD steps it drafted in, moving average of tokens per verify pass over them)
        self.recent: dict[str, tuple[int, float]] = {}
        self.steps = 0
        super().__init__()
        self._last: tuple[SpeculativeConfig | None, int, float, float] | None = None

    @property
    def uses_ngram(self) -> bool:
        return "ngram" in draft_sources(self.candidates)

    def __call__(self, batch_size: int) -> SpeculativeConfig | None:
        self.steps += 1
        # per configuration: (tokens per pass, uncorrected step seconds), each computed once per decode step
        predictions = {config: self._prediction(config, batch_size) for config in (None, *self.candidates)}
        rates = {
            config: batch_size * tokens / (seconds * self._correction(config))
            for config, (tokens, seconds) in predictions.items()
        }
        best = max(rates, key=rates.get)
        config = self._explored(rates, best) or best
        tokens, seconds = predictions[config]
        self._last = (config, batch_size, batch_size * tokens, seconds)
        self.last_run[label_of(config)] = self.steps
        return config

    def predicted_rate(self, config: SpeculativeConfig | None, batch_size: int) -> float:
        """Tokens per second predicted for a step of `config` at `batch_size` rows, corrected as measured."""
        tokens_per_pass, seconds = self._prediction(config, batch_size)
        return batch_size * tokens_per_pass / (seconds * self._correction(config))

    def _prediction(self, config: SpeculativeConfig | None, batch_size: int) -> tuple[float, float]:
        """(tokens a verify pass emits per row, the cost model's uncorrected step seconds) for `config`."""
        tokens_per_pass = self._tokens_per_pass(config)
        return tokens_per_pass, self.costs.step_seconds(config, batch_size, tokens_per_pass)

    def _tokens_per_pass(self, config: SpeculativeConfig | None) -> float:
        """Tokens per verify pass expected of `config`: the acceptance estimates', or where every source it drafts
        from has collapsed, their recent figure (the estimates follow a collapse only over many passes)."""
        if config is None:
            return 1.0
        expected = self.acceptance.expected_tokens(config)
        sources = draft_sources((config,))
        if sources <= self.collapsed:
            return min(expected, max(self.recent[source][1] for source in sources))
        return expected

    def _correction(self, config: SpeculativeConfig | None) -> float:
        """Measured / predicted seconds of `config`'s steps; for one not run yet, the mean over the SD ones run."""
        label = label_of(config)
        if label in self.correction:
            return self.correction[label]
        speculative = [value for name, value in self.correction.items() if name != OFF]
        return sum(speculative) / len(speculative) if speculative and config is not None else 1.0

    def _explored(
        self, rates: dict[SpeculativeConfig | None, float], best: SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """A candidate to try instead of the best, or None (see the module docstring)."""
        if not self.candidates:
            return None
        if self.steps % self.reprobe_steps == 0:
            pool = list(self.candidates)
        elif self.random.random() < EXPLORE_SHARE:
            pool = [config for config in self.candidates if rates[config] >= PLAUSIBLE * rates[best]]
        else:
            return None
        pool = [config for config in pool if config != best]
        return min(pool, key=lambda config: self.last_run.get(label_of(config), 0)) if pool else None

    def observe_step(self, step: DecodeStep, counts: StepCounts | None = None) -> None:
        """The engine's timed step the last choice was for, with the decoder's counts of its verify pass."""
        if self._last is None:
            return
        config, _, predicted_tokens, predicted_seconds = self._last
        self._last = None
        label = label_of(config)
        usage = self.usage[label]
        usage.decode_steps += 1
        usage.tokens += step.tokens
        usage.seconds += step.seconds
        usage.predicted_tokens += predicted_tokens
        usage.predicted_seconds += predicted_seconds
        usage.batch_sizes[str(step.batch_size)] = usage.batch_sizes.get(str(step.batch_size), 0) + 1
        ratio = step.seconds / max(predicted_seconds, 1e-9)
        previous = self.correction.get(label)
        self.correction[label] = ratio if previous is None else previous + CORRECTION_SMOOTHING * (ratio - previous)
        if config is not None and counts is not None:
            usage.add_draft_counts(counts.passes_by_source, counts.accepted_by_source)
            self.acceptance.observe(config, counts.accepted_per_row)
            self._check_collapse(counts)

    def _check_collapse(self, counts: StepCounts) -> None:
        """Fold the step into each drafting source's recent tokens per pass; warn once when it falls under the
        threshold, and once when it recovers."""
        for source in DRAFT_SOURCES:
            passes = counts.passes_by_source[source]
            if not passes:
                continue
            tokens = 1 + counts.accepted_by_source[source] / passes
            steps, previous = self.recent.get(source, (0, tokens))
            tokens = previous + RECENT_SMOOTHING * (tokens - previous) if steps else tokens
            self.recent[source] = (steps + 1, tokens)
            if steps + 1 < COLLAPSE_MIN_STEPS:
                continue
            if tokens < self.collapse_accept_length and source not in self.collapsed:
                self.collapsed.add(source)
                self.warnings.append(
                    f"SD accept length of {source} drafts collapsed to {tokens:.2f}: the cost model keeps it off, "
                    f"re-probed every {self.reprobe_steps} decode steps"
                )
            elif tokens >= self.collapse_accept_length and source in self.collapsed:
                self.collapsed.discard(source)
                self.warnings.append(f"SD accept length of {source} drafts recovered to {tokens:.2f}")

    def state_dict(self) -> dict:
        return {
            "acceptance": self.acceptance.state_dict(),
            "correction": dict(self.correction),
            "collapsed": sorted(self.collapsed),
            "recent": {source: list(value) for source, value in self.recent.items()},
            "steps": self.steps,
            "last_run": dict(self.last_run),
            "random": self.random.getstate(),
        }

    def load_state_dict(self, saved: dict) -> None:
        self.acceptance.load_state_dict(saved["acceptance"])
        self.correction = dict(saved["correction"])
        self.collapsed = set(saved["collapsed"])
        self.recent = {source: (int(steps), float(tokens)) for source, (steps, tokens) in saved["recent"].items()}
        self.steps, self.last_run = saved["steps"], dict(saved["last_run"])
        self.random.setstate(saved["random"])
