"""The rule table of `speculative.mode: adaptive`: its labels, its rules and the check that they cover every case.

A rule maps a batch-size range and a measured accept-length range to a configuration label (`parse_label`:
off, a drafter shape s<steps>-k<topk>-t<draft tokens>, model-free ngram<tokens>, a hybrid joined by +, or one
source per row joined by |) and optional candidates the bandit (rule_schedule.py) chooses among. `build_rules`
parses a recipe's table and `check_coverage` makes sure exactly one rule matches every (batch size, accept
length); the composition root (tlt_cli/training/setup.py `speculative_plan`) names the recipe key in the error.
The SGLang mapping (tlt_cli/sglang/adaptive.py) reads the same table; `tlt calibrate` writes one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.errors import UserError
from tlt_cli.speculative.types import OFF, SpeculativeConfig

NGRAM_PREFIX = "ngram"  # model-free labels: ngram<tokens>, alone or after a drafter shape and a +
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
