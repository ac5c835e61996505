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
the least recently run candidate among those predicted within PLAUSIBLE of the best, and every reprobe_steps steps the
least recently run candidate of all (so a drafter whose acceptance collapsed, and which the costs therefore turned
off, is tried again). A draft source whose recent tokens per verify pass (a moving average over the steps it drafted
in) fall under the collapse threshold collapses, and recovers only a margin above it (tlt_cli/speculative/collapse.py:
the console hears of its first collapse and first recovery of the run, the trace counts every one); while it is
collapsed, its configurations are predicted with that recent figure, so SD goes off at once. A step's predicted
seconds are its passes' (the drafter's catch-up on positions it has not read included: `drafter_lag_entries`, which
the decoder sets before each step) plus what the run's own steps of that configuration took beyond their passes at
about that many rows (tlt_cli/speculative/step_overheads.py: the Python around the passes, learned as a fixed part and
a part per row); the usage records keep that prediction beside what was measured, so the cost model's error stays
visible in the trace. The predictions at a batch size are kept until an SD step updates the acceptance estimates (or
REFRESH_STEPS steps pass), so a run of plain steps pays a dictionary read for its choice, not a prediction per
candidate. When the drafter has trained since its passes were measured (`drafter_changed`, called by the rollout
backend before the next rollout), only DRAFTER_CHANGE_KEEP of what was measured of it counts and a collapse of the
old drafter is lifted, so a drafter that learned is tried and exploited in the next rollout's first steps; a fresh
drafter starts so collapsed (`drafter_untrained`), so the first rollout does not explore random drafts. The run's
own steps have the last word (plain_check.py `PlainCheck`): a configuration they measured slower than plain decoding
at a batch size is not chosen there, explored or re-probed until its growing interval has passed.
"""

from __future__ import annotations

import random

from tlt_cli.speculative.acceptance_estimates import PRIOR_THROUGH, AcceptanceEstimates
from tlt_cli.speculative.collapse import COLLAPSE_MIN_STEPS, COLLAPSED, RECOVERED, CollapseWatch
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.plain_check import PlainCheck
from tlt_cli.speculative.step_overheads import StepOverheads
from tlt_cli.speculative.types import (
    DRAFT_SOURCES,
    DRAFTER_SOURCE,
    NGRAM_SOURCE,
    OFF,
    ConfigUsage,
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
# decode steps between fresh predictions while the acceptance estimates stand still (the overheads drift slowly)
REFRESH_STEPS = 16
# a step is never predicted faster than this share of its measured passes (an overhead fit gone negative)
MIN_PASS_SHARE = 0.5
# weight of the newest verify pass in a model-free label's average width
WIDTH_SMOOTHING = 0.1
# a source's recent tokens per verify pass: weight of the newest step (as the rule table's schedule weighs it); it
# can count as collapsed once it has drafted in COLLAPSE_MIN_STEPS steps (collapse.py)
RECENT_SMOOTHING = 0.3
# share of the old drafter's measured passes that still count after it trained (a rollout re-measures the rest)
DRAFTER_CHANGE_KEEP = 0.1

NGRAM_CHAINS = (2, 4, 8, 16, 32)
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
        self.overheads = StepOverheads()
        # a model-free label (and label@batch size) -> moving average of its verify passes' widths (_width)
        self.widths: dict[str, float] = {}
        # entries (rows x the widest row's gap) the drafter has yet to read before it drafts: set by the decoder
        # before each step (AdaptiveSpeculativeDecoder), grown by every step that does not draft with the model
        self.drafter_lag_entries = 0
        # batch size -> each configuration's prediction (_predictions_at)
        self._predictions: dict[int, dict[SpeculativeConfig | None, tuple[float, float, float, bool]]] = {}
        self.last_run: dict[str, int] = {}
        self.collapsed: set[str] = set()
        self.watch = CollapseWatch(collapse_accept_length)
        # per draft source: (SD steps it drafted in, moving average of tokens per verify pass over them)
        self.recent: dict[str, tuple[int, float]] = {}
        self.steps = 0
        self.plain_check = PlainCheck(reprobe_steps)
        super().__init__()
        # the last choice: (config, rows, predicted tokens, predicted seconds, its passes' seconds)
        self._last: tuple[SpeculativeConfig | None, int, float, float, float] | None = None

    @property
    def uses_ngram(self) -> bool:
        return NGRAM_SOURCE in draft_sources(self.candidates)

    def __call__(self, batch_size: int) -> SpeculativeConfig | None:
        self.steps += 1
        if self.steps % REFRESH_STEPS == 0:
            self._predictions.clear()
        predictions = self._predictions_at(batch_size)
        catch_up = self._catch_up_seconds()
        rates = {
            config: batch_size * tokens / (seconds + catch_up * drafts)
            for config, (tokens, seconds, _, drafts) in predictions.items()
            if self.plain_check.allows(label_of(config), batch_size, self.steps)
        }
        best = max(rates, key=rates.get)
        config = self._explored(rates, best) or best
        tokens, seconds, pass_seconds, drafts = predictions[config]
        extra = catch_up * drafts
        self._last = (config, batch_size, batch_size * tokens, seconds + extra, pass_seconds + extra)
        self.last_run[label_of(config)] = self.steps
        return config

    def predicted_rate(self, config: SpeculativeConfig | None, batch_size: int) -> float:
        """Tokens per second predicted for a step of `config` at `batch_size` rows (the drafter caught up)."""
        tokens_per_pass, seconds, _, _ = self._prediction(config, batch_size)
        return batch_size * tokens_per_pass / seconds

    def _predictions_at(self, batch_size: int) -> dict[SpeculativeConfig | None, tuple[float, float, float, bool]]:
        """Every candidate's and plain decoding's prediction at `batch_size` rows, computed once and kept until the
        acceptance estimates change (an SD step) or REFRESH_STEPS steps pass (the overheads' drift), so a run of
        plain steps costs a dictionary read per step, not a prediction per candidate."""
        cached = self._predictions.get(batch_size)
        if cached is None:
            cached = {config: self._prediction(config, batch_size) for config in (None, *self.candidates)}
            self._predictions[batch_size] = cached
        return cached

    def _prediction(self, config: SpeculativeConfig | None, batch_size: int) -> tuple[float, float, float, bool]:
        """(tokens a verify pass emits per row, the step's predicted seconds, its passes' seconds, whether it drafts
        with the model) for `config`, the drafter's catch-up on positions it has not read left out: the passes as
        measured (costs.py), plus the seconds the run's own steps of this configuration took beyond their passes at
        about this many rows (step_overheads.py)."""
        tokens_per_pass = self._tokens_per_pass(config)
        pass_seconds = self.costs.step_seconds(config, batch_size, tokens_per_pass, self._width(config, batch_size))
        overhead = self.overheads.seconds(label_of(config), _family(config), batch_size)
        seconds = max(pass_seconds + overhead, MIN_PASS_SHARE * pass_seconds)
        return tokens_per_pass, seconds, pass_seconds, config is not None and config.uses_drafter

    def _width(self, config: SpeculativeConfig | None, batch_size: int) -> float | None:
        """Tokens per row a model-free verify pass of `config` is expected to run through the target: its rows draft
        what their own matches support and are padded to the widest (tlt_cli/speculative/ngram.py), so the pass is
        priced at the width its passes had at this batch size (else at any), and at all it may draft until then;
        None for the others (their width is their shape)."""
        if config is None or config.uses_drafter:
            return None
        label = config.label()
        return self.widths.get(f"{label}@{batch_size}", self.widths.get(label))

    def _observe_width(self, config: SpeculativeConfig, batch_size: int, width: int) -> None:
        """Fold a model-free verify pass's width into its label's averages, at its batch size and over all."""
        for key in (f"{config.label()}@{batch_size}", config.label()):
            previous = self.widths.get(key)
            self.widths[key] = width if previous is None else previous + WIDTH_SMOOTHING * (width - previous)

    def _catch_up_seconds(self) -> float:
        """The drafter's pass over the committed positions it has not read yet (`drafter_lag_entries`): what the next
        step that drafts with the model pays first."""
        return self.costs.drafter_seconds(self.drafter_lag_entries) if self.drafter_lag_entries else 0.0

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

    def _explored(
        self, rates: dict[SpeculativeConfig | None, float], best: SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """A candidate to try instead of the best, or None (see the module docstring)."""
        allowed = [config for config in self.candidates if config in rates]
        if not allowed:
            return None
        if self.steps % self.reprobe_steps == 0:
            pool = allowed
        elif self.random.random() < EXPLORE_SHARE:
            pool = [config for config in allowed if rates[config] >= PLAUSIBLE * rates[best]]
        else:
            return None
        pool = [config for config in pool if config != best]
        return min(pool, key=lambda config: self.last_run.get(label_of(config), 0)) if pool else None

    def observe_step(self, step: DecodeStep, counts: StepCounts | None = None) -> None:
        """The engine's timed step the last choice was for, with the decoder's counts of its verify pass."""
        if self._last is None:
            return
        config, _, predicted_tokens, predicted_seconds, pass_seconds = self._last
        self._last = None
        label = label_of(config)
        usage = self.usage[label]
        usage.decode_steps += 1
        usage.tokens += step.tokens
        usage.seconds += step.seconds
        usage.predicted_tokens += predicted_tokens
        usage.predicted_seconds += predicted_seconds
        usage.add_step_at(step.batch_size, step.seconds, step.tokens)
        self.overheads.observe(label, _family(config), step.batch_size, pass_seconds, step.seconds)
        drops = self.plain_check.drops
        message = self.plain_check.observe(label, step.batch_size, step.seconds, step.tokens, self.steps)
        usage.plain_drops += self.plain_check.drops - drops
        if message is not None:
            self.warnings.append(message)
        if config is not None and counts is not None:
            usage.add_draft_counts(counts.passes_by_source, counts.accepted_by_source)
            self.acceptance.observe(config, counts.accepted_per_row)
            if not config.uses_drafter and counts.verified_width:
                self._observe_width(config, step.batch_size, counts.verified_width)
            self._check_collapse(counts, usage)
            self._predictions.clear()

    def _check_collapse(self, counts: StepCounts, usage: ConfigUsage) -> None:
        """Fold the step into each drafting source's recent tokens per pass and judge collapse and recovery with
        hysteresis (tlt_cli/speculative/collapse.py): the console hears of each source's first collapse and first
        recovery of the run, `usage` counts every one."""
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
            change = self.watch.change(source, source in self.collapsed, tokens)
            if change == COLLAPSED:
                self.collapsed.add(source)
                usage.collapses += 1
                message = (
                    f"SD accept length of {source} drafts collapsed to {tokens:.2f}: the cost model keeps it off, "
                    f"re-probed every {self.reprobe_steps} decode steps (later collapses go to the trace only)"
                )
            elif change == RECOVERED:
                self.collapsed.discard(source)
                usage.recoveries += 1
                message = f"SD accept length of {source} drafts recovered to {tokens:.2f}"
            if change is not None and self.watch.is_news(source, change):
                self.warnings.append(message)

    def drafter_untrained(self) -> None:
        """The drafter is fresh (random weights): keep it off, without a warning, but for re-probes, until it trains
        (`drafter_changed`): its chains and the hybrids drafting from it are expected to accept nothing."""
        self.collapsed.add(DRAFTER_SOURCE)
        self.recent[DRAFTER_SOURCE] = (0, 1.0)  # one token a pass (nothing accepted) until it has drafted
        self.acceptance.prior_through[DRAFTER_SOURCE] = 0.0
        self._predictions.clear()

    def drafter_changed(self) -> None:
        """The drafter trained since its passes were measured: discount them, lift its collapse (module docstring)."""
        self.acceptance.forget(DRAFTER_SOURCE, DRAFTER_CHANGE_KEEP)
        self.acceptance.prior_through[DRAFTER_SOURCE] = PRIOR_THROUGH[DRAFTER_SOURCE]
        self.collapsed.discard(DRAFTER_SOURCE)
        self.recent.pop(DRAFTER_SOURCE, None)
        self._predictions.clear()

    def state_dict(self) -> dict:
        return {
            "acceptance": self.acceptance.state_dict(),
            "overheads": self.overheads.state_dict(),
            "widths": dict(self.widths),
            "collapsed": sorted(self.collapsed),
            "shown": self.watch.state_dict(),
            "recent": {source: list(value) for source, value in self.recent.items()},
            "steps": self.steps,
            "last_run": dict(self.last_run),
            "random": self.random.getstate(),
            "plain_check": self.plain_check.state_dict(),
        }

    def load_state_dict(self, saved: dict) -> None:
        self.acceptance.load_state_dict(saved["acceptance"])
        # a checkpoint from before the overheads were learned starts them afresh (they are relearned in a few steps)
        self.overheads.load_state_dict(saved.get("overheads", {}))
        self.widths = dict(saved.get("widths", {}))
        self._predictions.clear()
        self.collapsed = set(saved["collapsed"])
        self.watch.load_state_dict(saved.get("shown", {"shown": [], "healthy": []}))
        self.recent = {source: (int(steps), float(tokens)) for source, (steps, tokens) in saved["recent"].items()}
        self.steps, self.last_run = saved["steps"], dict(saved["last_run"])
        self.random.setstate(saved["random"])
        # a checkpoint from before the check against plain decoding starts it afresh
        self.plain_check.load_state_dict(saved.get("plain_check", {}))


def _family(config: SpeculativeConfig | None) -> str:
    """The draft sources of `config` as one name (`drafter`, `ngram`, `drafter+ngram`; `off` for plain decoding):
    configurations of one family share their step overheads until each has its own."""
    return "+".join(sorted(draft_sources((config,)))) or OFF
