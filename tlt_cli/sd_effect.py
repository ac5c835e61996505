"""SD's measured effect in one run, like for like, as one sentence: what the run summary and `tlt profile` say.

    effect = measured_sd_effect(timings, accepted_tokens, verify_passes)   # timings: RowsTiming per config, step, rows
    print(sd_effect_sentence(effect))

SD runs in the tail of a rollout (few rows in flight), plain decoding mostly at large batches, so pooling the
two over every row count compares different work. Here SD's decode steps at each running batch size are set
against plain decoding's at the same size, from the run's own plain ("off") steps: plain's seconds per step at
that size, pooled over the run, interpolated linearly between the sizes it ran at, and below its smallest size
taken at that size's seconds (a step is never cheaper with more rows, so this favours plain). SD's tokens at a
size would have taken plain (tokens / rows) steps there; the effect is that time over SD's own, for the run and
for each step (the spread). What it saved, against the run's whole decode time, is its effect on the rollout.
tlt_cli/display.py's `render_summary` (through `trace_sd_effect`) and tlt_cli/profile/analysis.py both call
`measured_sd_effect`, so the two say the same of the same run; mode auto's check against plain decoding
(tlt_cli/speculative/plain_check.py) prices SD's steps with the same `plain_seconds_for` while the run decodes.
Where SD did not pay, the sentence names the setting that turns it off.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy

from tlt_cli.speculative.types import accept_length

# the label of plain decoding in sd_config records
PLAIN_LABEL = "off"


@dataclass(frozen=True)
class RowsTiming:
    """One worker's decode steps of one configuration in one RL step at one running batch size (`rows`)."""

    config: str
    step: int
    rows: int
    decode_steps: int
    seconds: float
    tokens: int


@dataclass(frozen=True)
class SdEffect:
    """One run's SD against its own plain decoding at the same batch sizes (module docstring).

    sd_seconds: the SD decode steps' seconds; plain_seconds: what plain decoding would have taken for their tokens
    at the same batch sizes; decode_seconds: every decode step's seconds (SD and plain); step_speedups: each RL
    step's plain_seconds / sd_seconds, in step order; plain_sizes: the batch sizes plain decoding ran at."""

    accept_length: float
    sd_seconds: float
    plain_seconds: float
    decode_seconds: float
    step_speedups: tuple[float, ...]
    plain_sizes: tuple[int, ...]

    @property
    def speedup(self) -> float:
        """SD's decode steps against plain decoding of the same tokens at the same batch sizes."""
        return self.plain_seconds / self.sd_seconds

    @property
    def decode_speedup(self) -> float:
        """The whole decode against all of it plain: what SD saved, over the run's decode seconds."""
        return (self.decode_seconds + self.plain_seconds - self.sd_seconds) / self.decode_seconds


def plain_step_seconds(timings: Iterable[RowsTiming]) -> tuple[numpy.ndarray, numpy.ndarray] | None:
    """(batch sizes, seconds per plain step at each), pooled over the run's plain steps; None: no plain step."""
    seconds: dict[int, float] = defaultdict(float)
    steps: dict[int, int] = defaultdict(int)
    for timing in timings:
        if timing.config == PLAIN_LABEL and timing.decode_steps > 0 and timing.seconds > 0:
            seconds[timing.rows] += timing.seconds
            steps[timing.rows] += timing.decode_steps
    if not steps:
        return None
    sizes = sorted(steps)
    return numpy.array(sizes, dtype=float), numpy.array([seconds[size] / steps[size] for size in sizes])


def plain_seconds_for(timing: RowsTiming, plain: tuple[numpy.ndarray, numpy.ndarray]) -> float:
    """What plain decoding would have taken for `timing`'s tokens at its batch size, from `plain_step_seconds`
    (interpolated between the sizes plain ran at, below the smallest taken at its seconds)."""
    sizes, seconds_per_step = plain
    # plain decoding emits one token a row a step: these tokens at these rows take tokens / rows plain steps
    return timing.tokens / timing.rows * float(numpy.interp(timing.rows, sizes, seconds_per_step))


