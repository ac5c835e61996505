"""What this machine must have for a valid recipe to run: GPUs for the actor, SGLang, a writable /dev/shm.

Recipe validation (tlt_cli/recipe_checks.py) never looks at the machine, so a GPU recipe validates on a
laptop. `machine_problem(recipe)` names, in one sentence, the key that asks for what this machine lacks, or
the /dev/shm the run's processes need and cannot write (None when it has it all); the checks when a run starts
(tlt_cli/preflight.py `check_machine`) refuse the run with it before any worker or server starts (the CLI
exits with 2).
"""

from __future__ import annotations

import sys

import torch

from tlt_cli.config import CPU_DEVICES, ActorConfig, Precision, Recipe, RolloutBackendName, SGLangConfig
from tlt_cli.shared_memory import SHARED_MEMORY_DIRECTORY, unwritable_reason

# bfloat16 arithmetic needs compute capability 8.0 (Ampere) or newer
BF16_MIN_CAPABILITY = 8


def machine_problem(recipe: Recipe) -> str | None:
    """Why this machine cannot run `recipe`: actor.devices needs GPUs it lacks, rollout.backend sglang an
    SGLang it lacks, or the run needs a /dev/shm it cannot write; None when it can."""
    problem = _actor_gpus_problem(recipe.actor)
    if problem is None and recipe.rollout.backend == RolloutBackendName.sglang:
        problem = _sglang_problem(recipe.rollout.sglang)
    return problem or _shared_memory_problem(recipe)


def _actor_gpus_problem(actor: ActorConfig) -> str | None:
    if actor.devices == CPU_DEVICES:
        return None
    if not torch.cuda.is_available():
        return (
            f"actor.devices lists GPUs {actor.devices}, but CUDA is not available here; "
            "run on a GPU machine or set actor.devices=cpu actor.precision=fp32."
        )
    count = torch.cuda.device_count()
    absent = [device for device in actor.devices if device >= count]
    if absent:
        return f"actor.devices lists GPU {absent[0]}, but this machine shows {count} GPU(s) (0..{count - 1})."
    if actor.precision == Precision.bf16:
        for device in actor.devices:
            major, minor = torch.cuda.get_device_capability(device)
            if major < BF16_MIN_CAPABILITY:
                return (
                    f"actor.precision bf16 needs compute capability 8.0 or newer, but GPU {device} has "
                    f"{major}.{minor}; set actor.precision=fp32."
                )
    return None


def _sglang_problem(config: SGLangConfig) -> str | None:
    from tlt_cli.sglang.version import SGLangVersionError, installed_sglang_version, sglang_features

    try:
        sglang_features(installed_sglang_version(config.python or sys.executable))
    except SGLangVersionError as error:
        return f"rollout.backend is sglang, but {error}"
    return None


def _shared_memory_problem(recipe: Recipe) -> str | None:
    """Spawned workers share their event queue's semaphores through /dev/shm (Python's multiprocessing has no
    other way), SGLang's servers their weights and locks; the DeepSpeed launcher's ranks do without it."""
    sglang = recipe.rollout.backend == RolloutBackendName.sglang
    if recipe.workers.hostfile and not sglang:
        return None
    reason = unwritable_reason()
    if reason is None:
        return None
    users = "SGLang's servers need it" if sglang else "the worker processes tlt train spawns share their locks there"
    instead = "" if sglang else ", or launch the workers with workers.hostfile (a file reading 'localhost slots=N')"
    return (
        f"{SHARED_MEMORY_DIRECTORY} cannot be written on this machine ({reason}) and {users}; mount a writable "
        f"tmpfs there (in a container: docker run --shm-size=1g){instead}, then run again."
    )
