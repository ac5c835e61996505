"""The driver of `tlt train`: prepares the run directory, spawns the workers, writes the trace.

`train(recipe, ...)` is what the CLI calls. It builds the model cache once (so workers do not
race to build it), starts one process per worker (a DeepSpeed rank each, see tlt_cli/worker.py), then
turns their per-step reports into trace records and the live display. Without
`workers.hostfile` it spawns the workers itself (local_workers.py); with one, it runs
them on the hostfile's nodes with the DeepSpeed launcher and receives their reports over TCP
(launched_workers.py); the loop here is the same for both. If any worker fails, the
others are stopped and a `TrainingFailed` names the worker and its error; the run directory
keeps every complete checkpoint for `--resume`.

Before anything starts, `check_machine` makes sure this machine has what the recipe asks for
(GPUs for `actor.devices`, SGLang for `rollout.backend: sglang`). Workers start with only the
actor's GPUs visible. With SGLang each worker owns its servers; whatever way the run ends
(finished, Ctrl-C, a failure, a worker killed), the driver finally stops every server process
group the workers recorded in the run directory, so none is left behind (on this machine: with a
hostfile of several nodes each worker stops its own, and DeepSpeed ends the ranks' process trees).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tlt_cli.checkpoint import latest_checkpoint
from tlt_cli.config import CPU_DEVICES, Recipe, recipe_to_yaml
from tlt_cli.display import PhaseProgress, TrainingDisplay, render_summary
from tlt_cli.drafter.initial import prepare_initial_drafter
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.processes.hostfile import runs_on_this_machine
from tlt_cli.processes.launched_workers import LaunchedWorkers
from tlt_cli.processes.local_workers import LocalWorkers
from tlt_cli.processes.machine_checks import check_machine
from tlt_cli.processes.step_records import step_records
from tlt_cli.sglang.registry import stop_recorded_servers
from tlt_cli.trace import TraceWriter, read_trace, truncate_trace
from tlt_cli.worker import WorkerFailed, WorkerFinished, WorkerStepReport

EVENT_POLL_SECONDS = 1.0
RECIPE_FILE = "recipe.yaml"
TRACE_FILE = "trace.jsonl"


class TrainingFailed(RuntimeError):
    """The run stopped because a worker failed; the message names it."""


class RunDirectoryError(ValueError):
    """A run directory that cannot be used as asked (exists already, or is not a run)."""


class WorkerGroup(Protocol):
    """The running workers as the driver loop sees them (LocalWorkers or LaunchedWorkers)."""

    size: int

    def next_event(self, timeout: float) -> Any: ...

    def failure(self, finished: set[int]) -> str | None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class RunSummary:
    run_directory: Path
    steps: list[dict[str, Any]]


def cache_directory(recipe: Recipe) -> Path:
    """Where built models and compiled DeepSpeed ops are cached (model.cache_dir or the default)."""
    return Path(recipe.model.cache_dir).expanduser() if recipe.model.cache_dir else default_cache_dir()


def new_run_directory(recipe: Recipe) -> Path:
    """runs/<name>/ for a fresh run; refuses to reuse one that holds a run."""
    run_directory = Path(recipe.run.output_dir) / recipe.run.name
    if (run_directory / TRACE_FILE).exists() or (run_directory / "checkpoints").exists():
        raise RunDirectoryError(
            f"run directory {run_directory} already holds a run; resume it with --resume {run_directory} "
            f"or choose another name with run.name=<name>.")
    run_directory.mkdir(parents=True, exist_ok=True)
    (run_directory / RECIPE_FILE).write_text(recipe_to_yaml(recipe), encoding="utf-8")
    return run_directory


def train(recipe: Recipe, run_directory: Path, console: Console, resume: bool = False) -> RunSummary:
    """Run (or resume) the GRPO loop with recipe.workers.count worker processes."""
    resume_from, start_step = _resume_point(run_directory) if resume else (None, 0)
    check_machine(recipe)
    cache = cache_directory(recipe)
    drafter_init = _prepare_drafter(recipe, cache, console)
    trace_path = run_directory / TRACE_FILE
    if resume:
        truncate_trace(trace_path, start_step)
    trace = TraceWriter(trace_path)
    trace.write({"type": "run", "name": recipe.run.name, "world_size": recipe.workers.count,
                 "resumed_from_step": start_step if resume else None, "steps": recipe.train.steps})
    spec_base = dict(recipe=recipe, run_directory=run_directory, model_cache=cache, resume_from=resume_from,
                     start_step=start_step, drafter_init=drafter_init)
    try:
        with TrainingDisplay(console, f"tlt train {recipe.run.name}", recipe.train.steps) as display:
            _run_workers(spec_base, trace, display)
    finally:
        trace.close()
    steps = [record for record in read_trace(trace_path) if record["type"] == "step"]
    render_summary(console, steps, run_directory)
    return RunSummary(run_directory, steps)


def _prepare_drafter(recipe: Recipe, cache: Path, console: Console) -> Path | None:
    console.print("preparing the drafter (an offline warm-up runs once per model and task, then is cached)")
    with PhaseProgress(console, "drafter warm-up") as progress:
        folder, report = prepare_initial_drafter(recipe, cache, progress)
    if report is not None:
        console.print(f"drafter warmed up offline: top-1 agreement with the target {report['held_out_accuracy']:.1%} "
                      f"(from {report['held_out_accuracy_before']:.1%}), cached in {folder}")
    return folder


def _resume_point(run_directory: Path) -> tuple[Path, int]:
    checkpoint, state = latest_checkpoint(run_directory)
    return checkpoint, int(state["next_step"])


def _run_workers(spec_base: dict[str, Any], trace: TraceWriter, display: TrainingDisplay) -> None:
    recipe: Recipe = spec_base["recipe"]
    workers = _start_workers(spec_base)
    try:
        _drain_events(workers, trace, display)
    finally:
        workers.stop()
        if recipe.workers.hostfile is None or runs_on_this_machine(recipe):
            stop_recorded_servers(spec_base["run_directory"], recipe.rollout.sglang.stop_timeout_s)


def _start_workers(spec_base: dict[str, Any]) -> WorkerGroup:
    """Spawned on this machine, or started on the hostfile's nodes by the DeepSpeed launcher."""
    recipe: Recipe = spec_base["recipe"]
    if recipe.workers.hostfile is not None:
        return LaunchedWorkers(spec_base)
    gpus = [] if recipe.actor.devices == CPU_DEVICES else recipe.actor.devices
    return LocalWorkers(spec_base, recipe.workers.count, gpus)


