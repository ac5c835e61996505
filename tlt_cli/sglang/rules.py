"""The recipe's `speculative` section as the batch-size rules SGLang's plan is made from.

SGLang picks a speculative shape from the running batch size alone, so `batch_rules(section)`
reduces the recipe to one `BatchRule` per batch-size range: `off` is SD off everywhere, `fixed`
is one shape everywhere, and `adaptive` takes, for every range on which the table's rules are
constant, the configuration tlt's own schedule starts with (the rule matching an accept length
not yet measured; its `use:`, not its bandit candidates). `adaptive.plan_for_sglang` then maps
these rules onto what the installed SGLang can switch.
"""

from __future__ import annotations

from tlt_cli.adaptive import UNBOUNDED, Rule, bucket_edges, build_rules
from tlt_cli.config import SpeculativeSection
from tlt_cli.rollout.types import SpeculativeConfig
from tlt_cli.sglang.adaptive import BatchRule


def batch_rules(section: SpeculativeSection) -> list[BatchRule]:
    """Batch-size rules for SGLang from the recipe's speculative section (already validated)."""
    if section.mode == "off":
        return [BatchRule(1, None, None)]
    if section.mode == "fixed":
        return [BatchRule(1, None, SpeculativeConfig(section.steps, section.topk, section.draft_tokens))]
    return _adaptive_batch_rules(build_rules([dict(rule) for rule in section.rules]))


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
