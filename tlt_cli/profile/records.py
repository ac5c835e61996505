"""Read what `tlt profile` analyses: a tlt trace, a run directory, or per-request records from any trainer.

`load_records(path)` accepts
  - a run directory (its `trace.jsonl`) or a tlt trace file: request, worker, step, sd_config and
    warning records (docs/running.md, "The run directory"); unknown record types are skipped;
  - a CSV file or a JSONL file of plain objects, one per generated response, with the columns
    `step, worker, start, end, tokens` (times in seconds, any origin) and optionally
    `verify_passes, accepted_tokens`: the worker and step timelines are then derived from the
    requests (a worker is busy from its first request's start to its last request's end).
Every problem a user can cause is a `ProfileInputError` naming the file and the line (a byte that
is not UTF-8, a number that is NaN or infinite, a trace without request records). A step of a
trace whose step record is missing (the run was still going, or was killed) is left out with a
warning. The CLI and `tlt_cli.profile.analysis` call this module.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tlt_cli.errors import UserError
from tlt_cli.speculative.types import DRAFT_SOURCES
from tlt_cli.trace import numbered_records, utf8_text
from tlt_cli.tuning.precision import PrecisionChoice

TRACE_FILE = "trace.jsonl"
REQUIRED_REQUEST_FIELDS = ("step", "worker", "start", "end", "tokens")
# a record's counts (steps, workers, tokens, passes) are whole numbers in [0, MAX_COUNT]; its times (seconds of any
# origin, milliseconds) within +-MAX_TIME, so no sum or span of them overflows a float; a per-depth list holds at most
# MAX_DEPTHS counts (a draft is never that deep; a list of a million would take minutes to analyse)
MAX_COUNT = 10**12
MAX_TIME = 1e12
MAX_DEPTHS = 1024


class ProfileInputError(UserError):
    """Input `tlt profile` cannot read; the message names the file, the line and what to fix."""


@dataclass(frozen=True)
class PrecisionSegment:
    """What one start or resume of a run (one run record) ran in, from its first step on: per worker the dtype its
    rollout decoded in and the figures that chose it (older traces: {}), and the actor's precision and why (None
    where the trace does not say)."""

    first_step: int
    rollout: dict[str, PrecisionChoice]
    actor: str | None = None


@dataclass(frozen=True)
class RequestRecord:
    """One generated response: which step and worker, when it ran (seconds) and how long it is."""

    step: int
    worker: int
    start: float
    end: float
    tokens: int
    verify_passes: int = 0
    # draft tokens accepted (not counting the bonus token of each verify pass)
    accepted_tokens: int = 0
    # accepted_by_depth[d] / proposed_by_depth[d]: verify passes whose depth-d draft was accepted / drafted
    accepted_by_depth: tuple[int, ...] = ()
    proposed_by_depth: tuple[int, ...] = ()


@dataclass(frozen=True)
class WorkerRecord:
    """One worker in one step: busy on its shard, then idle until the step's rollout ends."""

    step: int
    worker: int
    busy_start: float
    busy_end: float
    idle_end: float
    drafter_steps: int = 0
    drafter_train_seconds: float = 0.0


@dataclass(frozen=True)
class RolloutMismatch:
    """A step's rollout/learner mismatch (tlt_cli/training/rollout_correction.py): K3 KL(pi_rollout || pi_old)
    over response tokens, and the importance weights pi_old / pi_rollout before truncation: mean, min, max and
    the share above the cap."""

    kl_k3: float
    weight_mean: float
    weight_min: float
    weight_max: float
    weight_truncated: float


# RolloutMismatch field -> the step record's key (the actor's update metrics carry the actor_ prefix)
MISMATCH_KEYS = {item: f"actor_rollout_{item}" for item in RolloutMismatch.__dataclass_fields__}


@dataclass(frozen=True)
class StepRecord:
    """One step's rollout window; step_seconds is None when the input has no step timings."""

    step: int
    rollout_start: float
    rollout_end: float
    step_seconds: float | None = None
    # the highest worker's resident peak in the step, GB (traces before issue 29: None)
    memory_peak_gb: float | None = None
    # None: the trainer measured none (a recorded rollout, a backend without log-probs, traces before issue 34)
    mismatch: RolloutMismatch | None = None


