"""Run-time checks that this machine has what a valid recipe asks for: GPUs for the actor, SGLang, /dev/shm.

Recipe validation (tlt_cli/recipe_checks.py) never looks at the machine, so a GPU recipe validates on a
laptop. The driver calls `check_machine(recipe)` before it starts any worker or server; each
problem is a `RecipeError` naming the key that asks for what is missing (the CLI exits with 2); a
/dev/shm that cannot be written, where the run's processes need it, is a `UserError` naming it.
"""

from __future__ import annotations

import sys

import torch

from tlt_cli.config import CPU_DEVICES, ActorConfig, Recipe, RecipeError, RolloutBackendName, SGLangConfig
from tlt_cli.errors import UserError
from tlt_cli.shared_memory import SHARED_MEMORY_DIRECTORY, unwritable_reason

# bfloat16 arithmetic needs compute capability 8.0 (Ampere) or newer
BF16_MIN_CAPABILITY = 8


def check_machine(recipe: Recipe) -> None:
    """RecipeError if actor.devices needs GPUs this machine lacks, or rollout.backend sglang an SGLang it lacks;
    UserError if the run needs a /dev/shm it cannot write."""
    _check_actor_gpus(recipe.actor)
    if recipe.rollout.backend == RolloutBackendName.sglang:
        _check_sglang(recipe.rollout.sglang)
    _check_shared_memory(recipe)


def _check_actor_gpus(actor: ActorConfig) -> None:
    if actor.devices == CPU_DEVICES:
        return
    if not torch.cuda.is_available():
        raise RecipeError(
            f"actor.devices lists GPUs {actor.devices}, but CUDA is not available here; "
            "run on a GPU machine or set actor.devices=cpu actor.precision=fp32."
        )
    count = torch.cuda.device_count()
    absent = [device for device in actor.devices if device >= count]
    if absent:
        raise RecipeError(
            f"actor.devices lists GPU {absent[0]}, but this machine shows {count} GPU(s) (0..{count - 1})."
        )
    if actor.precision == "bf16":
        for device in actor.devices:
            major, minor = torch.cuda.get_device_capability(device)
            if major < BF16_MIN_CAPABILITY:
                raise RecipeError(
                    f"actor.precision bf16 needs compute capability 8.0 or newer, but GPU {device} has "
                    f"{major}.{minor}; set actor.precision=fp32."
                )


def _check_sglang(config: SGLangConfig) -> None:
    from tlt_cli.sglang.version import SGLangVersionError, installed_sglang_version, sglang_features

    try:
        sglang_features(installed_sglang_version(config.python or sys.executable))
    except SGLangVersionError as error:
        raise RecipeError(f"rollout.backend is sglang, but {error}") from None


def _check_shared_memory(recipe: Recipe) -> None:
    """Spawned workers share their event queue's semaphores through /dev/shm (Python's multiprocessing has no
    other way), SGLang's servers their weights and locks; the DeepSpeed launcher's ranks do without it."""
    sglang = recipe.rollout.backend == RolloutBackendName.sglang
    if recipe.workers.hostfile and not sglang:
        return
    reason = unwritable_reason()
    if reason is None:
        return
    users = "SGLang's servers need it" if sglang else "the worker processes tlt train spawns share their locks there"
    instead = "" if sglang else ", or launch the workers with workers.hostfile (a file reading 'localhost slots=N')"
    raise UserError(
        f"{SHARED_MEMORY_DIRECTORY} cannot be written on this machine ({reason}) and {users}; mount a writable "
        f"tmpfs there (in a container: docker run --shm-size=1g){instead}, then run again."
    )
