"""Map the recipe's `speculative` section onto what a stock SGLang server can switch without a restart.

The embedded engine re-reads the rule table at every decode step and can run any shape (steps,
topk, draft_tokens) or SD off. Stock SGLang cannot change topk or the draft-token count of a
running server. What it can do (0.5.16 and later) is `--speculative-adaptive`: a JSON file of
batch-size slots, each with candidate draft depths, where depth 0 means SD off; the scheduler
picks the slot from the running batch size at every decode step (EAGLE chains only, topk 1).

SGLang picks a shape from the running batch size alone, so `batch_rules(plan)` first reduces the
speculative plan (tlt_cli/speculative/adaptive.py; tlt_cli/training/setup.py makes it from the
recipe and checks its rule table) to one `BatchRule` per batch-size range, in order from 1: `off`
is SD off everywhere, `fixed` one shape everywhere, and `adaptive` takes, for every range on which
the rule table is constant, the configuration tlt's own schedule starts with (the rule matching an
accept length not yet measured; its `use:`, not its bandit candidates).
`plan_for_sglang(rules, features, auto_off_on_collapse)` then returns one of four plans:

- **off**: every rule is off; servers launch without speculative flags.
- **adaptive**: every rule is off or a chain; slot `min_batch` gets candidate steps `[steps]`
  (plus 0 when `auto_off_on_collapse`, so SGLang's acceptance EMA can turn a collapsed slot
  off and re-probe it later) or `[0]` for off. Written with `write_adaptive_config`.
- **static**: a tree rule (topk > 1), or an SGLang without slots: one configuration, taken
  from the rule that covers `static_batch_size` (the tail), runs at every batch size.
- **ngram**: the table's SD configurations are model-free (`ngram<k>`): SGLang's own NGRAM
  drafting (`--speculative-algorithm NGRAM`, one trie per server fed by every running request),
  one configuration at every batch size as in a static plan. NGRAM cannot run beside EAGLE:
  `one_algorithm_problem(configs)` says so of hybrid configurations (`s2-k1-t3+ngram4`) and tables mixing
  the two, in the sentence the recipe checks (tlt_cli/recipe_checks.py) refuse the recipe with.

`SGLangSpeculativePlan.differences` lists, in sentences, how the plan differs from the
embedded engine; the backend logs them at start. The server command line is built from the
plan by `server_args.speculative_flags`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from tlt_cli.sglang.version import SGLangFeatures
from tlt_cli.speculative.plan import SpeculationMode, SpeculativePlan
from tlt_cli.speculative.rules import UNBOUNDED, Rule, bucket_edges
from tlt_cli.speculative.types import SpeculativeConfig

# batch sizes above SGLang's largest captured CUDA graph are not padded; range ends are checked up to this
CAPTURE_CHECK_LIMIT = 4096


@dataclass(frozen=True)
class BatchRule:
    """SD configuration for running batch sizes min_batch..max_batch (None = no upper bound)."""

    min_batch: int
    max_batch: int | None
    # None = SD off for this range
    speculative: SpeculativeConfig | None

    def describe(self) -> str:
        upper = "" if self.max_batch is None else f"-{self.max_batch}"
        shape = "off" if self.speculative is None else self.speculative.label()
        return f"batch {self.min_batch}{upper} -> {shape}"

    def covers(self, batch_size: int) -> bool:
        return self.min_batch <= batch_size and (self.max_batch is None or batch_size <= self.max_batch)


# speculative.mode auto on SGLang servers: the servers' passes are not timed by tlt and SGLang picks a slot by batch
# size alone, so auto becomes EAGLE chains by batch size, deeper where the batch is small (the reference's H100
# buckets as chains: SD off above 32 running requests), each slot turned off by SGLang's own acceptance EMA when
# it collapses. The embedded engine's per-step choice from measured costs and acceptance does not carry over.
AUTO_BATCH_RULES = (
    BatchRule(1, 1, SpeculativeConfig(steps=6)),
    BatchRule(2, 4, SpeculativeConfig(steps=4)),
    BatchRule(5, 20, SpeculativeConfig(steps=2)),
    BatchRule(21, 32, SpeculativeConfig(steps=1)),
    BatchRule(33, None, None),
)


class PlanMode(str, Enum):
    """How the servers speculate (see the module docstring); not the recipe's speculative.mode."""

    off = "off"
    adaptive = "adaptive"
    static = "static"
    ngram = "ngram"


@dataclass(frozen=True)
class SGLangSpeculativePlan:
    """What the servers are launched with; slots: (min_batch, candidate steps) in adaptive mode."""

    mode: PlanMode
    launch: SpeculativeConfig | None
    slots: tuple[tuple[int, tuple[int, ...]], ...]
    differences: tuple[str, ...]

    def adaptive_config(self) -> dict:
        """The JSON body of --speculative-adaptive-config: {"<min_batch>": {"candidate_steps": [...]}}."""
        return {str(min_batch): {"candidate_steps": list(steps)} for min_batch, steps in self.slots}


