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

from tlt_cli.atomic_files import read_json_object, write_atomically
from tlt_cli.config import Recipe, load_recipe, recipe_to_yaml
from tlt_cli.errors import UserError
from tlt_cli.processes.messages import RunSpec, WorkerBody
from tlt_cli.tuning.run_plan import RunPlan

LAUNCH_DIRECTORY = "launch"
RECIPE_FILE = "recipe.yaml"
HOSTFILE = "hostfile"
PLAN_FILE = "driver.json"
OWNER_ONLY = 0o600
# driver.json's format: a rank refuses another (a driver and ranks of different tlt versions)
FORMAT_VERSION = 1
NONE = type(None)
# driver.json's objects: each field and the JSON types it may hold
PLAN_FIELDS = {
    "driver_host": (str,),
    "driver_port": (int,),
    "authkey": (str,),
    "worker_body": (str,),
    "rendezvous_directory": (str, NONE),
}
RUN_FIELDS = {
    "model_cache": (str,),
    "resume_from": (str, NONE),
    "start_step": (int,),
    "drafter_init": (str, NONE),
    "plan": (dict,),
}


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
        json.dump({"version": FORMAT_VERSION, "plan": asdict(plan), "run": _run_fields(run_spec)}, plan_file, indent=2)
    return directory


class LaunchFileError(UserError):
    """A driver.json a rank cannot run from (damaged, or written by another tlt); the message names the file."""


def read_launch_files(run_directory: Path) -> tuple[RunSpec, LaunchPlan]:
    """The run's spec (in this rank's `run_directory`, the recipe the driver wrote) and the driver's plan; a
    LaunchFileError in one sentence when driver.json is damaged or of another version (every field is checked for
    its type: a string "false" is no number, no path is read from a number)."""
    directory = run_directory / LAUNCH_DIRECTORY
    path = directory / PLAN_FILE
    written = read_json_object(path)
    if written is None or written.get("version") != FORMAT_VERSION:
        raise LaunchFileError(
            f"{path} is damaged or was written by another tlt version (format {FORMAT_VERSION} expected); start "
            "the run again with this tlt."
        )
    plan, run = written.get("plan"), written.get("run")
    problem = _fields_problem(plan, PLAN_FIELDS, "plan") or _fields_problem(run, RUN_FIELDS, "run")
    if problem is not None:
        raise LaunchFileError(f"{path} is damaged: {problem}; start the run again.")
    try:
        run_plan = RunPlan.from_dict(run["plan"])
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        raise LaunchFileError(
            f"{path} is damaged: its run plan does not read ({error!r}); start the run again."
        ) from None
    return _run_spec(load_recipe(directory / RECIPE_FILE), run_directory, run, run_plan), LaunchPlan(**plan)


def _fields_problem(values: Any, kinds: dict[str, tuple[type, ...]], name: str) -> str | None:
    """What is wrong with driver.json's object `name` (a field missing or of another type than `kinds` says)."""
    if not isinstance(values, dict) or set(values) != set(kinds):
        return f"'{name}' does not hold exactly the fields {sorted(kinds)}"
    for field_name, kind in kinds.items():
        value = values[field_name]
        if isinstance(value, bool) or not isinstance(value, kind):
            return f"{name}.{field_name} is {value!r}"
    return None


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


def _run_spec(recipe: Recipe, run_directory: Path, run_fields: dict[str, Any], plan: RunPlan) -> RunSpec:
    """The `RunSpec` that `_run_fields` wrote, with the recipe and run directory of this rank."""
    return RunSpec(
        recipe=recipe,
        run_directory=run_directory,
        model_cache=Path(run_fields["model_cache"]),
        resume_from=_path_or_none(run_fields["resume_from"]),
        start_step=run_fields["start_step"],
        drafter_init=_path_or_none(run_fields["drafter_init"]),
        plan=plan,
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
