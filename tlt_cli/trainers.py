"""The trainers `tlt train` can run, by `train.trainer`: the table the driver receives its worker body from.

`train(recipe, console, ...)` is what `tlt train` calls: it looks the recipe's trainer up in
`TRAINERS` and hands the driver (tlt_cli/processes/driver.py) that trainer's worker body, the
starting drafter's preparation and the run's planning (setup.py `prepare_drafter`, `planned_run`), so the
process plumbing imports no trainer:
  native  tlt's own GRPO worker loop (worker_loop.py)
  trl     Hugging Face TRL's GRPOTrainer with tlt's rollout (tlt_cli/integrations/trl_run.py),
          imported only when a TRL run starts (the native path never loads TRL)
Before either starts, the checks of this machine (tlt_cli/preflight.py) refuse a run whose workers would not
fit in memory (`check_memory`); the driver is handed `check_machine`, which refuses a run whose GPUs or SGLang
this machine lacks, and makes the run's plan with `planned_run` (`actor.precision: auto` and the rollout's
measured choices made concrete once per machine and model; the console and the trace's run record say what
ran and why).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from tlt_cli.config import Recipe, Trainer
from tlt_cli.preflight import check_machine, check_memory
from tlt_cli.processes.driver import RunSummary, TrainerEntry
from tlt_cli.processes.driver import train as run_driver
from tlt_cli.processes.messages import WorkerSpec
from tlt_cli.training.setup import describe_drafter_start, planned_run, prepare_drafter
from tlt_cli.training.worker_loop import worker_main


def trl_worker_main(spec: WorkerSpec, events: Any) -> None:
    """The body of one TRL process (tlt_cli/integrations/trl_run.py), imported when the process starts."""
    from tlt_cli.integrations.trl_run import trl_worker_main as body

    body(spec, events)


TRAINERS: dict[Trainer, TrainerEntry] = {
    Trainer.native: TrainerEntry(worker_main, prepare_drafter, describe_drafter_start, planned_run),
    Trainer.trl: TrainerEntry(trl_worker_main, prepare_drafter, describe_drafter_start, planned_run),
}


def train(
    recipe: Recipe,
    console: Console,
    resume_directory: Path | None = None,
    keep_log: bool = False,
    all_columns: bool = False,
) -> RunSummary:
    """Run the recipe's trainer (a new run, or `resume_directory` resumed); see tlt_cli/processes/driver.py.

    First a refusal, one sentence, when this machine's memory cannot hold the workers' estimated peak
    (tlt_cli/preflight.py `check_memory`; with actor.precision auto, that of the larger precision); the driver
    then plans the run (auto resolved) and a resume says which settings it changes
    (tlt_cli/processes/resume_point.py), records them in the trace's run record and writes the run's recipe.yaml.
    all_columns: the live table shows every figure (`tlt train --columns all`), not only the watched ones.
    """
    check_memory(recipe)
    return run_driver(
        recipe,
        TRAINERS[recipe.train.trainer],
        console,
        resume_directory,
        keep_log,
        check_machine=check_machine,
        all_columns=all_columns,
    )