def batch_rules(plan: SpeculativePlan) -> list[BatchRule]:
    """Batch-size rules from the speculative plan, covering batch sizes 1.. in order; a ValueError for a rule
    table the recipe checks refuse (`one_algorithm_problem`)."""
    if plan.mode == SpeculationMode.off:
        return [BatchRule(1, None, None)]
    if plan.mode == SpeculationMode.fixed:
        return [BatchRule(1, None, plan.shape)]
    if plan.mode == SpeculationMode.auto:
        return list(AUTO_BATCH_RULES)
    _require_one_algorithm(list(plan.configs))
    return _adaptive_batch_rules(list(plan.rules))


def one_algorithm_problem(configs: Sequence[SpeculativeConfig]) -> str | None:
    """Why an SGLang server cannot run `configs`, in one sentence (it runs NGRAM or EAGLE, never both: no
    hybrid, no table mixing the two); None when it can."""
    for config in configs:
        if config.uses_ngram and config.uses_drafter:
            return (
                f"{config.label()} drafts with both the n-gram index and the drafter, which SGLang cannot run (its "
                f"NGRAM drafting does not combine with EAGLE); use ngram{config.ngram_tokens} or "
                f"{config.drafter_part.label()} with rollout.backend: sglang."
            )
    if len({config.uses_ngram for config in configs}) > 1:
        return (
            "the rule table mixes model-free ngram<k> with drafter configurations, and an SGLang server runs one "
            "speculative algorithm (NGRAM or EAGLE); use one kind with rollout.backend: sglang."
        )
    return None


def _require_one_algorithm(configs: list[SpeculativeConfig]) -> None:
    problem = one_algorithm_problem(configs)
    if problem is not None:
        raise ValueError(problem)


def _adaptive_batch_rules(rules: list[Rule]) -> list[BatchRule]:
    edges = bucket_edges(rules)
    batch_rules = []
    for index, first in enumerate(edges):
        last = edges[index + 1] - 1 if index + 1 < len(edges) else None
        # an unmeasured bucket counts as accept length unbounded, as in tlt's AdaptiveSchedule
        rule = next(rule for rule in rules if rule.matches(first, UNBOUNDED))
        batch_rules.append(BatchRule(first, last, rule.configs[0]))
    return _merge_equal_neighbours(batch_rules)


def _merge_equal_neighbours(rules: list[BatchRule]) -> list[BatchRule]:
    """Adjacent ranges with the same shape become one range (fewer SGLang slots)."""
    merged = [rules[0]]
    for rule in rules[1:]:
        previous = merged[-1]
        if rule.speculative == previous.speculative:
            merged[-1] = BatchRule(previous.min_batch, rule.max_batch, previous.speculative)
        else:
            merged.append(rule)
    return merged


