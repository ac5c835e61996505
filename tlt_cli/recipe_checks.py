"""Checks of a recipe's values: ranges, choices, and how its sections fit together.

`check_values(recipe)` takes a `Recipe` the loader built (keys and types are right by then) and
raises a `RecipeError` naming the key at the first value that cannot run: a range, a choice, an
SD shape or rule table, the actor's placement against the workers and the hostfile, the SGLang
section against the workers. It reads no model, task data or plugin; tlt_cli/preflight.py runs it
first, then checks those (the whole check the commands run before anything starts). It imports the
hostfile parser, the SGLang section's checks, the rule table and the SD shape check, which is why
it is not part of tlt_cli/config.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from tlt_cli.config import (
    CPU_DEVICES,
    DrafterConfig,
    Recipe,
    RecipeError,
    SpeculativeMode,
    SpeculativeSection,
    Trainer,
    load_recipe,
)
from tlt_cli.engine.linear_forms_measure import LINEAR_FORM_MODES
from tlt_cli.processes.hostfile import HostfileError, check_hostfile, ranks_per_node
from tlt_cli.sglang.adaptive import batch_rules
from tlt_cli.sglang.config import validate_sglang_config
from tlt_cli.speculative.adaptive import RuleTableError, build_rules
from tlt_cli.speculative.decoder import check_speculative_config, check_topk_fits
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.update_precision import PRECISIONS

ROLLOUT_BACKENDS = ("embedded", "sglang", "trl")
# a TRL run generates with tlt's embedded engine, or with TRL's own generation (rollout.backend trl, the baseline)
TRL_BACKENDS = ("embedded", "trl")
DRAFTER_STARTS = ("warmup", "random")
# ZeRO-3 shards the parameters; the rollout (embedded engine or weight push) needs the whole policy
ZERO_STAGES = (0, 1, 2)
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("builtin:tiny-arith",)
# the longest folder name Linux file systems take (NAME_MAX), in bytes
FOLDER_NAME_BYTES = 255
# what a shell reads as itself in a word (shlex.quote leaves such words alone); anything else is refused in run
# paths under a hostfile launch
SHELL_SAFE_PUNCTUATION = "@ % + = : , . / _ -"
SHELL_UNSAFE = re.compile(r"[^\w@%+=:,./-]", re.ASCII)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def load_checked_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """`load_recipe` then `check_values`: a recipe whose keys, types and values are right."""
    recipe = load_recipe(path, overrides)
    check_values(recipe)
    return recipe


def check_values(recipe: Recipe) -> None:
    """Raise RecipeError naming the key of the first value the recipe cannot run with."""
    _check_finite(recipe)
    _check_run(recipe)
    _check_train_and_workers(recipe)
    _check_rollout(recipe)
    _check_actor(recipe)
    _require(
        recipe.checkpoint.every >= 1,
        f"checkpoint.every must be at least 1 (steps between checkpoints), got {recipe.checkpoint.every}.",
    )
    _require(recipe.checkpoint.keep >= 1, f"checkpoint.keep must be at least 1, got {recipe.checkpoint.keep}.")
    _check_model_path(recipe.model.path)
    check_speculative_section(recipe.speculative)
    _check_drafter(recipe.drafter)
    _check_plugins(recipe)
    _check_actor_placement(recipe)
    _check_trainer(recipe)
    if recipe.rollout.backend == "sglang":
        _check_sglang_backend(recipe)


def _check_finite(section: Any, prefix: str = "") -> None:
    """Every float key is a finite number (YAML reads .inf and .nan as floats)."""
    for key_field in dataclasses.fields(section):
        value, key = getattr(section, key_field.name), f"{prefix}{key_field.name}"
        if dataclasses.is_dataclass(value):
            _check_finite(value, f"{key}.")
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{key} must be a finite number, got {value}.")


def _check_run(recipe: Recipe) -> None:
    name = recipe.run.name
    _require(
        name.strip() != "" and "/" not in name and name not in (".", "..") and "\0" not in name,
        f"run.name must be a folder name (not empty, '.' or '..', no '/'), got '{name}'.",
    )
    _require(
        recipe.run.output_dir.strip() != "" and "\0" not in recipe.run.output_dir,
        f"run.output_dir must name a folder, got '{recipe.run.output_dir}'.",
    )
    _require(
        len(name.encode("utf-8", "surrogateescape")) <= FOLDER_NAME_BYTES,
        f"run.name is {len(name.encode('utf-8', 'surrogateescape'))} bytes long, more than a folder name may be "
        f"({FOLDER_NAME_BYTES}); choose a shorter run.name.",
    )
    if recipe.workers.hostfile is not None:
        # the launcher hands the run directory to pdsh, which passes it through a remote shell
        for key, value in (("run.name", name), ("run.output_dir", recipe.run.output_dir)):
            unsafe = sorted(set(SHELL_UNSAFE.findall(value)))
            _require(
                not unsafe,
                f"{key} holds {' '.join(repr(character) for character in unsafe)}, which a hostfile launch would "
                f"pass through a shell; use letters, digits and {SHELL_SAFE_PUNCTUATION} only.",
            )


def _check_train_and_workers(recipe: Recipe) -> None:
    train, workers = recipe.train, recipe.workers
    _require(train.steps >= 1, f"train.steps must be at least 1, got {train.steps}.")
    _require(train.prompts_per_step >= 1, f"train.prompts_per_step must be at least 1, got {train.prompts_per_step}.")
    _require(
        train.group_size >= 2,
        f"train.group_size must be at least 2 (GRPO compares responses within a group), got {train.group_size}.",
    )
    _require(workers.count >= 1, f"workers.count must be at least 1, got {workers.count}.")
    _require(
        train.prompts_per_step % workers.count == 0,
        f"train.prompts_per_step ({train.prompts_per_step}) must be a multiple of workers.count "
        f"({workers.count}) so every worker gets whole groups.",
    )
    _require(
        workers.threads_per_worker >= 1,
        f"workers.threads_per_worker must be at least 1, got {workers.threads_per_worker}.",
    )
    _require(
        workers.step_timeout_s >= 0,
        f"workers.step_timeout_s must be >= 0 (0: no limit), got {workers.step_timeout_s}.",
    )


def _check_rollout(recipe: Recipe) -> None:
    rollout = recipe.rollout
    _require(
        rollout.backend in ROLLOUT_BACKENDS,
        f"rollout.backend must be one of {', '.join(ROLLOUT_BACKENDS)}, got '{rollout.backend}'.",
    )
    _require(rollout.max_new_tokens >= 1, f"rollout.max_new_tokens must be at least 1, got {rollout.max_new_tokens}.")
    _require(rollout.temperature >= 0.0, f"rollout.temperature must be >= 0 (0 is greedy), got {rollout.temperature}.")
    _require(0.0 < rollout.top_p <= 1.0, f"rollout.top_p must be in (0, 1], got {rollout.top_p}.")
    _require(rollout.top_k >= 0, f"rollout.top_k must be >= 0 (0 keeps all tokens), got {rollout.top_k}.")
    _require(
        rollout.linear_forms in LINEAR_FORM_MODES,
        f"rollout.linear_forms must be one of {', '.join(LINEAR_FORM_MODES)}, got '{rollout.linear_forms}'.",
    )


def _check_actor(recipe: Recipe) -> None:
    actor = recipe.actor
    _require(actor.lr > 0.0, f"actor.lr must be positive, got {actor.lr}.")
    _require(actor.weight_decay >= 0.0, f"actor.weight_decay must be >= 0, got {actor.weight_decay}.")
    _require(
        actor.zero_stage in ZERO_STAGES,
        f"actor.zero_stage must be 0, 1 or 2 (the rollout needs the full policy on every rank), "
        f"got {actor.zero_stage}.",
    )
    _require(actor.micro_batch_size >= 1, f"actor.micro_batch_size must be at least 1, got {actor.micro_batch_size}.")
    _require(0.0 < actor.clip_ratio < 1.0, f"actor.clip_ratio must be in (0, 1), got {actor.clip_ratio}.")
    _require(actor.kl_coef >= 0.0, f"actor.kl_coef must be >= 0, got {actor.kl_coef}.")
    _require(actor.ppo_epochs >= 1, f"actor.ppo_epochs must be at least 1, got {actor.ppo_epochs}.")
    _require(actor.grad_clip > 0.0, f"actor.grad_clip must be positive, got {actor.grad_clip}.")


def _check_trainer(recipe: Recipe) -> None:
    """What a TRL run takes (TRL's own settings are checked by tlt_cli/preflight.py)."""
    trainer, backend = recipe.train.trainer, recipe.rollout.backend
    if trainer != Trainer.trl:
        _require(
            not recipe.trl,
            f"trl.{next(iter(recipe.trl), '')} is set but train.trainer is {trainer}; set "
            "train.trainer: trl or remove the trl section.",
        )
        _require(backend != "trl", "rollout.backend trl (TRL's own generation) needs train.trainer: trl.")
        return
    _require(
        backend in TRL_BACKENDS,
        f"rollout.backend {backend} does not run under train.trainer trl; use {' or '.join(TRL_BACKENDS)}.",
    )
    _require(
        recipe.workers.hostfile is None,
        "workers.hostfile is not supported with train.trainer trl yet; its "
        "processes run on this machine (remove workers.hostfile).",
    )
    _require(
        recipe.rollout.temperature > 0.0,
        "rollout.temperature must be > 0 with train.trainer trl (TRL divides its log-probs by it).",
    )
    completions = recipe.train.prompts_per_step * recipe.train.group_size // recipe.workers.count
    _require(
        completions % recipe.actor.micro_batch_size == 0,
        f"actor.micro_batch_size ({recipe.actor.micro_batch_size}) must divide the {completions} completions each "
        "TRL process trains on per step (train.prompts_per_step x train.group_size / workers.count).",
    )
    if backend == "trl":
        # a plugin that trains the drafter is refused with it too, where plugins resolve (tlt_cli/preflight.py)
        _require(
            recipe.speculative.mode == SpeculativeMode.off,
            "rollout.backend trl (TRL's own generation) does not speculate; set speculative.mode: off.",
        )


def _check_actor_placement(recipe: Recipe) -> None:
    """actor.devices, actor.precision and workers.hostfile: possible on some machine (CUDA is checked at run time)."""
    devices, precision = recipe.actor.devices, recipe.actor.precision
    on_gpus = devices != CPU_DEVICES
    if on_gpus:
        _require(
            isinstance(devices, list)
            and len(devices) >= 1
            and all(isinstance(device, int) and not isinstance(device, bool) and device >= 0 for device in devices),
            f"actor.devices must be cpu or a list of GPU indices like [0, 1], got {devices!r}.",
        )
        _require(len(set(devices)) == len(devices), f"actor.devices lists a GPU twice: {devices}.")
    _require(precision in PRECISIONS, f"actor.precision must be one of {', '.join(PRECISIONS)}, got '{precision}'.")
    if recipe.workers.hostfile is None:
        _require(
            not on_gpus or len(devices) == recipe.workers.count,
            f"actor.devices lists {len(devices) if on_gpus else 0} GPUs for workers.count {recipe.workers.count}; "
            "give one GPU per worker rank.",
        )
        return
    try:
        check_hostfile(recipe)
    except HostfileError as error:
        raise RecipeError(f"workers.hostfile: {error}") from None


def _check_sglang_backend(recipe: Recipe) -> None:
    """rollout.sglang on its own, then how it fits the workers and the speculative section."""
    config = recipe.rollout.sglang
    validate_sglang_config(config)
    # every node runs its own servers for its own ranks
    node_ranks = ranks_per_node(recipe)
    _require(
        config.server_count % node_ranks == 0,
        f"rollout.sglang.gpus gives {config.server_count} server(s) of tp_size {config.tp_size} for {node_ranks} "
        "worker ranks per node; each worker owns whole servers, so give a multiple of that.",
    )
    _require(
        not config.colocated or recipe.actor.devices != CPU_DEVICES,
        "rollout.sglang.colocated: true sends the actor's CUDA tensors to the servers, so actor.devices must list "
        "GPUs; with the actor on cpu set rollout.sglang.colocated: false (weights go through a checkpoint on disk).",
    )
    try:
        batch_rules(recipe.speculative)
    except RecipeError as error:
        raise RecipeError(f"speculative.rules: {error}") from None


def check_speculative_section(section: SpeculativeSection) -> None:
    """The fixed shape, the decoder's settings and (mode adaptive) the rule table. Whether the shapes
    fit the drafter's vocabulary needs the model: `check_shapes_fit_draft_vocabulary`."""
    where, fixed = _fixed_shape(section)
    _check_shape(where, fixed)
    _require(
        section.collapse_accept_length >= 1.0,
        "speculative.collapse_accept_length must be >= 1 (1 means no draft accepted), "
        f"got {section.collapse_accept_length}.",
    )
    _require(section.reprobe_steps >= 1, f"speculative.reprobe_steps must be at least 1, got {section.reprobe_steps}.")
    _require(
        0.0 <= section.bandit_epsilon <= 1.0,
        f"speculative.bandit_epsilon must be in [0, 1], got {section.bandit_epsilon}.",
    )
    for where, config in _rule_shapes(section):
        _check_shape(where, config)


def check_shapes_fit_draft_vocabulary(section: SpeculativeSection, draft_vocab_size: int) -> None:
    """Every shape the section names branches over at most the drafter's `draft_vocab_size` tokens."""
    for where, config in [_fixed_shape(section), *_rule_shapes(section)]:
        try:
            check_topk_fits(config, draft_vocab_size)
        except ValueError as error:
            raise RecipeError(f"{where}: {error}") from None


def _fixed_shape(section: SpeculativeSection) -> tuple[str, SpeculativeConfig]:
    """(where an error names it, the shape of mode fixed)."""
    return "speculative", SpeculativeConfig(section.steps, section.topk, section.draft_tokens)


def _rule_shapes(section: SpeculativeSection) -> list[tuple[str, SpeculativeConfig]]:
    """(where, shape) of every SD configuration of the rule table, in mode adaptive (the table is unused otherwise)."""
    if section.mode != SpeculativeMode.adaptive:
        return []
    try:
        rules = build_rules([dict(rule) for rule in section.rules])
    except RuleTableError as error:
        raise RecipeError(f"speculative.rules: {error}") from None
    return [
        (f"speculative.rules: rule {number}", config)
        for number, rule in enumerate(rules, start=1)
        for config in rule.configs
        if config is not None
    ]


def _check_shape(where: str, config: SpeculativeConfig) -> None:
    try:
        check_speculative_config(config)
    except ValueError as error:
        raise RecipeError(f"{where}: {error}") from None


def _check_drafter(drafter: DrafterConfig) -> None:
    _require(
        drafter.init in DRAFTER_STARTS or Path(drafter.init).is_dir(),
        f"drafter.init must be warmup, random or a drafter folder, got '{drafter.init}'.",
    )
    for key in ("warmup_steps", "warmup_prompts", "warmup_batch_size", "window_steps", "batch_size"):
        _require(getattr(drafter, key) >= 1, f"drafter.{key} must be at least 1, got {getattr(drafter, key)}.")
    _require(drafter.warmup_lr > 0, f"drafter.warmup_lr must be positive, got {drafter.warmup_lr}.")
    _require(drafter.lr > 0, f"drafter.lr must be positive, got {drafter.lr}.")
    _require(drafter.weight_decay >= 0, f"drafter.weight_decay must be >= 0, got {drafter.weight_decay}.")
    _require(drafter.vocab_size >= 0, f"drafter.vocab_size must be >= 0 (0: the default), got {drafter.vocab_size}.")


def _check_plugins(recipe: Recipe) -> None:
    plugins = recipe.plugins
    for name in plugins.enabled:
        _require(name.strip() != "", "plugins.enabled lists an empty name; give entry-point names or module:attribute.")
    for name, options in plugins.options.items():
        _require(name in plugins.enabled, f"plugins.options.{name} is set but '{name}' is not in plugins.enabled.")
        _require(
            isinstance(options, dict), f"plugins.options.{name} must be a mapping of keyword options, got {options!r}."
        )


def _check_model_path(path: str) -> None:
    if path.startswith(BUILTIN_PREFIX):
        _require(
            path in BUILTIN_MODELS,
            f"model.path '{path}' is not a built-in model; the built-in model is {', '.join(BUILTIN_MODELS)}.",
        )
        return
    _require(path.strip() != "", "model.path is empty; give a local Hugging Face model folder or builtin:tiny-arith.")