@dataclass(frozen=True)
class SdConfigRecord:
    """Time one worker spent decoding with one SD configuration ("off", or a label like s4-k1-t5)."""

    step: int
    worker: int
    config: str
    seconds: float
    decode_steps: int
    # <source>_verify_passes and <source>_accepted_tokens per draft source (older traces: none)
    source_counts: dict[str, int] = field(default_factory=dict)
    # response tokens emitted; mode auto's predicted tokens and seconds for the same steps (0: not predicted, or an
    # older trace); running batch size -> decode steps, and their seconds and tokens (older traces: none)
    tokens: int = 0
    predicted_tokens: float = 0.0
    predicted_seconds: float = 0.0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    batch_seconds: dict[int, float] = field(default_factory=dict)
    batch_tokens: dict[int, int] = field(default_factory=dict)


@dataclass
class ProfileRecords:
    """Everything read from one input, sorted by step then worker."""

    source: str
    # "trace", "csv", "jsonl" (plain per-request records) or "recipe" (a fresh recorded rollout)
    kind: str
    world_size: int
    requests: list[RequestRecord]
    workers: list[WorkerRecord]
    steps: list[StepRecord]
    sd_configs: list[SdConfigRecord] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # per start and resume of the run (each writes a run record): its precisions, oldest first
    precision_segments: list[PrecisionSegment] = field(default_factory=list)


