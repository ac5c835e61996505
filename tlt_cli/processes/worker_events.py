"""The driver's event loop: the running workers' reports turned into trace records, and the failure named.

`run_workers` starts the workers (local_workers.py, or launched_workers.py with a hostfile) and drains their
events (messages.py): what a starting rank waits on is shown before the first step, progress feeds the step
deadline (step_deadline.py), a step's reports from every worker
become its trace records and display row (step_records.py), warnings go under the live table and into the
trace. A failure ends the loop with the error naming the worker that failed first (`first_failure`: a worker
killed without a word before its peers failed in their collectives, else the earliest raised). Whatever way
it ends, the workers are stopped and the SGLang servers they recorded in the run directory too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Protocol

from tlt_cli.config import CPU_DEVICES
from tlt_cli.display import TrainingDisplay
from tlt_cli.processes.fidelity_guard import FidelityGuard, fidelity_advice, rounding_ceiling
from tlt_cli.processes.hostfile import runs_on_this_machine
from tlt_cli.processes.launched_workers import LaunchedWorkers
from tlt_cli.processes.local_workers import LocalWorkers
from tlt_cli.processes.messages import (
    RunSpec,
    WorkerBody,
    WorkerFailed,
    WorkerFinished,
    WorkerProgress,
    WorkerStarting,
    WorkerStepReport,
)
from tlt_cli.processes.op_build import EXTENSIONS_FOLDER, op_built
from tlt_cli.processes.run_directory import TRACE_FILE
from tlt_cli.processes.run_failures import RunDiverged, TrainingFailed, WorkerInputError
from tlt_cli.processes.run_trace import RunTrace
from tlt_cli.processes.step_deadline import StepDeadline
from tlt_cli.processes.step_records import step_records
from tlt_cli.sglang.registry import stop_recorded_servers
from tlt_cli.trace import lenient_record

EVENT_POLL_SECONDS = 1.0
# seconds the driver waits, after a worker reported a failure, for a peer's report or death that came first
FOLLOW_ON_SECONDS = 2.0
SETTLE_POLL_SECONDS = 0.1
# what one pass of the event loop may take besides its wait (a step record, the display) before it counts as a pause
PROCESSING_SLACK_SECONDS = 1.0


class WorkerGroup(Protocol):
    """The running workers as the driver loop sees them (LocalWorkers or LaunchedWorkers)."""

    size: int

    def next_event(self, timeout: float) -> Any: ...

    def failure(self, finished: set[int]) -> str | None: ...

    def ended_without_report(self, accounted: set[int]) -> str | None: ...

    def stop(self) -> None: ...


def run_workers(run_spec: RunSpec, body: WorkerBody, trace: RunTrace, display: TrainingDisplay) -> None:
    recipe = run_spec.recipe
    display.progress(starting_sentence(recipe.workers.count, run_spec.model_cache / EXTENSIONS_FOLDER))
    workers = _start_workers(run_spec, body)
    guard = _fidelity_guard(run_spec)
    try:
        _drain_events(workers, trace, display, StepDeadline(recipe.workers.step_timeout_s), guard)
    finally:
        workers.stop()
        if recipe.workers.hostfile is None or runs_on_this_machine(recipe):
            stop_recorded_servers(run_spec.run_directory, recipe.rollout.sglang.stop_timeout_s)


def starting_sentence(count: int, extensions_directory: Path) -> str:
    """The line before the workers start: the op build is named only when the cache lacks the built op."""
    if op_built(extensions_directory):
        return f"starting {count} worker(s): each loads the model"
    return f"starting {count} worker(s): each loads the model, and DeepSpeed builds its ops first (minutes, once)"


def _start_workers(run_spec: RunSpec, body: WorkerBody) -> WorkerGroup:
    """`body` in each process: spawned on this machine, or started on the hostfile's nodes by the DeepSpeed launcher."""
    recipe = run_spec.recipe
    if recipe.workers.hostfile is not None:
        return LaunchedWorkers(run_spec, body)
    gpus = [] if recipe.actor.devices == CPU_DEVICES else recipe.actor.devices
    return LocalWorkers(run_spec, recipe.workers.count, gpus, body)


def _fidelity_guard(run_spec: RunSpec) -> FidelityGuard:
    """The run's fidelity guard, its baselines and earlier warnings from the trace's records before a resume (read
    leniently, as a resume reads the trace: a damaged line is dropped, the rest kept)."""
    decode = run_spec.plan.decode if run_spec.plan is not None else None
    earlier = []
    path = run_spec.run_directory / TRACE_FILE
    if run_spec.start_step > 0 and path.is_file():
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            lines = []
        records = [record for record in map(lenient_record, lines) if record is not None]
        earlier = [
            record
            for record in records
            if record["type"] in ("step", "warning") and record.get("step", 0) < run_spec.start_step
        ]
    rollout_dtype = decode.dtype if decode is not None else "float32"
    advice = fidelity_advice(run_spec.recipe, rollout_dtype)
    return FidelityGuard(advice, earlier, rounding_ceiling(run_spec.recipe, rollout_dtype))


