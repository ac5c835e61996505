"""What the driver leaves in the run directory for the ranks the DeepSpeed launcher starts.

A launched rank gets only the run directory on its command line; everything else it reads from
`<run_dir>/launch/`, so every node (the run directory is on a file system they all mount) runs
exactly what the driver prepared:
  recipe.yaml   the recipe of this launch, resolved (overrides and a --resume included), its
                workers.hostfile pointing at the copy below
  hostfile      a copy of the recipe's hostfile (every rank validates the recipe, on any node)
  driver.json   readable by its owner only: the driver's event channel (host, port, secret),
                what the driver prepared once (model cache, checkpoint to resume, starting drafter,
                the ranks' rendezvous folder on one host) and the worker body each rank runs
Written by launched_workers.py, read by launched_rank.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from tlt_cli.config import Recipe, load_recipe, recipe_to_yaml
from tlt_cli.processes.messages import WorkerBody

LAUNCH_DIRECTORY = "launch"
RECIPE_FILE = "recipe.yaml"
HOSTFILE = "hostfile"
PLAN_FILE = "driver.json"
OWNER_ONLY = 0o600


@dataclass(frozen=True)
class LaunchPlan:
    """Where the driver listens and what it prepared; paths as strings, None where nothing applies."""

    driver_host: str
    driver_port: int
    # hex of the event channel's secret
    authkey: str
    model_cache: str
    resume_from: str | None
    start_step: int
    drafter_init: str | None
    # the body each rank runs, as "module:function" (the trainer's, chosen by the driver's caller)
    worker_body: str
    # one host: the private folder where the ranks meet instead of a TCP store (distributed.py)
    rendezvous_directory: str | None = None


def write_launch_files(run_directory: Path, recipe: Recipe, plan: LaunchPlan) -> Path:
    """Write recipe.yaml, the hostfile and driver.json (created owner-only, before the secret goes in); the folder."""
    directory = (run_directory / LAUNCH_DIRECTORY).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(recipe.workers.hostfile, directory / HOSTFILE)
    workers = dataclasses.replace(recipe.workers, hostfile=str(directory / HOSTFILE))
    (directory / RECIPE_FILE).write_text(recipe_to_yaml(dataclasses.replace(recipe, workers=workers)), encoding="utf-8")
    plan_path = directory / PLAN_FILE
    plan_path.unlink(missing_ok=True)
    descriptor = os.open(plan_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, OWNER_ONLY)
    with os.fdopen(descriptor, "w", encoding="utf-8") as plan_file:
        json.dump(asdict(plan), plan_file, indent=2)
    return directory


def read_launch_files(run_directory: Path) -> tuple[Recipe, LaunchPlan]:
    """The recipe and plan the driver wrote for this launch."""
    directory = run_directory / LAUNCH_DIRECTORY
    plan = LaunchPlan(**json.loads((directory / PLAN_FILE).read_text(encoding="utf-8")))
    return load_recipe(directory / RECIPE_FILE), plan


def body_function(name: str) -> WorkerBody:
    """The worker body a launch plan names ("module:function"; see `body_name`)."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def body_name(body: WorkerBody) -> str:
    """How a launch plan names a worker body (a module-level function): "module:function"."""
    return f"{body.__module__}:{body.__qualname__}"
