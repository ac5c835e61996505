"""From measured throughput to the recipe's `speculative.rules`: a pure function of the numbers.

`calibrated_rules(throughput, margin, max_candidates)` takes emitted tokens per second by batch
size and configuration label ('off', 's4-k1-t5', ...) and returns recipe rule entries:
  - per measured batch size, the fastest SD configuration if it beats `off` by more than `margin`
    (0.05: 5%), else `off`; up to `max_candidates` runners-up within `margin` of the choice are
    kept as the bandit's candidates;
  - measured batch size b_i owns batch sizes [b_i, b_{i+1} - 1]; the first bucket starts at 1 and
    the last is open-ended;
  - adjacent buckets with the same choice merge (keeping the candidates common to all of them).
No accept-length ranges are written: a rule that switches SD off on low acceptance would stop
measuring acceptance and never switch back, which the schedule's collapse auto-off (recipe keys
`collapse_accept_length`, `reprobe_steps`) already handles with re-probes.
`fragment_text(rules, command)` is the YAML a recipe takes, with the command above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.config import Recipe, SpeculativeSection
from tlt_cli.recipe_help import comment_lines, key_help
from tlt_cli.speculative.types import OFF

# the comment line under the rules' help that names the calibration (recipe_text.py replaces both on a rewrite)
CALIBRATED_BY = "# calibrated by: "


@dataclass(frozen=True)
class BatchChoice:
    """The configuration chosen for one measured batch size, and its near-ties."""

    batch_size: int
    use: str
    candidates: tuple[str, ...]


def choose(batch_size: int, throughput: dict[str, float], margin: float, max_candidates: int) -> BatchChoice:
    """The choice for one batch size from tokens/s by label (which must include 'off')."""
    speculative = [label for label in throughput if label != OFF]
    best = max(speculative, key=throughput.__getitem__, default=OFF)
    # SD must beat plain decoding by the margin to be worth its risk
    use = best if throughput[best] > throughput[OFF] * (1 + margin) else OFF
    floor = throughput[use] * (1 - margin)
    runners_up = sorted(
        (label for label in throughput if label != use and throughput[label] >= floor),
        key=throughput.__getitem__,
        reverse=True,
    )
    return BatchChoice(batch_size, use, tuple(runners_up[:max_candidates]))


def rules_from_choices(choices: list[BatchChoice]) -> list[dict]:
    """Recipe rule entries: contiguous buckets from batch size 1, the last open, equal neighbours merged."""
    ordered = sorted(choices, key=lambda choice: choice.batch_size)
    entries: list[dict] = []
    for index, choice in enumerate(ordered):
        first = 1 if index == 0 else choice.batch_size
        last = ordered[index + 1].batch_size - 1 if index + 1 < len(ordered) else None
        if entries and entries[-1]["use"] == choice.use:
            previous = entries[-1]
            previous["batch"][1] = last
            previous["candidates"] = [label for label in previous["candidates"] if label in choice.candidates]
            continue
        entries.append({"batch": [first, last], "use": choice.use, "candidates": list(choice.candidates)})
    for entry in entries:
        if not entry["candidates"]:
            del entry["candidates"]
    return entries


def calibrated_rules(
    throughput: dict[int, dict[str, float]], margin: float, max_candidates: int
) -> tuple[list[BatchChoice], list[dict]]:
    """(choice per measured batch size, the rule entries) from tokens/s by batch size and label."""
    choices = [
        choose(batch_size, by_label, margin, max_candidates) for batch_size, by_label in sorted(throughput.items())
    ]
    return choices, rules_from_choices(choices)


def fragment_text(rules: list[dict], command: str) -> str:
    """The recipe YAML for the rules: `speculative:` under its help, with `mode: adaptive` and `rules:`,
    the command above them."""
    lines = [
        *comment_lines(key_help(Recipe, "speculative"), ""),
        "speculative:",
        *comment_lines(key_help(SpeculativeSection, "mode"), "  "),
        "  mode: adaptive",
        *rules_block(rules, command, indent="  "),
    ]
    return "\n".join(lines) + "\n"


def rules_block(rules: list[dict], command: str, indent: str) -> list[str]:
    """The `rules:` key under its help and the command, and one flow-style line per rule, at `indent`."""
    return [
        *rules_comment(indent),
        f"{indent}{CALIBRATED_BY}{command}",
        f"{indent}rules:",
        *(f"{indent}  - {_flow(rule)}" for rule in rules),
    ]


def rules_comment(indent: str) -> list[str]:
    """The help of `speculative.rules` as the comment lines above the key."""
    return comment_lines(key_help(SpeculativeSection, "rules"), indent)


def _flow(rule: dict) -> str:
    last = "null" if rule["batch"][1] is None else rule["batch"][1]
    parts = [f"batch: [{rule['batch'][0]}, {last}]", f"use: {_scalar(rule['use'])}"]
    if rule.get("candidates"):
        parts.append(f"candidates: [{', '.join(_scalar(label) for label in rule['candidates'])}]")
    return "{" + ", ".join(parts) + "}"


def _scalar(label: str) -> str:
    # a bare off is the boolean false in YAML 1.1
    return f'"{label}"' if label == OFF else label
