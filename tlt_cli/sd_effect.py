"""SD's measured effect in one run, as one sentence: what the run summary and `tlt profile` both say.

    effect = measured_sd_effect(configs, accepted_tokens, verify_passes)   # configs: (label, seconds, decode steps)
    print(sd_effect_sentence(effect))

It compares the run's own decode steps, nothing assumed: a row gains `accept length` tokens per SD decode step
and one token per plain decode step (configuration "off"), so SD decodes accept_length x (seconds per plain
step / seconds per SD step) times the plain rate. SD runs in the tail of a rollout (few rows in flight), plain
decoding mostly at larger batches, so the comparison is the one the run itself made. tlt_cli/display.py's
`render_summary` (through `trace_sd_effect`) and tlt_cli/profile/analysis.py both call `measured_sd_effect`,
so the two say the same of the same run. Where SD did not pay, the sentence names the setting that turns it off.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tlt_cli.speculative.types import accept_length

# the label of plain decoding in sd_config records
PLAIN_LABEL = "off"


@dataclass(frozen=True)
class SdEffect:
    """One run's SD against its own plain decode steps."""

    accept_length: float
    # seconds per decode step, over the run's workers and steps: plain decoding, and with SD on
    plain_step_seconds: float
    sd_step_seconds: float

    @property
    def speedup(self) -> float:
        # tokens per second per row with SD / without: accept_length tokens per SD step vs one per plain step
        return self.accept_length * self.plain_step_seconds / self.sd_step_seconds


def measured_sd_effect(
    configs: Iterable[tuple[str, float, int]], accepted_tokens: int, verify_passes: int
) -> SdEffect | None:
    """The effect from (configuration label, seconds, decode steps) of the run's sd_config records and its requests'
    accepted draft tokens and verify passes; None when the run lacks SD steps or plain steps to compare."""
    seconds = {True: 0.0, False: 0.0}
    steps = {True: 0, False: 0}
    for label, config_seconds, decode_steps in configs:
        if decode_steps <= 0:  # a record without decode steps times nothing to compare
            continue
        speculating = label != PLAIN_LABEL
        seconds[speculating] += config_seconds
        steps[speculating] += decode_steps
    length = accept_length(accepted_tokens, verify_passes)
    if length is None or not all(steps.values()) or not all(seconds.values()):  # a 0-second record measures nothing
        return None
    return SdEffect(length, seconds[False] / steps[False], seconds[True] / steps[True])


def trace_sd_effect(records: Iterable[dict[str, Any]]) -> SdEffect | None:
    """`measured_sd_effect` over a trace's records (its sd_config and request records)."""
    configs, accepted, passes = [], 0, 0
    for record in records:
        if record.get("type") == "sd_config":
            configs.append(
                (str(record.get("config")), float(record.get("seconds", 0.0)), record.get("decode_steps", 0))
            )
        elif record.get("type") == "request":
            accepted += record.get("accepted_tokens", 0)
            passes += record.get("verify_passes", 0)
    return measured_sd_effect(configs, accepted, passes)


def sd_effect_sentence(effect: SdEffect | None) -> str:
    """The effect as one sentence; where SD did not pay, it says so and names speculative.mode=off."""
    if effect is None:
        return "SD's effect in this run: not measured (it decoded no steps both with SD and without)."
    how = (
        f"accept length {effect.accept_length:.2f} tokens per {1000 * effect.sd_step_seconds:.1f} ms SD decode step "
        f"against one per {1000 * effect.plain_step_seconds:.1f} ms plain decode step of this run"
    )
    if effect.speedup >= 1.0:
        return f"SD paid in this run: it decoded {effect.speedup:.2f}x as fast as plain decoding ({how})."
    return (
        f"SD did not pay in this run: it decoded {1 / effect.speedup:.2f}x slower than plain decoding ({how}); "
        "speculative.mode=off decodes plain."
    )