def load_records(path: Path) -> ProfileRecords:
    """Read a run directory, a tlt trace, or a CSV/JSONL of per-request records (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        trace = path / TRACE_FILE
        if not trace.is_file():
            raise ProfileInputError(
                f"{path} has no {TRACE_FILE}; pass a run directory, a trace file, a CSV/JSONL of requests or a recipe."
            )
        return read_trace_records(trace)
    if not path.is_file():
        raise ProfileInputError(
            f"{path} does not exist; pass a run directory, a trace file, a CSV/JSONL of requests or a recipe."
        )
    if path.suffix.lower() == ".csv":
        return records_from_requests(str(path), "csv", list(_csv_requests(path)))
    if path.suffix.lower() in (".jsonl", ".json"):
        lines = list(numbered_records(path, ProfileInputError))
        if lines and "type" in lines[0][1]:
            return _trace_records(path, lines)
        return records_from_requests(
            str(path), "jsonl", [_plain_request(record, f"{path} line {number}") for number, record in lines]
        )
    raise ProfileInputError(f"{path} is neither a directory, a .jsonl trace or record file, nor a .csv file.")


def read_trace_records(path: Path) -> ProfileRecords:
    """The records of a tlt trace file."""
    return _trace_records(path, list(numbered_records(path, ProfileInputError)))


def _trace_records(path: Path, lines: list[tuple[int, dict[str, Any]]]) -> ProfileRecords:
    requests, workers, steps, sd_configs, warnings = [], [], [], [], []
    world_size, segments = 0, []
    for number, record in lines:
        where = f"{path} line {number}"
        kind = record.get("type")
        if kind == "run":
            world_size = max(world_size, _number(record, "world_size", int, where, default=0))
            first_step = record.get("resumed_from_step") or 0
            if not isinstance(first_step, int):
                raise ProfileInputError(f"{where}: 'resumed_from_step' must be a step number or null.")
            segments.append(
                PrecisionSegment(first_step, _precision_records(record, where), _actor_precision(record, where))
            )
        elif kind == "request":
            requests.append(_request(record, where))
        elif kind == "worker":
            workers.append(_worker(record, where))
        elif kind == "step":
            steps.append(_step(record, where))
        elif kind == "sd_config":
            sd_configs.append(_sd_config(record, where))
        elif kind == "warning":
            warnings.append(str(record.get("message", "")))
        elif kind is None:
            raise ProfileInputError(f"{where} has no 'type'; a tlt trace has a type on every line.")
    complete = {record.step for record in steps}
    incomplete = sorted({record.step for record in requests + workers} - complete)
    warnings += [
        f"step {step} has no step record (run still going, or killed mid-step): left out." for step in incomplete
    ]
    records = ProfileRecords(
        source=str(path),
        kind="trace",
        world_size=world_size,
        requests=[record for record in requests if record.step in complete],
        workers=[record for record in workers if record.step in complete],
        steps=steps,
        sd_configs=[record for record in sd_configs if record.step in complete],
        warnings=warnings,
        precision_segments=segments,
    )
    if not records.steps:
        raise ProfileInputError(
            f"{path} has no complete step (no 'step' record); profile a run that finished at least one step."
        )
    if not records.requests:
        raise ProfileInputError(
            f"{path} has no request records in its complete steps (one per generated response), so there is no "
            "rollout to profile; profile the trace of a tlt run, or a CSV/JSONL of requests."
        )
    return _sorted(records)


def records_from_requests(source: str, kind: str, requests: list[RequestRecord]) -> ProfileRecords:
    """Per-request records alone: derive each worker's busy window and each step's rollout window."""
    if not requests:
        raise ProfileInputError(f"{source} holds no request records; give one row per generated response.")
    by_step: dict[int, list[RequestRecord]] = {}
    for request in requests:
        by_step.setdefault(request.step, []).append(request)
    workers, steps = [], []
    for step, step_requests in sorted(by_step.items()):
        rollout_start = min(request.start for request in step_requests)
        rollout_end = max(request.end for request in step_requests)
        steps.append(StepRecord(step, rollout_start, rollout_end))
        for worker in sorted({request.worker for request in step_requests}):
            own = [request for request in step_requests if request.worker == worker]
            workers.append(WorkerRecord(step, worker, min(r.start for r in own), max(r.end for r in own), rollout_end))
    world_size = len({request.worker for request in requests})
    return _sorted(
        ProfileRecords(source=source, kind=kind, world_size=world_size, requests=requests, workers=workers, steps=steps)
    )


def _sorted(records: ProfileRecords) -> ProfileRecords:
    records.requests.sort(key=lambda record: (record.step, record.worker, record.start))
    records.workers.sort(key=lambda record: (record.step, record.worker))
    records.steps.sort(key=lambda record: record.step)
    records.world_size = max(records.world_size, len({record.worker for record in records.workers}), 1)
    return records


def _csv_requests(path: Path) -> Iterator[RequestRecord]:
    with io.StringIO(utf8_text(path, ProfileInputError), newline="") as handle:
        reader = csv.DictReader(handle)
        try:
            columns = [name.strip() for name in reader.fieldnames or []]
        except csv.Error as error:
            raise ProfileInputError(f"{path} line 1 is not a CSV header ({error}).") from None
        missing = [name for name in REQUIRED_REQUEST_FIELDS if name not in columns]
        if missing:
            raise ProfileInputError(
                f"{path} lacks the column(s) {', '.join(missing)}; "
                f"the header must name {', '.join(REQUIRED_REQUEST_FIELDS)}."
            )
        rows = iter(reader)
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except csv.Error as error:  # a field past the csv module's 128 kB limit, a NUL byte
                raise ProfileInputError(f"{path} line {reader.line_num} is not a CSV row ({error}).") from None
            cleaned = {
                key.strip(): value.strip()
                for key, value in row.items()
                if isinstance(key, str) and isinstance(value, str) and value
            }
            yield _plain_request(cleaned, f"{path} line {reader.line_num}")


def _plain_request(record: dict[str, Any], where: str) -> RequestRecord:
    missing = [name for name in REQUIRED_REQUEST_FIELDS if name not in record]
    if missing:
        raise ProfileInputError(
            f"{where} lacks {', '.join(missing)}; every request needs {', '.join(REQUIRED_REQUEST_FIELDS)}."
        )
    return _request(record, where)


def _request(record: dict[str, Any], where: str) -> RequestRecord:
    request = RequestRecord(
        step=_number(record, "step", int, where),
        worker=_number(record, "worker", int, where),
        start=_number(record, "start", float, where),
        end=_number(record, "end", float, where),
        tokens=_number(record, "tokens", int, where),
        verify_passes=_number(record, "verify_passes", int, where, default=0),
        accepted_tokens=_number(record, "accepted_tokens", int, where, default=0),
        accepted_by_depth=_counts(record, "accepted_by_depth", where),
        proposed_by_depth=_counts(record, "proposed_by_depth", where),
    )
    if request.end < request.start:
        raise ProfileInputError(f"{where}: end ({request.end}) is before start ({request.start}).")
    return request


def _worker(record: dict[str, Any], where: str) -> WorkerRecord:
    return WorkerRecord(
        step=_number(record, "step", int, where),
        worker=_number(record, "worker", int, where),
        busy_start=_number(record, "busy_start", float, where),
        busy_end=_number(record, "busy_end", float, where),
        idle_end=_number(record, "idle_end", float, where),
        drafter_steps=_number(record, "drafter_steps", int, where, default=0),
        drafter_train_seconds=_number(record, "drafter_train_seconds", float, where, default=0.0),
    )


def _step(record: dict[str, Any], where: str) -> StepRecord:
    return StepRecord(
        step=_number(record, "step", int, where),
        rollout_start=_number(record, "rollout_start", float, where),
        rollout_end=_number(record, "rollout_end", float, where),
        step_seconds=_number(record, "step_seconds", float, where, default=None),
        memory_peak_gb=_number(record, "memory_peak_gb", float, where, default=None),
        mismatch=_mismatch(record, where),
    )


def _mismatch(record: dict[str, Any], where: str) -> RolloutMismatch | None:
    """The step's RolloutMismatch, or None when the record has no actor_rollout_kl_k3."""
    if record.get(MISMATCH_KEYS["kl_k3"]) is None:
        return None
    return RolloutMismatch(**{item: _number(record, key, float, where) for item, key in MISMATCH_KEYS.items()})


