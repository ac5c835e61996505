"""The driver of `tlt train`: prepares the run directory, spawns the workers, writes the trace.

`train(recipe, trainer, ...)` is what the composition root calls (tlt_cli/trainers.py gives
the `TrainerEntry` of the recipe's train.trainer: each process's body, how the starting drafter is
prepared). It prepares the drafter once (so workers do not race to build it), starts one process
per worker (a DeepSpeed rank each, running the trainer's body), then turns their per-step reports
(messages.py) into trace records and the live display. Without
`workers.hostfile` it spawns the workers itself (local_workers.py); with one, it runs
them on the hostfile's nodes with the DeepSpeed launcher and receives their reports over TCP
(launched_workers.py); the loop here is the same for both. If any worker fails, the
others are stopped and a `TrainingFailed` names the first worker to fail and its error (one killed
before its peers failed in their collectives is named with its signal, not they; a `WorkerInputError`,
exit 2, when the error is the user's: a data file, model weights); its traceback goes to the
run's log (`run.log`), the run directory keeps every complete checkpoint for `--resume`.

Before anything is created, the `check_machine` it is handed (tlt_cli/preflight.py's, by
tlt_cli/trainers.py) makes sure this machine has what the recipe asks for (GPUs for `actor.devices`,
SGLang for `rollout.backend: sglang`), the DeepSpeed /dev/shm segments and rendezvous folders a killed
run left are removed (shared_memory.py, distributed.py) and the drafter is prepared; only then is a new
run directory made, locked for the run's life (run_directory.py: a second `tlt train` of it refuses).
A new run that fails before its first step is removed again (only what it made; with `keep_log`, all
but its logs stay), and the trace is opened at the first step, so a resume that fails first leaves the
run's trace and checkpoints as they were. A worker that spends more than `workers.step_timeout_s` in one
step ends the run as a failure does, named (step_deadline.py); SIGTERM ends it as Ctrl-C does
(tlt_cli/cli.py). Workers start with only the actor's GPUs visible. With SGLang each worker owns its
servers; whatever way the run ends (finished, Ctrl-C, a failure, a worker killed), the driver finally
stops every server process group the workers recorded in the run directory, so none is left behind (on
this machine: with a hostfile of several nodes each worker stops its own, and DeepSpeed ends the ranks'
process trees).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

from tlt_cli.atomic_files import write_atomically
from tlt_cli.checkpoint import CheckpointError, next_run_advice, remove_staging
from tlt_cli.config import CPU_DEVICES, Recipe, load_recipe, recipe_to_dict, recipe_to_yaml
from tlt_cli.display import PhaseProgress, TrainingDisplay, render_summary
from tlt_cli.errors import UserError
from tlt_cli.models.identity import identity_difference, model_identity
from tlt_cli.models.loading import load_config_and_tokenizer
from tlt_cli.models.tiny import cache_directory
from tlt_cli.plugins import DriverPlugins, RunInfo, plugin_columns, plugin_idle_uses
from tlt_cli.processes.distributed import remove_abandoned_rendezvous
from tlt_cli.processes.hostfile import runs_on_this_machine
from tlt_cli.processes.launched_workers import LaunchedWorkers
from tlt_cli.processes.local_workers import LocalWorkers
from tlt_cli.processes.messages import (
    RunSpec,
    WorkerBody,
    WorkerFailed,
    WorkerFinished,
    WorkerProgress,
    WorkerStepReport,
)
from tlt_cli.processes.run_directory import (
    CHECKPOINTS,
    RECIPE_FILE,
    RUN_LOG,
    TRACE_FILE,
    RunDirectory,
    resume_checkpoint,
    trained_from,
)
from tlt_cli.processes.step_deadline import StepDeadline
from tlt_cli.processes.step_records import step_records
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.sglang.registry import stop_recorded_servers
from tlt_cli.sglang.server_files import remove_abandoned_server_files
from tlt_cli.shared_memory import remove_abandoned_buffers
from tlt_cli.trace import STEP_RECORD, TraceWriteError, TraceWriter, read_trace, truncate_trace
from tlt_cli.versions import installed_versions

EVENT_POLL_SECONDS = 1.0
# config.json keys that shape a model's weights: a resume onto a model that differs in one cannot load the checkpoint
MODEL_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)
# seconds the driver waits, after a worker reported a failure, for a peer's report or death that came first
FOLLOW_ON_SECONDS = 2.0
SETTLE_POLL_SECONDS = 0.1
# what one pass of the event loop may take besides its wait (a step record, the display) before it counts as a pause
PROCESSING_SLACK_SECONDS = 1.0


class TrainingFailed(RuntimeError):
    """The run stopped because a worker failed; the message names it. details: the traceback."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class RunDiverged(TrainingFailed):
    """A worker's policy logits or loss stopped being finite; the message names the worker, the step and the likely
    cause, and advises no --resume (its newest checkpoints may hold the diverged weights)."""