def captured_decode_batch_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes SGLang (0.5.23) captures CUDA graphs for with speculative decoding on.

    Every size 1-8, then even sizes to 32, every 4th to 64, every 8th to 256, every 16th after,
    and max_batch itself. A running batch is padded up to the next captured size before SGLang
    picks its adaptive slot.
    """
    sizes = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
    sizes += list(range(272, max_batch + 1, 16))
    sizes = [size for size in sizes if size <= max_batch]
    return sizes if max_batch in sizes else sizes + [max_batch]


def plan_for_sglang(
    rules: Sequence[BatchRule],
    features: SGLangFeatures,
    auto_off_on_collapse: bool = True,
    static_batch_size: int = 1,
) -> SGLangSpeculativePlan:
    """Choose the off / adaptive / static plan for `rules` (as `batch_rules` gives them) on the SGLang
    release `features` describes."""
    speculative_rules = [rule for rule in rules if rule.speculative is not None]
    if not speculative_rules:
        return SGLangSpeculativePlan(
            PlanMode.off, None, (), ("SD is off on every server, as every rule of the table says.",)
        )
    _require_one_algorithm([rule.speculative for rule in speculative_rules])
    if speculative_rules[0].speculative.uses_ngram:
        return _ngram_plan(rules, static_batch_size)
    all_chains = all(rule.speculative.is_chain for rule in speculative_rules)
    if all_chains and features.adaptive_slots:
        return _adaptive_plan(rules, auto_off_on_collapse, static_batch_size)
    return _static_plan(rules, features, all_chains, static_batch_size)


def _tail_rule(rules: Sequence[BatchRule], static_batch_size: int) -> BatchRule:
    """The rule covering static_batch_size if it has SD on, else the first rule with SD on."""
    covering = [rule for rule in rules if rule.covers(static_batch_size) and rule.speculative is not None]
    return covering[0] if covering else next(rule for rule in rules if rule.speculative is not None)


def _adaptive_plan(
    rules: Sequence[BatchRule], auto_off_on_collapse: bool, static_batch_size: int
) -> SGLangSpeculativePlan:
    launch_rule = _tail_rule(rules, static_batch_size)
    launch = SpeculativeConfig(
        steps=launch_rule.speculative.steps, topk=1, draft_tokens=launch_rule.speculative.steps + 1
    )
    slots = []
    for rule in rules:
        if rule.speculative is None:
            slots.append((rule.min_batch, (0,)))
        else:
            # step 0 beside the rule's depth lets SGLang's acceptance EMA switch a collapsed slot off
            steps = (0, rule.speculative.steps) if auto_off_on_collapse else (rule.speculative.steps,)
            slots.append((rule.min_batch, steps))
    return SGLangSpeculativePlan(
        PlanMode.adaptive, launch, tuple(slots), _adaptive_differences(rules, auto_off_on_collapse)
    )


def _adaptive_differences(rules: Sequence[BatchRule], auto_off_on_collapse: bool) -> tuple[str, ...]:
    differences = [
        "SGLang picks the slot per server from its whole running batch at each decode step; "
        "draft_tokens is always steps + 1 (chains only).",
        "SGLang pads the running batch to its next CUDA-graph batch size before picking the slot.",
        "tlt's online bandit does not run: the slots are fixed when the servers start.",
    ]
    captured = set(captured_decode_batch_sizes(CAPTURE_CHECK_LIMIT))
    uncaptured = [rule.max_batch for rule in rules[:-1] if rule.max_batch not in captured]
    if uncaptured:
        differences.append(
            f"range ends {uncaptured} are not CUDA-graph batch sizes, "
            "so padding moves those batches into the next slot early."
        )
    if auto_off_on_collapse:
        differences.append(
            "acceptance conditions are SGLang's: a slot turns SD off when its moving average falls to about "
            "0.25 accepted drafts per verify (accept length 1.25) and re-probes later."
        )
    else:
        differences.append("no slot turns SD off on collapsed acceptance (auto_off_on_collapse is false).")
    return tuple(differences)


def _static_plan(
    rules: Sequence[BatchRule], features: SGLangFeatures, all_chains: bool, static_batch_size: int
) -> SGLangSpeculativePlan:
    chosen = _tail_rule(rules, static_batch_size)
    config = chosen.speculative
    launch = SpeculativeConfig(
        config.steps, config.topk, config.steps + 1 if config.is_chain else config.verified_tokens
    )
    reason = (
        f"SGLang {features.version} has no adaptive batch-size slots (0.5.16 and later do)"
        if all_chains
        else "a rule uses a tree (topk > 1), which SGLang cannot switch without a restart"
    )
    differences = [f"{reason}: every server runs {launch.label()} (from {chosen.describe()}) at every batch size."]
    off_rules = [rule.describe() for rule in rules if rule.speculative is None]
    if off_rules:
        differences.append(
            f"SD stays on where the table says off ({', '.join(off_rules)}), where it costs target compute."
        )
    differences.append("acceptance is not acted on inside SGLang; the post-sync probe still checks it.")
    return SGLangSpeculativePlan(PlanMode.static, launch, (), tuple(differences))


def _ngram_plan(rules: Sequence[BatchRule], static_batch_size: int) -> SGLangSpeculativePlan:
    chosen = _tail_rule(rules, static_batch_size)
    differences = [
        f"SGLang's NGRAM drafting runs {chosen.speculative.label()} (from {chosen.describe()}) at every batch size: "
        "it has no batch-size slots.",
        "its n-gram trie is one per server, fed by every running request, where tlt's index is one per prompt "
        "group (a prompt and its sibling responses) and keeps finished siblings.",
        "hybrid drafting (n-gram beside the drafter in one tree) is not available on SGLang.",
    ]
    off_rules = [rule.describe() for rule in rules if rule.speculative is None]
    if off_rules:
        differences.append(f"SD stays on where the table says off ({', '.join(off_rules)}).")
    return SGLangSpeculativePlan(PlanMode.ngram, chosen.speculative, (), tuple(differences))


def write_adaptive_config(plan: SGLangSpeculativePlan, path: str | Path) -> Path:
    """Write the plan's slot JSON for --speculative-adaptive-config; only adaptive plans have one."""
    if plan.mode is not PlanMode.adaptive:
        raise ValueError(f"only an adaptive plan has a slot config, this plan is '{plan.mode.value}'.")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan.adaptive_config(), indent=2) + "\n")
    return path
