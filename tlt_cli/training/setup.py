"""The composition root's one setup: the only code that turns a Recipe into parts.

Every consumer of a recipe builds its parts here: the native worker (worker_loop.py), the TRL
worker (tlt_cli/integrations/trl_run.py), the driver's drafter preparation (tlt_cli/trainers.py),
`tlt profile <recipe>` (tlt_cli/profile/recording.py), `tlt calibrate`
(tlt_cli/calibration/calibrate.py) and `tlt export-drafter` (tlt_cli/export.py). The parts:
  policy_and_tokenizer / reference_policy   the recipe's model (the reference only with a KL term)
  task, sampling                            the task and the rollout's sampling settings
  speculative_plan                          the `speculative` section as a SpeculativePlan, its rule table
                                            parsed and checked here, the one place it is read
  drafter_needed, prepare_drafter,          whether a run needs a drafter (it speculates, or a plugin
  starting_drafter                          trains one), its starting folder (a cached warm-up, whose
                                            draft vocabulary the warm-up chooses, or a saved folder)
                                            and the drafter itself over a policy
  rollout_backend                           the RolloutBackend `rollout.backend` names (BACKEND_FACTORIES)
Below this module nothing reads a recipe to build a part: the engines, backends and drafters
take explicit arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_cli.config import Recipe, RolloutBackendName, SpeculativeSection
from tlt_cli.engine.sampling import MIN_TEMPERATURE, SamplingParams
from tlt_cli.models.tiny import cache_directory
from tlt_cli.plugins import plugins_train_drafter
from tlt_cli.speculative.adaptive import Rule, RuleTableError, SpeculationMode, SpeculativePlan, build_rules
from tlt_cli.speculative.types import SpeculativeConfig

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tlt_cli.drafter.model import EagleDrafter
    from tlt_cli.drafter.warmup import WarmupProgress
    from tlt_cli.rollout.backend import RolloutBackend
    from tlt_cli.tasks.base import Task


def model_cache(recipe: Recipe) -> Path:
    """Where built models, measured plans and compiled DeepSpeed ops are cached (model.cache_dir or the default)."""
    return cache_directory(recipe.model.cache_dir)


def policy_and_tokenizer(recipe: Recipe) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The recipe's model, freshly loaded, and its tokenizer."""
    from tlt_cli.models.loading import load_policy

    return load_policy(recipe.model.path, trust_remote_code=recipe.model.trust_remote_code)


def reference_policy(recipe: Recipe) -> PreTrainedModel | None:
    """A frozen copy of the starting policy for the KL term (None when actor.kl_coef is 0)."""
    return policy_and_tokenizer(recipe)[0].eval() if recipe.actor.kl_coef > 0 else None


def task(recipe: Recipe) -> Task:
    """The recipe's task, with its options, seeded by run.seed."""
    from tlt_cli.tasks.registry import build_task

    return build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))


def sampling(recipe: Recipe) -> SamplingParams:
    """How the rollout samples (rollout.max_new_tokens, temperature, top_p, top_k)."""
    rollout = recipe.rollout
    return SamplingParams(
        max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k
    )


def speculation_mode(section: SpeculativeSection) -> SpeculationMode:
    """The section's `mode` as a plan carries it."""
    return SpeculationMode(section.mode.value)


def speculative_plan(section: SpeculativeSection) -> SpeculativePlan:
    """The recipe's `speculative` section as plain values. The rule table is parsed and checked here, in mode
    adaptive only (the other modes never read it): a RuleTableError naming speculative.rules and the rule, which
    the recipe checks (tlt_cli/recipe_checks.py) refuse the recipe with."""
    mode = speculation_mode(section)
    rules: tuple[Rule, ...] = ()
    if mode == SpeculationMode.adaptive:
        try:
            rules = tuple(build_rules([dict(rule) for rule in section.rules]))
        except RuleTableError as error:
            raise RuleTableError(f"speculative.rules: {error}") from None
    return SpeculativePlan(
        mode,
        SpeculativeConfig(section.steps, section.topk, section.draft_tokens),
        rules,
        section.collapse_accept_length,
        section.reprobe_steps,
        section.bandit_epsilon,
    )


def rollout_needs_drafter(mode: SpeculationMode, drafter_trained: bool) -> bool:
    """The one rule: a rollout needs a drafter when it speculates, or when something trains one."""
    return mode != SpeculationMode.off or drafter_trained


def drafter_needed(recipe: Recipe) -> bool:
    """Whether the recipe's run needs a drafter: it speculates, or a plugin it enables trains one."""
    return rollout_needs_drafter(speculation_mode(recipe.speculative), plugins_train_drafter(recipe.plugins.enabled))


def prepare_drafter(
    recipe: Recipe, cache: Path, progress: WarmupProgress | None = None
) -> tuple[Path | None, dict | None]:
    """(folder of the starting drafter or None for a random start, warm-up report if one ran now).

    With drafter.init warmup the drafter is trained once on the target's own generations and cached
    under `cache` (tlt_cli/drafter/initial.py keys it); a warm-up that runs reports its phases to
    `progress` (tlt_cli/drafter/warmup.py).
    """
    if not drafter_needed(recipe) or recipe.drafter.init == "random":
        return None, None
    if recipe.drafter.init != "warmup":
        return Path(recipe.drafter.init), None
    from tlt_cli.drafter.initial import cached_warmup, warmup_folder
    from tlt_cli.drafter.model import save_drafter
    from tlt_cli.drafter.warmup import warm_up_drafter

    folder = warmup_folder(recipe, cache)
    if cached_warmup(folder):
        return folder, None
    target, tokenizer = policy_and_tokenizer(recipe)
    drafter, report = warm_up_drafter(
        target,
        tokenizer,
        task(recipe),
        steps=recipe.drafter.warmup_steps,
        batch_size=recipe.drafter.warmup_batch_size,
        lr=recipe.drafter.warmup_lr,
        seed=recipe.run.seed,
        train_prompts=recipe.drafter.warmup_prompts,
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=max(recipe.rollout.temperature, MIN_TEMPERATURE),  # greedy runs warm up sampling
        draft_vocab_size=recipe.drafter.vocab_size,
        progress=progress,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter, folder)
    return folder, asdict(report)


def starting_drafter(recipe: Recipe, folder: Path | None, policy: PreTrainedModel) -> EagleDrafter:
    """A drafter over `policy` (it shares its embedding, norm and lm_head): loaded from `folder` (what
    `prepare_drafter` gave), or freshly initialised from run.seed."""
    from tlt_cli.drafter.model import EagleDrafter, load_drafter

    if folder is None:
        return EagleDrafter(policy, seed=recipe.run.seed)
    return load_drafter(folder, policy)


@dataclass(frozen=True)
class BackendPlace:
    """Where a worker's rollout backend runs: its rank, its index on its node, the run directory and model cache."""

    worker: int
    rank_on_node: int
    run_directory: Path
    cache_dir: Path | None = None


def _embedded(
    recipe: Recipe, policy: nn.Module, tokenizer: Any, drafter: nn.Module | None, place: BackendPlace
) -> RolloutBackend:
    from tlt_cli.rollout.embedded import EmbeddedRollout

    return EmbeddedRollout(
        policy,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        speculative_plan(recipe.speculative),
        drafter,
        seed=recipe.run.seed,
        linear_forms=recipe.rollout.linear_forms,
        cache_dir=place.cache_dir,
        dtype=recipe.rollout.dtype,
        rows=recipe.samples_per_worker,
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
        batch_rules(speculative_plan(recipe.speculative)),
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
