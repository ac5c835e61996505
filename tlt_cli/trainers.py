"""The trainers `tlt train` can run, by `train.trainer`: the table the driver receives its worker body from.

`train(recipe, console, ...)` is what `tlt train` calls: it looks the recipe's trainer up in
`TRAINERS` and hands the driver (tlt_cli/processes/driver.py) that trainer's worker body and the
starting drafter's preparation (setup.py), so the process plumbing imports no trainer:
  native  tlt's own GRPO worker loop (worker_loop.py)
  trl     Hugging Face TRL's GRPOTrainer with tlt's rollout (tlt_cli/integrations/trl_run.py),
          imported only when a TRL run starts (the native path never loads TRL)
Before either starts, the checks of this machine (tlt_cli/preflight.py) refuse a run whose workers would not
fit in memory (`check_memory`), then `resolve_update_precision` (update_precision.py, which the composition
root's setup.py serves with the policy) makes `actor.precision: auto` concrete (measured once per machine and model; the
console and the trace's run record say what ran and why); the driver is handed `check_machine`, which
refuses a run whose GPUs or SGLang this machine lacks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from tlt_cli.config import CPU_DEVICES, Precision, Recipe, Trainer, load_recipe
from tlt_cli.preflight import check_machine, check_memory
from tlt_cli.processes.driver import RunSummary, TrainerEntry
from tlt_cli.processes.driver import train as run_driver
from tlt_cli.processes.messages import WorkerSpec
from tlt_cli.processes.resume_settings import changed_settings, describe_changes
from tlt_cli.processes.run_directory import RECIPE_FILE
from tlt_cli.training.setup import decode_plan, model_cache, prepare_drafter
from tlt_cli.training.update_precision import resolve_update_precision
from tlt_cli.training.worker_loop import worker_main


def trl_worker_main(spec: WorkerSpec, events: Any) -> None:
    """The body of one TRL process (tlt_cli/integrations/trl_run.py), imported when the process starts."""
    from tlt_cli.integrations.trl_run import trl_worker_main as body

    body(spec, events)


TRAINERS: dict[Trainer, TrainerEntry] = {
    Trainer.native: TrainerEntry(worker_main, prepare_drafter, decode_plan),
    Trainer.trl: TrainerEntry(trl_worker_main, prepare_drafter, decode_plan),
}


def train(recipe: Recipe, console: Console, resume_directory: Path | None = None, keep_log: bool = False) -> RunSummary:
    """Run the recipe's trainer (a new run, or `resume_directory` resumed); see tlt_cli/processes/driver.py.

    First a refusal, one sentence, when this machine's memory cannot hold the workers' estimated peak
    (tlt_cli/preflight.py `check_memory`; with actor.precision auto, that of the larger precision), then auto is
    resolved; a resume says which settings it changes (tlt_cli/processes/resume_settings.py) and records them in
    the trace's run record, and the driver writes them to the run's recipe.yaml.
    """
    check_memory(recipe)
    if recipe.actor.precision == Precision.auto and recipe.actor.devices == CPU_DEVICES:
        console.print("choosing actor.precision auto (the update is timed in fp32 and bf16 once per machine and model)")
    given = recipe  # what recipe.yaml keeps: a resume resolves `auto` again
    recipe, precision = resolve_update_precision(recipe, model_cache(recipe))
    console.print(precision.describe(), markup=False)
    facts: dict[str, Any] = {"actor_precision": precision.record()}
    if resume_directory is not None:
        changes = changed_settings(load_recipe(resume_directory / RECIPE_FILE), given)
        if changes:
            console.print(describe_changes(changes), markup=False, highlight=False, soft_wrap=True)
            facts["changed_settings"] = {key: list(values) for key, values in changes.items()}
    return run_driver(
        recipe,
        TRAINERS[recipe.train.trainer],
        console,
        resume_directory,
        keep_log,
        facts,
        check_machine=check_machine,
        given_recipe=given,
    )