class WorkerInputError(UserError):
    """A worker stopped on a problem the user can fix (a data file, model weights); the message names it."""

    def __init__(self, message: str, details: str = ""):
        super().__init__(message)
        self.details = details


class WorkerGroup(Protocol):
    """The running workers as the driver loop sees them (LocalWorkers or LaunchedWorkers)."""

    size: int

    def next_event(self, timeout: float) -> Any: ...

    def failure(self, finished: set[int]) -> str | None: ...

    def ended_without_report(self, accounted: set[int]) -> str | None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class RunSummary:
    run_directory: Path
    steps: list[dict[str, Any]]


@dataclass(frozen=True)
class TrainerEntry:
    """What the driver runs for one train.trainer, given by the trainer table (tlt_cli/trainers.py).

    worker_body: each process's body (a module-level function: spawned processes and launched ranks
    import it); prepare_drafter(recipe, model cache, progress): the starting drafter's folder (None:
    random or none) and the report of a warm-up that ran now (None: cached or none); prepare_decoding(recipe,
    starting drafter's folder): how the embedded rollout decodes (setup.py `decode_plan`: measured once per
    machine and model, before any worker starts).
    """

    worker_body: WorkerBody
    prepare_drafter: Callable[[Recipe, Path, Any], tuple[Path | None, dict | None]]
    prepare_decoding: Callable[[Recipe, Path | None], DecodePlan]


