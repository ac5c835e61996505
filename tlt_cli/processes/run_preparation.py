"""What the driver does once before any worker starts: clear what killed runs left, prepare the drafter, plan.

Each step prints one line of what it does (and what it found); the run's plan (tlt_cli/tuning/run_plan.py) is
made here by the trainer's `plan_run` (setup.py `planned_run`), printed line by line, and its records go to the
trace's run record (`plan_facts`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from tlt_cli.config import DrafterStart, Recipe
from tlt_cli.display import PhaseProgress
from tlt_cli.processes.distributed import remove_abandoned_rendezvous
from tlt_cli.processes.op_build import EXTENSIONS_FOLDER, remove_abandoned_build_locks
from tlt_cli.sglang.server_files import remove_abandoned_server_files
from tlt_cli.shared_memory import remove_abandoned_buffers
from tlt_cli.tuning.run_plan import RunPlan


def remove_what_killed_runs_left(console: Console, cache: Path) -> None:
    """Free the DeepSpeed /dev/shm segments and multiprocessing semaphores (shared_memory.py) and remove the
    rendezvous folders, torch's build locks of DeepSpeed's ops in `cache` (op_build.py) and SGLang servers' files
    (sglang/server_files.py) that killed runs left, saying so in one line; whatever backend this run uses. A build
    another live process runs in `cache` is waited for by the workers, under tlt's build lock (op_build.py)."""
    for lock in remove_abandoned_build_locks(cache / EXTENSIONS_FOLDER):
        console.print(f"removed the build lock {lock} a killed run left (its builder is gone)", markup=False)
    removed = remove_abandoned_buffers()
    if removed:
        console.print(f"removed {len(removed)} shared-memory file(s) a killed run left in /dev/shm", markup=False)
    remove_abandoned_rendezvous()
    servers = remove_abandoned_server_files()
    if servers:
        console.print(f"removed the files of {len(servers)} SGLang server(s) a killed run left", markup=False)


def prepare_drafter(
    prepare: Callable[[Recipe, Path, Any], tuple[Path | None, dict | None]],
    describe: Callable[[Recipe, Path | None], str | None],
    recipe: Recipe,
    cache: Path,
    console: Console,
) -> Path | None:
    """The starting drafter's folder (None: a fresh start or none) that `prepare` (the trainer's `prepare_drafter`)
    gives, its warm-up shown with a progress bar when it runs now, and the one line `describe` gives of it."""
    if recipe.drafter.init == DrafterStart.warmup:  # the other starts cost nothing here (online: trained online)
        console.print("preparing the drafter (an offline warm-up runs once per model and task, then is cached)")
    with PhaseProgress(console, "drafter warm-up") as progress:
        folder, report = prepare(recipe, cache, progress)
    if report is not None:
        from tlt_cli.drafter.warmup import report_lines

        for line in [*report_lines(report, recipe.rollout.temperature), f"cached in {folder}"]:
            console.print(line, markup=False)
    sentence = describe(recipe, folder)
    if sentence is not None:
        console.print(sentence, markup=False)
    return folder


def plan_run(
    plan: Callable[[Recipe, Path | None], tuple[Recipe, RunPlan]],
    recipe: Recipe,
    drafter_init: Path | None,
    console: Console,
) -> tuple[Recipe, RunPlan]:
    """The run's plan, made here once (its measurements cached per machine and model) and printed, and the recipe
    with its choices made concrete (`plan`: the trainer's `plan_run`)."""
    console.print(
        "planning the run: the actor's precision and how the rollout decodes (dtype, linear forms, SD pass costs: "
        "measured once per machine and model)"
    )
    recipe, run_plan = plan(recipe, drafter_init)
    for line in run_plan.log_lines:
        console.print(line, markup=False)
    return recipe, run_plan


def plan_facts(recipe: Recipe, plan: RunPlan) -> dict[str, Any]:
    """The trace's run-record entries of the plan: actor_precision, and rollout_precision by worker (one plan for
    all of them; none under TRL's own generation, where tlt does not decode)."""
    precision = plan.decode.precision
    by_worker = {str(worker): precision for worker in range(recipe.workers.count)} if precision else {}
    return {"actor_precision": plan.update.record(), "rollout_precision": by_worker}
