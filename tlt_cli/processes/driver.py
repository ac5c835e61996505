"""The driver of `tlt train`: prepares the run, spawns the workers, writes the trace.

`train(recipe, trainer, ...)` is what the composition root calls (tlt_cli/trainers.py gives the
`TrainerEntry` of the recipe's train.trainer: each process's body, how the starting drafter is prepared and
how the run is planned). Before anything is created, the `check_machine` it is handed (tlt_cli/preflight.py's)
makes sure this machine has what the recipe asks for (GPUs for `actor.devices`, SGLang for
`rollout.backend: sglang`); then, once (run_preparation.py), what killed runs left is removed (DeepSpeed /dev/shm
segments, rendezvous folders, SGLang server files), the drafter is prepared (so workers do not race to build
it) and the run's plan is made (tlt_cli/tuning/run_plan.py: the actor's precision, how the rollout decodes,
what it speculates with), which every rank receives in its `RunSpec` (messages.py). Only then is a new run
directory made, locked for the run's life (run_directory.py: a second `tlt train` of it refuses); a resume
finds its checkpoint first (resume_point.py) and says what settings it changes.

One process per worker runs the trainer's body (a DeepSpeed rank each): spawned here without
`workers.hostfile` (local_workers.py), on the hostfile's nodes by the DeepSpeed launcher with one
(launched_workers.py). Their reports become trace records and the live display (worker_events.py; the trace
opens at the first step, run_trace.py, so a resume that fails first leaves it as it was). A worker that fails
stops the others and a `TrainingFailed` names the first to fail (run_failures.py; a `WorkerInputError`, exit 2,
when the error is the user's); its traceback goes to the run's log (`run.log`), the run directory keeps every
complete checkpoint for `--resume`, and a new run that failed before its first step is removed again (with
`keep_log`, all but its logs stay). A worker that spends more than `workers.step_timeout_s` in one step ends
the run as a failure does (step_deadline.py); SIGTERM ends it as Ctrl-C does (tlt_cli/cli/__init__.py). Workers start
with only the actor's GPUs visible. Whatever way the run ends, the driver finally stops every SGLang server
process group the workers recorded in the run directory (on this machine: with a hostfile of several nodes
each worker stops its own, and DeepSpeed ends the ranks' process trees).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from tlt_cli.config import Recipe, SpeculativeMode, recipe_to_dict, recipe_to_yaml
from tlt_cli.display import TrainingDisplay, render_summary
from tlt_cli.errors import UserError
from tlt_cli.models.tiny import cache_directory
from tlt_cli.plugins import DriverPlugins, RunInfo, plugin_columns, plugin_idle_uses
from tlt_cli.processes.drafter_publish import publish_run_drafter
from tlt_cli.processes.messages import RunSpec, WorkerBody
from tlt_cli.processes.resume_point import resume_point, resumed_changes
from tlt_cli.processes.run_directory import CHECKPOINTS, TRACE_FILE, RunDirectory
from tlt_cli.processes.run_failures import TrainingFailed, after_failure
from tlt_cli.processes.run_preparation import plan_facts, plan_run, prepare_drafter, remove_what_killed_runs_left
from tlt_cli.processes.run_trace import RunTrace
from tlt_cli.processes.worker_events import run_workers
from tlt_cli.sd_effect import sd_effect_sentence, trace_sd_effect
from tlt_cli.trace import TraceError, read_trace
from tlt_cli.tuning.run_plan import RunPlan
from tlt_cli.versions import installed_versions


@dataclass(frozen=True)
class RunSummary:
    run_directory: Path
    steps: list[dict[str, Any]]


@dataclass(frozen=True)
class TrainerEntry:
    """What the driver runs for one train.trainer, given by the trainer table (tlt_cli/trainers.py).

    worker_body: each process's body (a module-level function: spawned processes and launched ranks
    import it); prepare_drafter(recipe, model cache, progress): the starting drafter's folder (None:
    random or none) and the report of a warm-up that ran now (None: cached or none); describe_drafter(recipe,
    that folder): the console's one line on where the drafter starts (None: the run needs none); plan_run(recipe,
    starting drafter's folder): the recipe with its choices made concrete and the run's plan (setup.py
    `planned_run`: measured once per machine and model, before any worker starts).
    """

    worker_body: WorkerBody
    prepare_drafter: Callable[[Recipe, Path, Any], tuple[Path | None, dict | None]]
    describe_drafter: Callable[[Recipe, Path | None], str | None]
    plan_run: Callable[[Recipe, Path | None], tuple[Recipe, RunPlan]]


def train(
    recipe: Recipe,
    trainer: TrainerEntry,
    console: Console,
    resume_directory: Path | None = None,
    keep_log: bool = False,
    *,
    check_machine: Callable[[Recipe], None],
    all_columns: bool = False,
) -> RunSummary:
    """Run `trainer` with recipe.workers.count worker processes: a new run, or `resume_directory` resumed.

    check_machine: raises, in one sentence, when this machine lacks what the recipe asks
    for (run once the run to resume is known, before anything starts). all_columns: the live table's columns
    (tlt_cli/display.py).
    The run's recipe.yaml keeps the recipe as given, before the plan made its `auto` values concrete, so a resume
    chooses again as the user asked.

    The run directory is locked from when it is taken (a resumed one: once its checkpoint is
    found; a new one: once the run is planned) until this returns or raises.
    """
    resume_from, start_step = resume_point(resume_directory, recipe, console) if resume_directory else (None, 0)
    held = RunDirectory.resume(resume_directory) if resume_directory else None
    try:
        check_machine(recipe)
        cache = cache_directory(recipe.model.cache_dir)
        remove_what_killed_runs_left(console, cache)
        drafter_init = prepare_drafter(trainer.prepare_drafter, trainer.describe_drafter, recipe, cache, console)
        given = recipe  # what recipe.yaml keeps: a resume resolves `auto` again
        recipe, plan = plan_run(trainer.plan_run, recipe, drafter_init, console)
        run_facts = plan_facts(recipe, plan)
        if resume_directory is not None:
            run_facts.update(resumed_changes(resume_directory, given, console))
        held = held or RunDirectory.create(given)
        run_spec = RunSpec(
            recipe=recipe,
            run_directory=held.path,
            model_cache=cache,
            resume_from=resume_from,
            start_step=start_step,
            drafter_init=drafter_init,
            plan=plan,
        )
        return _train_in(
            run_spec,
            trainer.worker_body,
            held,
            console,
            resumed=resume_directory is not None,
            keep_log=keep_log,
            run_facts=run_facts,
            given_recipe=given,
            all_columns=all_columns,
        )
    finally:
        if held is not None:
            held.release()


def _keep_drafter(run_spec: RunSpec, console: Console, trace_path: Path) -> None:
    """Publish the run's checkpointed drafter for the next run on the model (drafter_publish.py), and say so; the
    accept length it reached is read from the trace (none when a stopped run left its last line torn)."""
    try:
        records = read_trace(trace_path)
    except TraceError:
        records = []
    steps = [record for record in records if record.get("type") == "step"]
    sentence = publish_run_drafter(run_spec.recipe, run_spec.run_directory, run_spec.model_cache, steps)
    if sentence is not None:
        console.print(sentence, markup=False)


def _train_in(
    run_spec: RunSpec,
    body: WorkerBody,
    held: RunDirectory,
    console: Console,
    resumed: bool,
    keep_log: bool,
    run_facts: dict[str, Any],
    given_recipe: Recipe,
    all_columns: bool = False,
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
            TrainingDisplay(
                console, f"tlt train {recipe.run.name}", recipe.train.steps, columns, all_columns, run_spec.start_step
            ) as display,
            loggers.running(run, warn=display.note),
        ):
            run_workers(run_spec, body, trace, display)
    except (TrainingFailed, UserError) as error:
        trace.close()
        _keep_drafter(run_spec, console, trace.path)
        details = getattr(error, "details", "") or traceback.format_exc()
        discard = held.made_by_this_run and not trace.started and not (run_directory / CHECKPOINTS).exists()
        raise after_failure(error, details, held, discard, keep_log) from None
    except KeyboardInterrupt:  # stopped: what the last checkpoint holds still carries to the next run
        trace.close()
        _keep_drafter(run_spec, console, trace.path)
        raise
    finally:
        trace.close()
    records = read_trace(trace.path)
    steps = [record for record in records if record["type"] == "step"]
    _keep_drafter(run_spec, console, trace.path)
    speculated = recipe.speculative.mode != SpeculativeMode.off
    sd_effect = sd_effect_sentence(trace_sd_effect(records)) if speculated else None
    render_summary(console, steps, run_directory, plugin_idle_uses(recipe.plugins.enabled), sd_effect)
    return RunSummary(run_directory, steps)