def _drain_events(workers: WorkerGroup, trace: TraceWriter, display: TrainingDisplay) -> None:
    pending: dict[int, list[WorkerStepReport]] = {}
    finished: set[int] = set()
    while len(finished) < workers.size:
        event = workers.next_event(EVENT_POLL_SECONDS)
        if event is None:
            failure = workers.failure(finished)
            if failure is not None:
                raise TrainingFailed(failure)
            continue
        if isinstance(event, WorkerFailed):
            raise TrainingFailed(_failure_message(event))
        if isinstance(event, WorkerFinished):
            finished.add(event.worker)
            continue
        reports = pending.setdefault(event.step, [])
        reports.append(event)
        if len(reports) == workers.size:
            _record_step(pending.pop(event.step), trace, display)


def _failure_message(event: WorkerFailed) -> str:
    """One line naming the worker and its error; lines the error carries (a server's log tail) follow on their own."""
    first_line, _, more = event.message.partition("\n")
    return f"worker {event.worker} failed: {first_line}" + (f"\n{more}\n" if more else "")


def _record_step(reports: list[WorkerStepReport], trace: TraceWriter, display: TrainingDisplay) -> None:
    records = step_records(reports)
    for record in records:
        trace.write(record)
    display.add_step(records[-1])
    for report in reports:
        for warning in report.sd_warnings:
            _warn(report, f"worker {report.worker}: {warning}", trace, display)
        for failure in report.plugin_failures:
            _warn(report, f"plugin {failure['plugin']} disabled on worker {report.worker}: {failure['hook']} raised "
                          f"{failure['message']}", trace, display, details=failure["details"])
    checkpoint = next((report.checkpoint for report in reports if report.checkpoint), None)
    if checkpoint:
        display.note(f"checkpoint saved: {checkpoint}")


def _warn(report: WorkerStepReport, message: str, trace: TraceWriter, display: TrainingDisplay,
          details: str | None = None) -> None:
    """A warning shown once under the live table and kept in the trace."""
    record = {"type": "warning", "step": report.step, "worker": report.worker, "message": message}
    trace.write(record if details is None else {**record, "details": details})
    display.note(message)
