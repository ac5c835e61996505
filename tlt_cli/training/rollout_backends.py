"""The rollout backend a recipe's `rollout.backend` names, built with the run's plan: part of the composition
root (setup.py builds every other part).

`rollout_backend(recipe, policy, tokenizer, drafter, place)` gives the backend (not started yet) of
BACKEND_FACTORIES: the embedded engine (tlt_cli/rollout/embedded.py) or SGLang servers (tlt_cli/sglang/rollout.py);
`BackendPlace` says where a worker's backend runs and with which plan (`setup.planned_run`, made by the driver).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_cli.config import Recipe, RolloutBackendName
from tlt_cli.tuning.run_plan import RunPlan

if TYPE_CHECKING:
    from torch import nn

    from tlt_cli.rollout.backend import RolloutBackend


@dataclass(frozen=True)
class BackendPlace:
    """Where a worker's rollout backend runs: its rank, its index on its node, the run directory, and the run's
    plan (`planned_run`, made by the driver): how the rollout decodes and what it speculates with;
    drafter_trained: False for a fresh drafter (drafter.init online or random), which mode auto keeps off until
    it has trained."""

    worker: int
    rank_on_node: int
    run_directory: Path
    plan: RunPlan
    drafter_trained: bool = True


def _embedded(
    recipe: Recipe, policy: nn.Module, tokenizer: Any, drafter: nn.Module | None, place: BackendPlace
) -> RolloutBackend:
    from tlt_cli.rollout.embedded import EmbeddedRollout

    return EmbeddedRollout(
        policy,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        place.plan.speculative,
        drafter,
        seed=recipe.run.seed,
        decode=place.plan.decode,
        drafter_trained=place.drafter_trained,
    )


def _sglang(
    recipe: Recipe, policy: nn.Module, tokenizer: Any, drafter: nn.Module | None, place: BackendPlace
) -> RolloutBackend:
    from tlt_cli.models.loading import model_folder
    from tlt_cli.processes.hostfile import ranks_per_node
    from tlt_cli.sglang.adaptive import batch_rules
    from tlt_cli.sglang.rollout import SGLangRollout, servers_of_worker

    return SGLangRollout(
        policy,
        drafter,
        # rollout.sglang.gpus are the GPUs of each node, shared among the ranks of that node
        servers_of_worker(recipe.rollout.sglang, place.rank_on_node, ranks_per_node(recipe)),
        str(model_folder(recipe.model.path)),
        batch_rules(place.plan.speculative),
        eos_token_id=tokenizer.eos_token_id,
        seed=recipe.run.seed,
        run_directory=place.run_directory,
        worker=place.worker,
    )


# rollout.backend -> the factory of that backend (the SGLang one imports SGLang's client only when chosen); TRL's
# own generation (rollout.backend trl) is no tlt backend: tlt_cli/integrations/trl_run.py leaves TRL to generate
BACKEND_FACTORIES: dict[RolloutBackendName, Callable[..., RolloutBackend]] = {
    RolloutBackendName.embedded: _embedded,
    RolloutBackendName.sglang: _sglang,
}


def rollout_backend(
    recipe: Recipe, policy: nn.Module, tokenizer: Any, drafter: nn.Module | None, place: BackendPlace
) -> RolloutBackend:
    """The backend the recipe's `rollout.backend` names, not started yet: it generates with (or pushes the
    weights of) `policy`, speculates with `drafter` (None: none), stops at the tokenizer's EOS."""
    name = recipe.rollout.backend
    if name not in BACKEND_FACTORIES:
        raise ValueError(f"rollout.backend is '{name}'; use one of {', '.join(BACKEND_FACTORIES)}.")
    return BACKEND_FACTORIES[name](recipe, policy, tokenizer, drafter, place)