class RunTrace:
    """The run's trace, opened at its first record: until a step is recorded, nothing in it changes.

    On a resume the records of steps from `start_step` on are dropped then (they run again), the `run`
    record goes first, and a resume that changed settings writes the run's recipe.yaml (`recipe_text`) anew.
    """

    def __init__(
        self,
        path: Path,
        start_step: int,
        run_record: dict[str, Any],
        loggers: DriverPlugins,
        recipe_text: str | None = None,
    ):
        self.path, self.start_step, self.run_record = path, start_step, run_record
        self.recipe_text = recipe_text
        self.writer: TraceWriter | None = None
        # driver-side plugins see each step record once the trace holds it
        self.loggers = loggers

    @property
    def started(self) -> bool:
        return self.writer is not None

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            if self.recipe_text is not None:
                write_atomically(self.path.parent / RECIPE_FILE, self.recipe_text)
            truncate_trace(self.path, self.start_step)
            self.writer = TraceWriter(self.path)
            self.writer.write(self.run_record)
        self.writer.write(record)
        if record["type"] == STEP_RECORD:
            self.loggers.step_recorded(record)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def train(
    recipe: Recipe,
    trainer: TrainerEntry,
    console: Console,
    resume_directory: Path | None = None,
    keep_log: bool = False,
    run_facts: dict[str, Any] | None = None,
    *,
    check_machine: Callable[[Recipe], None],
    given_recipe: Recipe | None = None,
) -> RunSummary:
    """Run `trainer` with recipe.workers.count worker processes: a new run, or `resume_directory` resumed.

    run_facts: what the composition root chose for this run (e.g. the actor's precision), added to the
    trace's run record. check_machine: raises, in one sentence, when this machine lacks what the recipe asks
    for (run once the run to resume is known, before anything starts).
    given_recipe: the recipe as given, before the composition root made its `auto` values concrete: what the run's
    recipe.yaml keeps, so a resume chooses again as the user asked (None: `recipe`).

    The run directory is locked from when it is taken (a resumed one: once its checkpoint is
    found; a new one: once the drafter is ready) until this returns or raises.
    """
    resume_from, start_step = _resume_point(resume_directory, recipe, console) if resume_directory else (None, 0)
    held = RunDirectory.resume(resume_directory) if resume_directory else None
    try:
        check_machine(recipe)
        _remove_what_killed_runs_left(console)
        cache = cache_directory(recipe.model.cache_dir)
        drafter_init = _prepare_drafter(trainer, recipe, cache, console)
        decode = _prepare_decoding(trainer, recipe, drafter_init, console)
        held = held or RunDirectory.create(given_recipe or recipe)
        run_spec = RunSpec(
            recipe=recipe,
            run_directory=held.path,
            model_cache=cache,
            resume_from=resume_from,
            start_step=start_step,
            drafter_init=drafter_init,
            decode=decode,
        )
        return _train_in(
            run_spec,
            trainer.worker_body,
            held,
            console,
            resumed=resume_directory is not None,
            keep_log=keep_log,
            run_facts={**(run_facts or {}), "rollout_precision": _precision_by_worker(recipe, decode)},
            given_recipe=given_recipe or recipe,
        )
    finally:
        if held is not None:
            held.release()


def _train_in(
    run_spec: RunSpec,
    body: WorkerBody,
    held: RunDirectory,
    console: Console,
    resumed: bool,
    keep_log: bool,
    run_facts: dict[str, Any],
    given_recipe: Recipe,
) -> RunSummary:
    """The run in its (locked) run directory: workers, trace and display; the summary, or the error to show."""
    recipe = run_spec.recipe
    run_directory = held.path
    console.print(f"run directory: {run_directory}", markup=False)
    loggers = DriverPlugins(recipe)
    run = RunInfo(
        recipe.run.name,
        run_directory,
        recipe.workers.count,
        recipe.train.steps,
        run_spec.start_step,
        resumed,
        recipe_to_dict(recipe),
    )
    trace = RunTrace(
        run_directory / TRACE_FILE,
        run_spec.start_step,
        {
            "type": "run",
            "name": recipe.run.name,
            "world_size": recipe.workers.count,
            "resumed_from_step": run_spec.start_step if resumed else None,
            "steps": recipe.train.steps,
            "versions": installed_versions(),
            **run_facts,
        },
        loggers,
        recipe_to_yaml(given_recipe) if "changed_settings" in run_facts else None,
    )
    columns = plugin_columns(recipe.plugins.enabled)
    try:
        with (
            TrainingDisplay(console, f"tlt train {recipe.run.name}", recipe.train.steps, columns) as display,
            loggers.running(run, warn=display.note),
        ):
            _run_workers(run_spec, body, trace, display)
    except (TrainingFailed, UserError) as error:
        trace.close()
        details = getattr(error, "details", "") or traceback.format_exc()
        discard = held.made_by_this_run and not trace.started and not (run_directory / CHECKPOINTS).exists()
        raise _after_failure(error, details, held, discard, keep_log) from None
    finally:
        trace.close()
    steps = [record for record in read_trace(trace.path) if record["type"] == "step"]
    render_summary(console, steps, run_directory, plugin_idle_uses(recipe.plugins.enabled))
    return RunSummary(run_directory, steps)