def _sd_config(record: dict[str, Any], where: str) -> SdConfigRecord:
    if not isinstance(record.get("config"), str):
        raise ProfileInputError(
            f'{where}: sd_config record lacks a \'config\' label (a string such as "off" or "s4-k1-t5").'
        )
    return SdConfigRecord(
        step=_number(record, "step", int, where),
        worker=_number(record, "worker", int, where),
        config=record["config"],
        seconds=_number(record, "seconds", float, where),
        decode_steps=_number(record, "decode_steps", int, where, default=0),
        source_counts={
            f"{source}_{count}": _number(record, f"{source}_{count}", int, where, default=0)
            for source in DRAFT_SOURCES
            for count in ("verify_passes", "accepted_tokens")
        },
        tokens=_number(record, "tokens", int, where, default=0),
        predicted_tokens=_number(record, "predicted_tokens", float, where, default=0.0),
        predicted_seconds=_number(record, "predicted_seconds", float, where, default=0.0),
        batch_sizes=_by_batch_size(record, "batch_sizes", int, "decode-step counts", where),
        batch_seconds=_by_batch_size(record, "batch_seconds", float, "seconds", where),
        batch_tokens=_by_batch_size(record, "batch_tokens", int, "token counts", where),
    )


def _by_batch_size(record: dict[str, Any], key: str, kind: type, what: str, where: str) -> dict:
    """The record's running batch size -> a count or seconds under `key` (absent in older traces)."""
    values = record.get(key, {})
    kinds = (int, float) if kind is float else (int,)
    if not isinstance(values, dict) or not all(
        str(size).isdigit() and isinstance(value, kinds) and not isinstance(value, bool) and value >= 0
        for size, value in values.items()
    ):
        raise ProfileInputError(f"{where}: '{key}' must map running batch sizes to {what}.")
    return {int(size): kind(value) for size, value in values.items()}


def _actor_precision(record: dict[str, Any], where: str) -> str | None:
    """The run record's `actor_precision` as one line (tlt_cli/training/update_precision.py), or None."""
    actor = record.get("actor_precision")
    if actor is None:
        return None
    if not isinstance(actor, dict) or not all(isinstance(actor.get(key), str) for key in ("precision", "reason")):
        raise ProfileInputError(f"{where}: 'actor_precision' must hold 'precision' and 'reason' texts.")
    return f"actor precision {actor['precision']} ({actor['reason']})"


