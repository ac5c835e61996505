"""The numbers of `tlt profile`: long-tail lengths, idle workers, SD time and acceptance, and a projection.

`analyse(records, tail_batch, sd_speedup)` turns `ProfileRecords` into a `Profile` (plain
dataclasses, JSON-ready through `profile_to_json`); `worker_segments` cuts each worker's step into
busy / tail / idle stretches for the report and the plots.

Projection model (stated in every report next to its result, `Projection.model`):
  - a worker is in the *tail* while it has 1 to `tail_batch` requests in flight (its running batch
    is small, the regime where SD pays); SD makes that stretch `s` times faster, nothing else;
  - `s` is measured from the input when it can be: accept length x (seconds per plain decode step /
    seconds per SD decode step), from the sd_config records; otherwise the `--sd-speedup` value,
    or `ASSUMED_SD_SPEEDUP`, reported as assumed;
  - each worker finishes earlier by tail_seconds x (1 - 1/s); a step's rollout ends when its slowest
    worker ends; the rest of the step (reward, update, sync) is unchanged, so the step speedup is
    Amdahl's law over the rollout share. Without step timings (plain request records, recorded
    rollouts) the speedup is of rollout time alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from itertools import groupby

import numpy

from tlt_cli.profile.records import (
    PrecisionSegment,
    ProfileRecords,
    RequestRecord,
    RolloutMismatch,
    SdConfigRecord,
    StepRecord,
    WorkerRecord,
)
from tlt_cli.sd_effect import RowsTiming, SdEffect, measured_sd_effect, sd_effect_sentence
from tlt_cli.speculative.types import accept_length, source_accept_lengths

DEFAULT_TAIL_BATCH = 4
# per-token speedup of SD in the tail assumed when the input measured none (the order reported for
# EAGLE-style drafters at batch size 1-4)
ASSUMED_SD_SPEEDUP = 2.0
SD_OFF_LABEL = "off"


@dataclass(frozen=True)
class Segment:
    """A stretch of one worker's step: "busy" (more than tail_batch requests in flight, or none yet), "tail"
    (1..tail_batch in flight) or "idle" (its shard done, or not started, while the step's rollout runs)."""

    step: int
    worker: int
    start: float
    end: float
    state: str


@dataclass(frozen=True)
class LengthStats:
    count: int
    p50: float
    p90: float
    p99: float
    max: float
    # p99 / p50: how long the tail is (None when p50 is 0)
    tail_ratio: float | None


@dataclass(frozen=True)
class StepProfile:
    step: int
    rollout_seconds: float
    step_seconds: float | None
    # time in the rollout where fewer than half the workers were busy, and its share of the rollout
    under_half_busy_seconds: float
    under_half_busy_share: float
    # share of the rollout where at least one worker was idle
    some_idle_share: float
    idle_worker_seconds: float
    idle_fraction: float
    # the slowest worker's time with 1..tail_batch requests in flight
    tail_seconds: float
    projected_rollout_seconds: float
    # the highest worker's resident peak in the step, GB (None where the input does not say)
    memory_peak_gb: float | None = None
    # the rollout/learner mismatch the trainer measured (None where the input does not say)
    mismatch: RolloutMismatch | None = None


@dataclass(frozen=True)
class ConfigTime:
    """Decoding time with one SD configuration ("off" = SD off), summed over workers and steps."""

    config: str
    seconds: float
    decode_steps: int
    share: float
    # draft source -> accept length counting only its drafts (types.source_accept_lengths); empty for off
    accept_length_by_source: dict[str, float] = field(default_factory=dict)
    # tokens per second measured, and as mode auto's cost model predicted them (None: not predicted)
    tokens_per_second: float | None = None
    predicted_tokens_per_second: float | None = None
    # the running batch sizes it decoded at, smallest and largest (None: not recorded)
    batch_range: tuple[int, int] | None = None


@dataclass(frozen=True)
class DepthAcceptance:
    """Draft depth (1 = first drafted token): verify passes that drafted it, that accepted it."""

    depth: int
    proposed: int
    accepted: int
    # accepted / proposed
    rate: float
    # accepted / all verify passes: what this depth adds to the accept length
    accept_length_share: float


@dataclass(frozen=True)
class Projection:
    model: str
    tail_batch: int
    sd_speedup: float
    sd_speedup_source: str
    # "step" when step timings exist, else "rollout"
    speedup_of: str
    rollout_share: float | None
    reclaimable_seconds: float
    projected_speedup: float


@dataclass(frozen=True)
class Profile:
    source: str
    kind: str
    workers: int
    lengths: LengthStats
    steps: list[StepProfile]
    rollout_seconds: float
    step_seconds: float | None
    idle_worker_seconds: float
    idle_fraction: float
    under_half_busy_share: float
    some_idle_share: float
    sd_time: list[ConfigTime]
    sd_on_seconds: float | None
    sd_off_seconds: float | None
    # (accepted drafts + verify passes) / verify passes over every request; None when SD never ran
    accept_length: float | None
    accept_by_depth: list[DepthAcceptance]
    # draft source (drafter, ngram) -> its accept length over every configuration drafting with it
    accept_length_by_source: dict[str, float]
    drafter_train_seconds: float
    drafter_steps: int
    # drafter training seconds / idle worker-seconds
    drafter_idle_share: float
    # SD's measured effect in this run, one sentence (tlt_cli/sd_effect.py: the run summary says the same)
    sd_effect: str
    projection: Projection
    warnings: list[str]
    # the precisions the run ran in: per distinct rollout precision of the workers, the dtype and the figures that
    # chose it, then the actor's; a resumed run's lines per segment, each headed by its steps
    precision: list[str] = field(default_factory=list)


def analyse(records: ProfileRecords, tail_batch: int = DEFAULT_TAIL_BATCH, sd_speedup: float | None = None) -> Profile:
    """The profile of `records`; sd_speedup overrides the measured (or assumed) tail speedup."""
    if tail_batch < 1:
        raise ValueError(f"tail batch is {tail_batch}; set it to at least 1.")
    if sd_speedup is not None and sd_speedup < 1.0:
        raise ValueError(f"SD speedup is {sd_speedup}; give a factor of at least 1.0.")
    segments = worker_segments(records, tail_batch)
    accept_length = _accept_length(records.requests)
    effect = _sd_effect(records)
    speedup, speedup_source = _sd_speedup(effect, sd_speedup)
    steps = [_step_profile(records, step, segments, speedup) for step in records.steps]
    rollout_seconds = sum(step.rollout_seconds for step in steps)
    capacity = records.world_size * rollout_seconds
    idle_worker_seconds = sum(step.idle_worker_seconds for step in steps)
    sd_time = _sd_time(records)
    drafter_seconds = sum(worker.drafter_train_seconds for worker in records.workers)
    return Profile(
        source=records.source,
        kind=records.kind,
        workers=records.world_size,
        lengths=_length_stats([request.tokens for request in records.requests]),
        steps=steps,
        rollout_seconds=rollout_seconds,
        step_seconds=_total_step_seconds(steps),
        idle_worker_seconds=idle_worker_seconds,
        idle_fraction=idle_worker_seconds / capacity if capacity else 0.0,
        under_half_busy_share=_weighted_share(steps, "under_half_busy_share"),
        some_idle_share=_weighted_share(steps, "some_idle_share"),
        sd_time=sd_time,
        sd_on_seconds=sum(entry.seconds for entry in sd_time if entry.config != SD_OFF_LABEL) if sd_time else None,
        sd_off_seconds=sum(entry.seconds for entry in sd_time if entry.config == SD_OFF_LABEL) if sd_time else None,
        accept_length=accept_length,
        accept_by_depth=_accept_by_depth(records.requests),
        accept_length_by_source=source_accept_lengths(_source_counts(records.sd_configs)),
        drafter_train_seconds=drafter_seconds,
        drafter_steps=sum(worker.drafter_steps for worker in records.workers),
        drafter_idle_share=drafter_seconds / idle_worker_seconds if idle_worker_seconds else 0.0,
        sd_effect=sd_effect_sentence(effect),
        projection=_projection(steps, tail_batch, speedup, speedup_source, already_sd=accept_length is not None),
        warnings=list(records.warnings),
        precision=precision_lines(records.precision_segments, max((step.step for step in records.steps), default=0)),
    )


def precision_lines(segments: list[PrecisionSegment], last_step: int) -> list[str]:
    """The lines of each segment's precisions (`Profile.precision`); with several, each headed `steps a-b:`."""
    lines = []
    for index, segment in enumerate(segments):
        own = sorted({choice.describe() for choice in segment.rollout.values()})
        own += [segment.actor] if segment.actor is not None else []
        if len(segments) > 1:
            end = segments[index + 1].first_step - 1 if index + 1 < len(segments) else last_step
            own = [f"steps {segment.first_step}-{end}: {line}" for line in own]
        lines += own
    return lines


def profile_to_json(profile: Profile) -> dict:
    return asdict(profile)


def worker_segments(records: ProfileRecords, tail_batch: int) -> list[Segment]:
    """Every worker's step cut into busy / tail / idle stretches, within the step's rollout window."""
    windows = {step.step: (step.rollout_start, step.rollout_end) for step in records.steps}
    requests = {
        key: list(group) for key, group in groupby(records.requests, key=lambda request: (request.step, request.worker))
    }
    segments = []
    for worker in records.workers:
        rollout_start, rollout_end = windows[worker.step]
        busy_start, busy_end = max(worker.busy_start, rollout_start), min(worker.busy_end, rollout_end)
        segments += _idle(worker, rollout_start, busy_start)
        segments += _busy_segments(
            worker, busy_start, busy_end, requests.get((worker.step, worker.worker), []), tail_batch
        )
        segments += _idle(worker, busy_end, rollout_end)
    return segments


def _idle(worker: WorkerRecord, start: float, end: float) -> list[Segment]:
    return [Segment(worker.step, worker.worker, start, end, "idle")] if end > start else []


def _busy_segments(
    worker: WorkerRecord, start: float, end: float, requests: list[RequestRecord], tail_batch: int
) -> list[Segment]:
    """Split [start, end] wherever the number of requests in flight changes (a sweep over their starts and ends)."""
    events = sorted(
        (min(max(time, start), end), change)
        for request in requests
        for time, change in ((request.start, 1), (request.end, -1))
    )
    segments: list[Segment] = []
    in_flight, cursor = 0, start
    for time, change in [*events, (end, 0)]:
        if time > cursor:
            state = "tail" if 1 <= in_flight <= tail_batch else "busy"
            if segments and segments[-1].state == state:
                segments[-1] = Segment(worker.step, worker.worker, segments[-1].start, time, state)
            else:
                segments.append(Segment(worker.step, worker.worker, cursor, time, state))
            cursor = time
        in_flight += change
    return segments


def _step_profile(
    records: ProfileRecords, step_record: StepRecord, segments: list[Segment], sd_speedup: float
) -> StepProfile:
    rollout_start, rollout_end = step_record.rollout_start, step_record.rollout_end
    rollout_seconds = rollout_end - rollout_start
    busy = [segment for segment in segments if segment.step == step_record.step and segment.state != "idle"]
    busy_seconds = sum(segment.end - segment.start for segment in busy)
    idle_worker_seconds = records.world_size * rollout_seconds - busy_seconds
    under_half = _time_below(busy, rollout_start, rollout_end, records.world_size / 2)
    some_idle = _time_below(busy, rollout_start, rollout_end, records.world_size)
    # per worker: (when its shard ended, its seconds with 1..tail_batch requests in flight)
    ends_and_tails = [
        (
            max(segment.end for segment in own),
            sum((segment.end - segment.start for segment in own if segment.state == "tail"), 0.0),
        )
        for own in (
            [segment for segment in busy if segment.worker == worker] for worker in sorted({s.worker for s in busy})
        )
    ]
    slowest_end, slowest_tail = max(ends_and_tails, default=(rollout_end, 0.0))
    # each worker finishes earlier by what SD saves in its tail, tail x (1 - 1/s); time after the slowest stays
    projected_end = max((end - tail * (1.0 - 1.0 / sd_speedup) for end, tail in ends_and_tails), default=rollout_end)
    capacity = records.world_size * rollout_seconds
    return StepProfile(
        step=step_record.step,
        rollout_seconds=rollout_seconds,
        step_seconds=step_record.step_seconds,
        under_half_busy_seconds=under_half,
        under_half_busy_share=under_half / rollout_seconds if rollout_seconds else 0.0,
        some_idle_share=some_idle / rollout_seconds if rollout_seconds else 0.0,
        idle_worker_seconds=idle_worker_seconds,
        idle_fraction=idle_worker_seconds / capacity if capacity else 0.0,
        tail_seconds=slowest_tail,
        projected_rollout_seconds=rollout_seconds - (slowest_end - projected_end),
        memory_peak_gb=step_record.memory_peak_gb,
        mismatch=step_record.mismatch,
    )


def _time_below(busy: list[Segment], start: float, end: float, threshold: float) -> float:
    """Seconds in [start, end] where fewer than `threshold` workers are busy (a sweep over segment edges)."""
    edges = sorted(
        {start, end, *(time for segment in busy for time in (segment.start, segment.end) if start < time < end)}
    )
    below = 0.0
    for left, right in zip(edges, edges[1:]):
        middle = (left + right) / 2
        busy_workers = len({segment.worker for segment in busy if segment.start <= middle < segment.end})
        if busy_workers < threshold:
            below += right - left
    return below


def _weighted_share(steps: list[StepProfile], name: str) -> float:
    """A per-step share of rollout time, over the whole run (weighted by each step's rollout seconds)."""
    rollout_seconds = sum(step.rollout_seconds for step in steps)
    return (
        sum(getattr(step, name) * step.rollout_seconds for step in steps) / rollout_seconds if rollout_seconds else 0.0
    )


def _total_step_seconds(steps: list[StepProfile]) -> float | None:
    if any(step.step_seconds is None for step in steps):
        return None
    return sum(step.step_seconds for step in steps)


def _length_stats(lengths: list[int]) -> LengthStats:
    values = numpy.asarray(lengths, dtype=float)
    p50, p90, p99 = (float(numpy.percentile(values, q)) for q in (50, 90, 99))
    return LengthStats(
        count=len(lengths),
        p50=p50,
        p90=p90,
        p99=p99,
        max=float(values.max()),
        tail_ratio=p99 / p50 if p50 > 0 else None,
    )


def _accept_length(requests: list[RequestRecord]) -> float | None:
    verify_passes = sum(request.verify_passes for request in requests)
    return accept_length(sum(request.accepted_tokens for request in requests), verify_passes)


def _accept_by_depth(requests: list[RequestRecord]) -> list[DepthAcceptance]:
    depth_count = max((len(request.proposed_by_depth) for request in requests), default=0)
    proposed, accepted = numpy.zeros(depth_count, dtype=int), numpy.zeros(depth_count, dtype=int)
    for request in requests:
        proposed[: len(request.proposed_by_depth)] += numpy.asarray(request.proposed_by_depth, dtype=int)
        accepted[: len(request.accepted_by_depth)] += numpy.asarray(request.accepted_by_depth[:depth_count], dtype=int)
    verify_passes = sum(request.verify_passes for request in requests)
    return [
        DepthAcceptance(
            depth=depth + 1,
            proposed=int(proposed[depth]),
            accepted=int(accepted[depth]),
            rate=float(accepted[depth] / proposed[depth]) if proposed[depth] else 0.0,
            accept_length_share=float(accepted[depth] / verify_passes) if verify_passes else 0.0,
        )
        for depth in range(depth_count)
    ]


def _sd_time(records: ProfileRecords) -> list[ConfigTime]:
    by_config: dict[str, list[SdConfigRecord]] = {}
    for record in records.sd_configs:
        by_config.setdefault(record.config, []).append(record)
    all_seconds = sum(record.seconds for record in records.sd_configs)
    return [
        _config_time(config, by_config[config], all_seconds)
        for config in sorted(by_config, key=lambda config: (config != SD_OFF_LABEL, config))
    ]


def _config_time(config: str, records: list[SdConfigRecord], all_seconds: float) -> ConfigTime:
    """One configuration's time, tokens per second (measured and predicted) and batch sizes over `records`."""
    seconds = sum(record.seconds for record in records)
    tokens = sum(record.tokens for record in records)
    predicted_seconds = sum(record.predicted_seconds for record in records)
    sizes = [size for record in records for size in record.batch_sizes]
    return ConfigTime(
        config,
        seconds,
        sum(record.decode_steps for record in records),
        seconds / all_seconds if all_seconds else 0.0,
        source_accept_lengths(_source_counts(records)),
        tokens / seconds if tokens and seconds > 0 else None,
        sum(record.predicted_tokens for record in records) / predicted_seconds if predicted_seconds > 0 else None,
        (min(sizes), max(sizes)) if sizes else None,
    )


def _source_counts(records: list[SdConfigRecord]) -> dict[str, int]:
    """The per-source verify passes and accepted tokens of `records`, summed."""
    totals: dict[str, int] = {}
    for record in records:
        for name, count in record.source_counts.items():
            totals[name] = totals.get(name, 0) + count
    return totals


def _sd_effect(records: ProfileRecords) -> SdEffect | None:
    """SD against the run's own plain decode steps (tlt_cli/sd_effect.py, as the run summary measures it)."""
    timings = [
        RowsTiming(
            record.config, record.step, rows, steps, record.batch_seconds[rows], record.batch_tokens.get(rows, 0)
        )
        for record in records.sd_configs
        for rows, steps in record.batch_sizes.items()
        if rows in record.batch_seconds
    ]
    accepted = sum(request.accepted_tokens for request in records.requests)
    return measured_sd_effect(timings, accepted, sum(request.verify_passes for request in records.requests))


def _sd_speedup(effect: SdEffect | None, given: float | None) -> tuple[float, str]:
    """(s, where it comes from): given, measured from sd_config records, or assumed."""
    if given is not None:
        return given, "given with --sd-speedup"
    if effect is not None:
        if effect.speedup >= 1.0:
            return effect.speedup, (
                f"measured: SD's steps against this run's plain steps at the same batch sizes (accept length "
                f"{effect.accept_length:.2f})"
            )
        return 1.0, f"measured {effect.speedup:.2f} (SD slower than plain decoding), so no gain is projected"
    return ASSUMED_SD_SPEEDUP, "assumed: the input has no SD measurement (set --sd-speedup)"


def _projection(
    steps: list[StepProfile], tail_batch: int, sd_speedup: float, source: str, already_sd: bool
) -> Projection:
    rollout_seconds = sum(step.rollout_seconds for step in steps)
    projected_rollout = sum(step.projected_rollout_seconds for step in steps)
    reclaimable = rollout_seconds - projected_rollout
    step_seconds = _total_step_seconds(steps)
    if step_seconds:
        speedup_of, rollout_share = "step", rollout_seconds / step_seconds
        # Amdahl: only the rollout part of the step shrinks
        projected_speedup = step_seconds / (step_seconds - reclaimable)
        scope = f"the rest of the step is unchanged (Amdahl over the rollout share, {rollout_share:.0%} of step time)"
    else:
        speedup_of, rollout_share = "rollout", None
        projected_speedup = rollout_seconds / projected_rollout if projected_rollout else 1.0
        scope = "speedup of rollout time only (the input has no step timings)"
    model = (
        f"tail decode (a worker with 1-{tail_batch} requests in flight) sped up {sd_speedup:.2f}x by SD ({source}); "
        f"each step's rollout ends with its slowest worker; {scope}."
    )
    if already_sd:
        model += " The input already ran SD in part of its tail, so this overstates the remaining gain."
    return Projection(
        model=model,
        tail_batch=tail_batch,
        sd_speedup=sd_speedup,
        sd_speedup_source=source,
        speedup_of=speedup_of,
        rollout_share=rollout_share,
        reclaimable_seconds=reclaimable,
        projected_speedup=projected_speedup,
    )