def _after_failure(error: Exception, details: str, held: RunDirectory, discard: bool, keep_log: bool) -> Exception:
    """Remove the staging folder of a checkpoint being written (the workers have stopped), log the traceback in
    the run's log; with discard (a new run that failed before its first step), remove what it made.

    Returns the error to raise: a bug's message then says where its traceback is (only if the log took it) and
    whether there is a checkpoint to --resume.
    """
    run_directory = held.path
    # a partial checkpoint is never read, and after a full disk it keeps the disk full (and the log unwritten)
    remove_staging(run_directory / CHECKPOINTS)
    log = run_directory / RUN_LOG
    logged = False
    with contextlib.suppress(OSError):
        with log.open("a", encoding="utf-8") as handle:
            handle.write(f"{error}\n{details.rstrip()}\n")
        logged = True
    if discard:
        held.discard(keep_log)
    if isinstance(error, TraceWriteError) and not discard:
        # the trace knows no checkpoints: once there is room, resume or start again, as the run left it
        return TraceWriteError(f"{str(error).rstrip('.')}; then {next_run_advice(run_directory)}.")
    if isinstance(error, UserError):
        return error
    first_line, newline, more = str(error).partition("\n")
    if discard and not keep_log:
        note = "it failed before its first step, so its run directory is removed; --keep-log keeps its log"
    elif isinstance(error, RunDiverged):  # a checkpoint after the divergence would diverge again
        note = (
            f"{f'traceback in {log}; ' if logged else ''}do not --resume it, its newest checkpoint may hold the "
            "diverged weights: start the run again with the cause fixed"
        )
    else:
        note = f"{f'traceback in {log}; ' if logged else ''}{next_run_advice(run_directory)}"
    return TrainingFailed(f"{first_line.rstrip('.')} ({note}).{newline}{more}")


def _remove_what_killed_runs_left(console: Console) -> None:
    """Free the DeepSpeed /dev/shm segments (shared_memory.py) and remove the rendezvous folders (distributed.py)
    and SGLang servers' files (sglang/server_files.py) that killed runs left, saying so in one line; whatever
    backend this run uses."""
    removed = remove_abandoned_buffers()
    if removed:
        console.print(
            f"removed {len(removed)} DeepSpeed shared-memory segment(s) a killed run left in /dev/shm", markup=False
        )
    remove_abandoned_rendezvous()
    servers = remove_abandoned_server_files()
    if servers:
        console.print(f"removed the files of {len(servers)} SGLang server(s) a killed run left", markup=False)


def _prepare_drafter(trainer: TrainerEntry, recipe: Recipe, cache: Path, console: Console) -> Path | None:
    console.print("preparing the drafter (an offline warm-up runs once per model and task, then is cached)")
    with PhaseProgress(console, "drafter warm-up") as progress:
        folder, report = trainer.prepare_drafter(recipe, cache, progress)
    if report is not None:
        console.print(
            f"drafter warmed up offline: top-1 agreement with the target {report['held_out_accuracy']:.1%} "
            f"(from {report['held_out_accuracy_before']:.1%}), cached in {folder}",
            markup=False,
        )
    return folder


def _prepare_decoding(trainer: TrainerEntry, recipe: Recipe, drafter_init: Path | None, console: Console) -> DecodePlan:
    """How the workers' rollouts decode, measured here once (cached per machine and model) and printed."""
    console.print("choosing how the rollout decodes (dtype, linear forms, SD pass costs: measured once per machine)")
    decode = trainer.prepare_decoding(recipe, drafter_init)
    for line in decode.log_lines:
        console.print(line, markup=False)
    return decode


def _precision_by_worker(recipe: Recipe, decode: DecodePlan) -> dict[str, dict]:
    """The trace's rollout_precision: each worker's record (one plan for all of them)."""
    if not decode.precision:  # TRL's own generation: tlt does not decode
        return {}
    return {str(worker): decode.precision for worker in range(recipe.workers.count)}