def measured_sd_effect(timings: Iterable[RowsTiming], accepted_tokens: int, verify_passes: int) -> SdEffect | None:
    """The effect from the run's decode steps by configuration, step and batch size, and its requests' accepted
    draft tokens and verify passes; None when the run lacks SD steps or plain steps to compare."""
    timings = [timing for timing in timings if timing.decode_steps > 0 and timing.seconds > 0]
    plain = plain_step_seconds(timings)
    length = accept_length(accepted_tokens, verify_passes)
    speculated = [timing for timing in timings if timing.config != PLAIN_LABEL]
    if plain is None or length is None or not speculated:
        return None
    sizes, _ = plain
    sd_seconds: dict[int, float] = defaultdict(float)
    plain_seconds: dict[int, float] = defaultdict(float)
    for timing in speculated:
        plain_seconds[timing.step] += plain_seconds_for(timing, plain)
        sd_seconds[timing.step] += timing.seconds
    steps = sorted(sd_seconds)
    return SdEffect(
        accept_length=length,
        sd_seconds=sum(sd_seconds.values()),
        plain_seconds=sum(plain_seconds.values()),
        decode_seconds=sum(timing.seconds for timing in timings),
        step_speedups=tuple(plain_seconds[step] / sd_seconds[step] for step in steps),
        plain_sizes=tuple(int(size) for size in sizes),
    )


def record_timings(record: dict[str, Any]) -> list[RowsTiming]:
    """The RowsTiming of one sd_config trace record, one per batch size it ran at (none in traces written before
    its seconds were kept by batch size)."""
    seconds, tokens = record.get("batch_seconds", {}), record.get("batch_tokens", {})
    return [
        RowsTiming(
            config=str(record.get("config")),
            step=int(record.get("step", 0)),
            rows=int(size),
            decode_steps=int(decode_steps),
            seconds=float(seconds.get(size, 0.0)),
            tokens=int(tokens.get(size, 0)),
        )
        for size, decode_steps in record.get("batch_sizes", {}).items()
        if size in seconds
    ]


def trace_sd_effect(records: Iterable[dict[str, Any]]) -> SdEffect | None:
    """`measured_sd_effect` over a trace's records (its sd_config and request records)."""
    timings, accepted, passes = [], 0, 0
    for record in records:
        if record.get("type") == "sd_config":
            timings.extend(record_timings(record))
        elif record.get("type") == "request":
            accepted += record.get("accepted_tokens", 0)
            passes += record.get("verify_passes", 0)
    return measured_sd_effect(timings, accepted, passes)


def spread(effect: SdEffect) -> str:
    """The per-step range of the effect, or that one step is one sample."""
    if len(effect.step_speedups) == 1:
        return "one step: no spread"
    return (
        f"{min(effect.step_speedups):.2f}x to {max(effect.step_speedups):.2f}x over {len(effect.step_speedups)} steps"
    )


def sd_effect_sentence(effect: SdEffect | None) -> str:
    """The effect as one sentence; where SD did not pay, it says so and names speculative.mode=off."""
    if effect is None:
        return (
            "SD's effect in this run: not measured (it decoded no steps both with SD and without, or its trace "
            "predates timing by batch size)."
        )
    how = (
        f"accept length {effect.accept_length:.2f}, against this run's plain steps at the same batch sizes; "
        f"{spread(effect)}; the whole decode {effect.decode_speedup:.2f}x"
    )
    if effect.speedup >= 1.0:
        return f"SD paid in this run: its steps decoded {effect.speedup:.2f}x as fast as plain decoding ({how})."
    return (
        f"SD did not pay in this run: its steps decoded {1 / effect.speedup:.2f}x slower than plain decoding ({how}); "
        "speculative.mode=off decodes plain."
    )
