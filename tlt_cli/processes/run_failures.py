"""How a failed run is named and what it leaves: the driver's errors, and the clean-up after a worker failed.

`TrainingFailed` names the worker that failed first (worker_events.py chooses it), `RunDiverged` one whose
policy stopped being finite (no --resume advised), `WorkerInputError` a problem the user can fix (exit 2).
`after_failure` removes a half-written checkpoint, logs the traceback in the run's log and, for a new run
that failed before its first step, removes what it made; it gives the error the driver raises.
"""

from __future__ import annotations

import contextlib

from tlt_cli.checkpoint import next_run_advice, remove_staging
from tlt_cli.errors import UserError
from tlt_cli.processes.run_directory import CHECKPOINTS, RUN_LOG, RunDirectory
from tlt_cli.trace import TraceWriteError


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


def after_failure(error: Exception, details: str, held: RunDirectory, discard: bool, keep_log: bool) -> Exception:
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