def _resume_point(run_directory: Path, recipe: Recipe, console: Console) -> tuple[Path, int]:
    """The checkpoint to resume from (run_directory.py: checked, covered by the trace, written by as many workers
    as the recipe has); each warning one line."""
    checkpoint, warnings = resume_checkpoint(run_directory)
    written_by = checkpoint.state.get("world_size")
    if isinstance(written_by, int) and written_by != recipe.workers.count:
        # each rank's optimizer shard and sampling stream belong to its rank: another count cannot load them
        raise CheckpointError(
            f"workers.count: checkpoint {checkpoint.directory} was written by {written_by} workers, the recipe has "
            f"{recipe.workers.count}; resume with workers.count={written_by}."
        )
    _check_same_model(run_directory, recipe)
    for warning in warnings:
        console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)
    return checkpoint.directory, checkpoint.next_step


def _check_same_model(run_directory: Path, recipe: Recipe) -> None:
    """CheckpointError when model.path now holds another model than the one the run was trained from: by the
    identity recorded at its start (config, shapes, weights digest), else (a run started by an older tlt) by the
    shape keys of the config its recipe.yaml names; a model that cannot be read any more is left for the load to
    judge."""
    recorded = trained_from(run_directory)
    if recorded is not None:
        difference = identity_difference(recorded, model_identity(recipe.model.path, recipe.model.trust_remote_code))
        if difference is not None:
            raise CheckpointError(
                f"model.path: {recipe.model.path} now holds another model than run {run_directory} was trained from "
                f"({difference}); resume with the model the run started from, or start a new run."
            )
        return
    try:
        started_with = load_recipe(run_directory / RECIPE_FILE).model
    except UserError:
        return
    if started_with.path == recipe.model.path:
        return
    try:
        before = load_config_and_tokenizer(started_with.path, started_with.trust_remote_code)[0].to_dict()
        now = load_config_and_tokenizer(recipe.model.path, recipe.model.trust_remote_code)[0].to_dict()
    except UserError:
        return
    differ = [key for key in MODEL_SHAPE_KEYS if before.get(key) != now.get(key)]
    if differ:
        raise CheckpointError(
            f"model.path: {recipe.model.path} is another model than the run was trained from ({started_with.path}: "
            f"{', '.join(f'{key} {before.get(key)} vs {now.get(key)}' for key in differ)}); resume with "
            f"model.path={started_with.path}."
        )


def _run_workers(run_spec: RunSpec, body: WorkerBody, trace: RunTrace, display: TrainingDisplay) -> None:
    recipe = run_spec.recipe
    workers = _start_workers(run_spec, body)
    try:
        _drain_events(workers, trace, display, StepDeadline(recipe.workers.step_timeout_s))
    finally:
        workers.stop()
        if recipe.workers.hostfile is None or runs_on_this_machine(recipe):
            stop_recorded_servers(run_spec.run_directory, recipe.rollout.sglang.stop_timeout_s)


def _start_workers(run_spec: RunSpec, body: WorkerBody) -> WorkerGroup:
    """`body` in each process: spawned on this machine, or started on the hostfile's nodes by the DeepSpeed launcher."""
    recipe = run_spec.recipe
    if recipe.workers.hostfile is not None:
        return LaunchedWorkers(run_spec, body)
    gpus = [] if recipe.actor.devices == CPU_DEVICES else recipe.actor.devices
    return LocalWorkers(run_spec, recipe.workers.count, gpus, body)


def _drain_events(workers: WorkerGroup, trace: RunTrace, display: TrainingDisplay, deadline: StepDeadline) -> None:
    pending: dict[int, list[WorkerStepReport]] = {}
    finished: set[int] = set()
    while len(finished) < workers.size:
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
            _record_step(pending.pop(event.step), trace, display)


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


def _record_step(reports: list[WorkerStepReport], trace: RunTrace, display: TrainingDisplay) -> None:
    records = step_records(reports)
    for record in records:
        trace.write(record)
    display.add_step(records[-1])
    for report in reports:
        for warning in report.sd_warnings:
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