def _precision_records(record: dict[str, Any], where: str) -> dict[str, PrecisionChoice]:
    """The run record's `rollout_precision` (worker -> PrecisionChoice record), each field checked."""
    by_worker = record.get("rollout_precision", {})
    if not isinstance(by_worker, dict):
        raise ProfileInputError(f"{where}: 'rollout_precision' is not an object of workers.")
    choices = {}
    for worker, choice in by_worker.items():
        inside = f"{where}, rollout_precision of worker {worker}"
        if not isinstance(choice, dict) or not all(isinstance(choice.get(key), str) for key in ("dtype", "reason")):
            raise ProfileInputError(f"{inside}: expected 'dtype' and 'reason' texts.")
        # batch_step_ms, rows and speculates came with the workload-weighed choice; older traces lack them
        figures = {name: choice.get(name) or {} for name in ("step_ms", "verify_ms", "batch_step_ms")}
        if not all(isinstance(values, dict) for values in figures.values()):
            raise ProfileInputError(
                f"{inside}: 'step_ms', 'batch_step_ms' and 'verify_ms' must be objects of milliseconds by dtype."
            )
        figures = {
            name: {dtype: _number(values, dtype, float, f"{inside}, {name}") for dtype in values}
            for name, values in figures.items()
        }
        tail = choice.get("tail_step_ms") or {}  # the plain steps between one row and `rows`: newer traces only
        if not isinstance(tail, dict) or not all(isinstance(values, dict) for values in tail.values()):
            raise ProfileInputError(f"{inside}: 'tail_step_ms' must be an object of rows to milliseconds by dtype.")
        figures["tail_step_ms"] = {
            str(rung): {dtype: _number(values, dtype, float, f"{inside}, tail_step_ms {rung}") for dtype in values}
            for rung, values in tail.items()
        }
        rows = _number(choice, "rows", int, inside, default=1)
        speculates = choice.get("speculates", False)
        if rows < 1 or not isinstance(speculates, bool):
            raise ProfileInputError(f"{inside}: 'rows' must be a positive count and 'speculates' true or false.")
        choices[str(worker)] = PrecisionChoice(
            choice["dtype"], choice["reason"], rows=rows, speculates=speculates, **figures
        )
    return choices


_MISSING = object()


def _number(record: dict[str, Any], name: str, kind: type, where: str, default: Any = _MISSING) -> Any:
    """record[name] as `kind` (from a JSON number or a CSV string); a clear error when absent, not a number,
    or not finite (NaN and Infinity parse as numbers in JSON and CSV alike, and would poison every sum)."""
    value = record.get(name)
    if value is None:
        if default is _MISSING:
            raise ProfileInputError(f"{where} lacks '{name}'.")
        return default
    try:
        if isinstance(value, bool):
            raise ValueError
        number = float(value)
        if not math.isfinite(number) or (kind is int and not number.is_integer()):
            raise ValueError
        if not (0 <= number <= MAX_COUNT if kind is int else abs(number) <= MAX_TIME):
            raise ValueError
        return kind(number)
    except (TypeError, ValueError, OverflowError):
        expected = f"an integer from 0 to {MAX_COUNT}" if kind is int else f"a finite number within +-{MAX_TIME:g}"
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise ProfileInputError(f"{where}: '{name}' is {shown}, expected {expected}.") from None


def _counts(record: dict[str, Any], name: str, where: str) -> tuple[int, ...]:
    values = record.get(name)
    if values is None:
        return ()
    if (
        not isinstance(values, list)
        or len(values) > MAX_DEPTHS
        or not all(
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT for value in values
        )
    ):
        shown = repr(values) if len(repr(values)) <= 40 else repr(values)[:40] + "..."
        raise ProfileInputError(
            f"{where}: '{name}' is {shown}, expected a list of at most {MAX_DEPTHS} counts from 0 to {MAX_COUNT} (one "
            "per draft depth)."
        )
    return tuple(values)