def _drain_events(
    workers: WorkerGroup, trace: RunTrace, display: TrainingDisplay, deadline: StepDeadline, guard: FidelityGuard
) -> None:
    pending: dict[int, list[WorkerStepReport]] = {}
    finished: set[int] = set()
    activity: str | None = None
    while len(finished) < workers.size:
        display.before_first_step(activity)
        event = workers.next_event(EVENT_POLL_SECONDS)
        # the pause of a stopped driver is no rank's; reports that arrived meanwhile are read before any verdict
        deadline.watch(EVENT_POLL_SECONDS + PROCESSING_SLACK_SECONDS)
        failure = workers.failure(finished) if event is None else None
        stuck = deadline.overrun() if event is None else None
        if failure is not None or stuck is not None:
            raise TrainingFailed(failure or stuck)
        if event is None:
            continue
        if isinstance(event, WorkerProgress):
            deadline.progress(event)
            activity = f"worker {event.worker} at step {event.step}: {event.activity}"
            continue
        if isinstance(event, WorkerStarting):
            activity = f"worker {event.worker}: {event.activity}"
            continue
        if isinstance(event, WorkerFailed):
            raise _first_failure(workers, event, finished)
        if isinstance(event, WorkerFinished):
            finished.add(event.worker)
            continue
        deadline.reported(event)
        reports = pending.setdefault(event.step, [])
        reports.append(event)
        if len(reports) == workers.size:
            _record_step(pending.pop(event.step), trace, display, guard)


def _first_failure(workers: WorkerGroup, first_report: WorkerFailed, finished: set[int]) -> Exception:
    """The error naming the worker that failed first, once the others' follow-on failures had FOLLOW_ON_SECONDS
    to arrive: a worker that died without a word (killed: its peers then fail in their collectives), else the
    earliest raised of the reports. The other reports go to the run's log with the cause's traceback."""
    reports = _reports_within(workers, [first_report], finished, FOLLOW_ON_SECONDS)
    died = workers.ended_without_report(finished | {report.worker for report in reports})
    follow_on = "\n".join(
        f"then worker {report.worker} failed: {report.message}\n{report.details}" for report in reports
    )
    if died is not None:
        return TrainingFailed(died, follow_on)
    cause = min(reports, key=lambda report: report.failed_at)
    others = [report for report in reports if report is not cause]
    details = "\n".join([cause.details, *(f"then worker {other.worker} failed: {other.message}" for other in others)])
    if cause.user_error:
        return WorkerInputError(cause.message, details)
    if cause.diverged:
        return RunDiverged(f"worker {cause.worker}: {cause.message}", details)
    return TrainingFailed(_failure_message(cause), details)


def _reports_within(
    workers: WorkerGroup, reports: list[WorkerFailed], finished: set[int], seconds: float
) -> list[WorkerFailed]:
    """`reports` and the failures reported within `seconds`, or until every worker has finished, reported or died."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not _all_accounted(workers, reports, finished):
        event = workers.next_event(SETTLE_POLL_SECONDS)
        if isinstance(event, WorkerFailed):
            reports.append(event)
    return reports


def _all_accounted(workers: WorkerGroup, reports: list[WorkerFailed], finished: set[int]) -> bool:
    accounted = finished | {report.worker for report in reports}
    return len(accounted) == workers.size or workers.failure(accounted) is not None


def _failure_message(event: WorkerFailed) -> str:
    """One line naming the worker and its error; lines the error carries (a server's log tail) follow on their own."""
    first_line, _, more = event.message.partition("\n")
    return f"worker {event.worker} failed: {first_line}" + (f"\n{more}\n" if more else "")


def _record_step(
    reports: list[WorkerStepReport], trace: RunTrace, display: TrainingDisplay, guard: FidelityGuard
) -> None:
    records = step_records(reports)
    for record in records:
        trace.write(record)
    display.add_step(records[-1])
    for figure, message in guard.check_figures(records[-1]).items():
        step = records[-1]["step"]
        trace.write({"type": "warning", "kind": "fidelity", "figure": figure, "step": step, "message": message})
        display.note(message)
    if reports[0].drafter_divergence_message is not None:  # every rank says the same line: show it once
        _warn(reports[0], reports[0].drafter_divergence_message, trace, display)
    for report in reports:
        for warning in report.sd_warnings + report.memory_warnings:
            _warn(report, f"worker {report.worker}: {warning}", trace, display)
        for failure in report.plugin_failures:
            _warn(
                report,
                f"plugin {failure['plugin']} disabled on worker {report.worker}: {failure['hook']} raised "
                f"{failure['message']}",
                trace,
                display,
                details=failure["details"],
            )
    checkpoint = next((report.checkpoint for report in reports if report.checkpoint), None)
    if checkpoint:
        display.note(f"checkpoint saved: {checkpoint}")


def _warn(
    report: WorkerStepReport, message: str, trace: RunTrace, display: TrainingDisplay, details: str | None = None
) -> None:
    """A warning shown once under the live table and kept in the trace."""
    record = {"type": "warning", "step": report.step, "worker": report.worker, "message": message}
    trace.write(record if details is None else {**record, "details": details})
    display.note(message)
