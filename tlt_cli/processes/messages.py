"""The messages between the driver and its worker processes, apart from any worker's body.

The driver prepares one `RunSpec` per run (the recipe, the run directory, what it prepared once: the
starting drafter and the run's plan) and
hands each process the `WorkerSpec` that `RunSpec.for_rank` makes of it with the process's place in
the job (picklable: spawned processes get it as an argument; launched ranks rebuild the `RunSpec` from
the run directory, launch_files.py, and add the place the DeepSpeed launcher gave them). A process,
whatever trainer it runs (tlt's worker loop, tlt_cli/training/worker_loop.py, or TRL's,
tlt_cli/integrations/trl_run.py), sends the driver `WorkerStarting` while its start-up waits on another
process (another run's op build), `WorkerProgress` as it enters each part of a step,
one `WorkerStepReport` per step, and finally `WorkerFinished` or `WorkerFailed`. The driver (driver.py)
turns the reports into trace records (step_records.py) and names a stuck rank from the progress
(step_deadline.py).
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tlt_cli.config import Recipe
from tlt_cli.errors import TrainingDiverged, UserError
from tlt_cli.processes.distributed import WorkerAddress
from tlt_cli.tuning.run_plan import RunPlan


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What every worker of one run is handed alike, prepared once by the driver (picklable)."""

    recipe: Recipe
    run_directory: Path
    # model.cache_dir resolved (tlt_cli/models/tiny.py cache_directory): built models, measured plans, compiled ops
    model_cache: Path
    # the checkpoint folder a resumed run loads (None: a new run) and the first step the workers run
    resume_from: Path | None = None
    start_step: int = 0
    # folder of the starting drafter (None: random init); used only when the run needs a drafter
    drafter_init: Path | None = None
    # the run's plan (the actor's precision, how the rollout decodes, what it speculates with), made once by the
    # driver: no worker resolves a recipe choice (tlt_cli/tuning/run_plan.py)
    plan: RunPlan

    def for_rank(self, address: WorkerAddress) -> WorkerSpec:
        """The spec of the worker at `address`: this run's fields, and that worker's place in the job."""
        shared = {spec_field.name: getattr(self, spec_field.name) for spec_field in fields(RunSpec)}
        return WorkerSpec(**shared, address=address)


@dataclass(frozen=True, kw_only=True)
class WorkerSpec(RunSpec):
    """Everything one worker process needs: its run's `RunSpec` and its place in the job (picklable)."""

    address: WorkerAddress


# the body of one worker process: runs the trainer and reports on `events` (anything with `put`)
WorkerBody = Callable[[WorkerSpec, Any], None]


@dataclass
class WorkerStepReport:
    """One rank's account of one step (sent to the driver)."""

    step: int
    worker: int
    rollout_start: float
    busy_end: float
    idle_end: float
    reward_seconds: float
    update_seconds: float
    requests: list[dict[str, Any]]
    update: dict[str, float]
    # numbers plugins added to the step context (e.g. drafter_steps), and plugins disabled this step
    plugin_metrics: dict[str, float] = field(default_factory=dict)
    plugin_failures: list[dict[str, str]] = field(default_factory=list)
    # adaptive SD: decode steps, tokens and seconds per configuration label; warnings (collapse, recovery)
    sd_usage: dict[str, dict[str, float]] = field(default_factory=dict)
    sd_warnings: list[str] = field(default_factory=list)
    # the worker's memory past the estimate made before the run (tlt_cli/training/memory_parts.py), once a run
    memory_warnings: list[str] = field(default_factory=list)
    # what the ranks agreed to do about a drafter that diverged in this step's rollout (training/drafter_divergence.py:
    # "reset" or "off"; None: it did not), and the line that says so (the same on every rank)
    drafter_divergence: str | None = None
    drafter_divergence_message: str | None = None
    checkpoint: str | None = None


@dataclass(frozen=True)
class WorkerFailed:
    """A worker raised: its rank, one-line message and the traceback (kept for the log).

    user_error: the error is the user's to fix (a tlt UserError: a data file, model weights); the
    message is then the sentence to show, without the worker's name or the error's type.
    failed_at: when it raised (time.time(): the driver names the first of several failures).
    diverged: the policy's logits or loss stopped being finite (a TrainingDiverged: the message names the step).
    """

    worker: int
    message: str
    details: str
    user_error: bool = False
    failed_at: float = 0.0
    diverged: bool = False

    @classmethod
    def of_exception(cls, worker: int, error: BaseException) -> WorkerFailed:
        """The report of `error`, raised in `worker` and being handled now (its traceback is the current one)."""
        if isinstance(error, UserError):
            return cls(worker, str(error), traceback.format_exc(), user_error=True, failed_at=time.time())
        if isinstance(error, TrainingDiverged):
            return cls(worker, str(error), traceback.format_exc(), failed_at=time.time(), diverged=True)
        return cls(worker, f"{type(error).__name__}: {error}", traceback.format_exc(), failed_at=time.time())


@dataclass(frozen=True)
class WorkerFinished:
    worker: int


@dataclass(frozen=True)
class WorkerStarting:
    """What a rank's start-up waits on (another run's DeepSpeed op build): the driver shows it before the first
    step; no step's clock runs."""

    worker: int
    activity: str


@dataclass(frozen=True)
class WorkerProgress:
    """What a rank is doing now, sent as it enters each part of a step: the driver's step deadline names it.

    waiting: the rank waits for the others here (the step's start, the rollout barrier).
    """

    worker: int
    step: int
    activity: str
    waiting: bool
    pid: int
    host: str
