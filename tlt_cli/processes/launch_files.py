"""What the driver leaves in the run directory for the ranks the DeepSpeed launcher starts.

A launched rank gets only the run directory on its command line; everything else it reads from
`<run_dir>/launch/`, so every node (the run directory is on a file system they all mount) runs
exactly what the driver prepared:
  recipe.yaml   the recipe of this launch, resolved (overrides and a --resume included), its
                workers.hostfile pointing at the copy below
  hostfile      a copy of the recipe's hostfile (every rank validates the recipe, on any node)
  driver.json   readable by its owner only: "plan", the `LaunchPlan` (the driver's event channel:
                host, port, secret; the ranks' rendezvous folder on one host; the worker body each
                rank runs), and "run", the rest of the run's `RunSpec` (messages.py: model cache,
                checkpoint to resume and its step, starting drafter), paths made absolute
Written by launched_workers.py (`write_launch_files(run_spec, plan)`), read by launched_rank.py
(`read_launch_files(run_directory)`: the same `RunSpec`, its recipe from recipe.yaml, and the plan).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tlt_cli.atomic_files import write_atomically
from tlt_cli.config import Recipe, load_recipe, recipe_to_yaml
from tlt_cli.processes.messages import RunSpec, WorkerBody
from tlt_cli.tuning.run_plan import RunPlan

LAUNCH_DIRECTORY = "launch"
RECIPE_FILE = "recipe.yaml"
HOSTFILE = "hostfile"
PLAN_FILE = "driver.json"
OWNER_ONLY = 0o600


@dataclass(frozen=True)
class LaunchPlan:
    """Where the driver listens and what each rank runs (the run's own fields travel as its `RunSpec`)."""

    driver_host: str
    driver_port: int
    # hex of the event channel's secret
    authkey: str
    # the body each rank runs, as "module:function" (the trainer's, chosen by the driver's caller)
    worker_body: str
    # one host: the private folder where the ranks meet instead of a TCP store (distributed.py)
    rendezvous_directory: str | None = None


def write_launch_files(run_spec: RunSpec, plan: LaunchPlan) -> Path:
    """Write recipe.yaml, the hostfile and driver.json (created owner-only, before the secret goes in); the folder."""
    recipe = run_spec.recipe
    directory = (run_spec.run_directory / LAUNCH_DIRECTORY).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    # written atomically: a link planted at either name is replaced, never written through
    write_atomically(directory / HOSTFILE, Path(recipe.workers.hostfile).read_bytes())
    workers = dataclasses.replace(recipe.workers, hostfile=str(directory / HOSTFILE))
    write_atomically(directory / RECIPE_FILE, recipe_to_yaml(dataclasses.replace(recipe, workers=workers)))
    plan_path = directory / PLAN_FILE
    plan_path.unlink(missing_ok=True)
    descriptor = os.open(plan_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, OWNER_ONLY)
    with os.fdopen(descriptor, "w", encoding="utf-8") as plan_file:
        json.dump({"plan": asdict(plan), "run": _run_fields(run_spec)}, plan_file, indent=2)
    return directory


def read_launch_files(run_directory: Path) -> tuple[RunSpec, LaunchPlan]:
    """The run's spec (in this rank's `run_directory`, the recipe the driver wrote) and the driver's plan."""
    directory = run_directory / LAUNCH_DIRECTORY
    written = json.loads((directory / PLAN_FILE).read_text(encoding="utf-8"))
    run_spec = _run_spec(load_recipe(directory / RECIPE_FILE), run_directory, written["run"])
    return run_spec, LaunchPlan(**written["plan"])


def _run_fields(run_spec: RunSpec) -> dict[str, Any]:
    """driver.json's "run": the `RunSpec` fields a rank cannot read elsewhere, paths absolute (a rank on another
    node may start in another folder)."""
    return {
        "model_cache": str(run_spec.model_cache.resolve()),
        "resume_from": _absolute(run_spec.resume_from),
        "start_step": run_spec.start_step,
        "drafter_init": _absolute(run_spec.drafter_init),
        "plan": run_spec.plan.to_dict(),
    }


def _run_spec(recipe: Recipe, run_directory: Path, run_fields: dict[str, Any]) -> RunSpec:
    """The `RunSpec` that `_run_fields` wrote, with the recipe and run directory of this rank."""
    return RunSpec(
        recipe=recipe,
        run_directory=run_directory,
        model_cache=Path(run_fields["model_cache"]),
        resume_from=_path_or_none(run_fields["resume_from"]),
        start_step=run_fields["start_step"],
        drafter_init=_path_or_none(run_fields["drafter_init"]),
        plan=RunPlan.from_dict(run_fields["plan"]),
    )


def _absolute(path: Path | None) -> str | None:
    return str(path.resolve()) if path is not None else None


def _path_or_none(text: str | None) -> Path | None:
    return Path(text) if text is not None else None


def body_function(name: str) -> WorkerBody:
    """The worker body a launch plan names ("module:function"; see `body_name`)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def body_name(body: WorkerBody) -> str:
    """How a launch plan names a worker body (a module-level function): "module:function"."""
    return f"{body.__module__}:{body.__qualname__}"
