"""The table of a recipe's value checks: ranges, choices, and how its sections fit together.

`check_values(recipe)` takes a `Recipe` the loader built (keys and types are right by then) and
raises a `RecipeError` naming the key at the first value that cannot run, running the section
checks it lists in order: a range, a choice, an SD shape or rule table, the actor's placement
against the workers and the hostfile, the SGLang section against the workers. It reads no model,
task data or plugin; tlt_cli/preflight.py runs it first, then checks those (the whole check the
commands run before anything starts). This module and tlt_cli/preflight.py are the gate: the
modules that know a rule only answer with values or a problem sentence, and the gate raises.
Those it asks: the hostfile parser, the SGLang section's and rule table's problems
(tlt_cli/sglang/config.py, tlt_cli/sglang/adaptive.py), the speculative plan
(tlt_cli/training/setup.py parses the rule table into it) and the decoder's SD shape check.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path
from typing import Any

from tlt_cli.checkpoint import MAX_STEPS
from tlt_cli.config import (
    CPU_DEVICES,
    DrafterConfig,
    Recipe,
    RecipeError,
    RolloutBackendName,
    SpeculativeMode,
    SpeculativeSection,
    Trainer,
    is_control_character,
    load_recipe,
)
from tlt_cli.engine.sampling import MIN_TEMPERATURE
from tlt_cli.processes.hostfile import hostfile_problem, ranks_per_node, shell_paths
from tlt_cli.rollout.backend import MAX_SEED
from tlt_cli.sglang.adaptive import one_algorithm_problem
from tlt_cli.sglang.config import sglang_config_problem
from tlt_cli.speculative.adaptive import RuleTableError, SpeculationMode, SpeculativePlan
from tlt_cli.speculative.decoder import check_speculative_config, check_topk_fits
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.rollout_correction import CORRECTION_MODES
from tlt_cli.training.setup import speculative_plan
from tlt_cli.training.update_precision import PRECISIONS
from tlt_cli.tuning.linear_forms import LINEAR_FORM_MODES
from tlt_cli.tuning.precision import ROLLOUT_DTYPE_SETTINGS

# a TRL run generates with tlt's embedded engine, or with TRL's own generation (rollout.backend trl, the baseline)
TRL_BACKENDS = (RolloutBackendName.embedded, RolloutBackendName.trl)
DRAFTER_STARTS = ("warmup", "random")
# the largest cap of the rollout correction's importance weights: a weight, times a log-ratio and summed over a
# batch's tokens, must stay far inside float32's range (3.4e38) so the loss stays finite
MAX_CORRECTION_CAP = 1e4
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
# what a recipe's integers must fit in: torch tensors and the trace's readers hold 64-bit integers
INTEGER_BITS = 64
# the most tokens one step may generate (train.prompts_per_step x train.group_size x rollout.max_new_tokens):
# their token ids alone, 8 bytes each, would fill 8 TiB, beyond the memory of any machine a run starts on
MAX_STEP_TOKENS = 2**40


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def refuse(problem: str | None, key: str = "") -> None:
    """Raise RecipeError with `problem`, the sentence a module that knows the rule returned (None: no problem),
    after `key` when the sentence does not name it."""
    if problem is not None:
        raise RecipeError(f"{key}{problem}")


def load_checked_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """`load_recipe` then `check_values`: a recipe whose keys, types and values are right."""
    recipe = load_recipe(path, overrides)
    check_values(recipe)
    return recipe


def check_values(recipe: Recipe) -> None:
    """Raise RecipeError naming the key of the first value the recipe cannot run with: the table, in order."""
    _check_numbers(recipe)  # every float finite, every integer within 64 bits
    _check_run(recipe)  # run.name, run.output_dir (a folder, printable, shell-safe under a hostfile), run.seed
    _check_train_and_workers(recipe)  # train.*, workers.*, a step's token count
    _check_rollout(recipe)  # rollout.* but the SGLang section
    _check_actor(recipe)  # actor.* ranges and choices
    _check_checkpoint(recipe)  # checkpoint.every, checkpoint.keep
    _check_model_path(recipe.model.path)  # a built-in model's name, or a path
    check_speculative_section(recipe.speculative)  # SD shapes, the decoder's settings, the rule table
    _check_drafter(recipe.drafter)  # drafter.init and the drafter's training settings
    _check_plugins(recipe)  # plugins.enabled names, plugins.options for enabled plugins
    _check_actor_placement(recipe)  # actor.devices and actor.precision against workers and the hostfile
    _check_trainer(recipe)  # what train.trainer trl takes
    if recipe.rollout.backend == RolloutBackendName.sglang:
        _check_sglang_backend(recipe)  # rollout.sglang, and how it fits the workers and the rule table


def _check_numbers(section: Any, prefix: str = "") -> None:
    """Every float key is a finite number (YAML reads .inf and .nan as floats), every integer key fits in 64 bits
    (YAML integers have no bound; torch, NumPy and the trace's readers stop at 64 bits)."""
    for key_field in dataclasses.fields(section):
        value, key = getattr(section, key_field.name), f"{prefix}{key_field.name}"
        if dataclasses.is_dataclass(value):
            _check_numbers(value, f"{key}.")
        elif isinstance(value, float):
            _require(math.isfinite(value), f"{key} must be a finite number, got {value}.")
        elif isinstance(value, int) and not isinstance(value, bool):
            _require(
                -(2 ** (INTEGER_BITS - 1)) <= value < 2 ** (INTEGER_BITS - 1),
                f"{key} must fit in {INTEGER_BITS} bits (below 2^{INTEGER_BITS - 1} in size), got {value}.",
            )


def control_characters(text: str) -> list[str]:
    """The control characters (newline, tab, escape, DEL, ...) in `text`, which a terminal or a log would not show."""
    return sorted({character for character in text if is_control_character(character)})


def unknown_home(path: str) -> str | None:
    """The `~user` a path starts with when this machine cannot say where that user's home is, else None."""
    if not path.startswith("~"):
        return None
    head = path.split("/", 1)[0]
    return head if os.path.expanduser(head) == head else None


def _check_run(recipe: Recipe) -> None:
    name = recipe.run.name
    for key, value in (("run.name", name), ("run.output_dir", recipe.run.output_dir)):
        hidden = control_characters(value)
        _require(
            not hidden,
            f"{key} holds the control character{'s' if len(hidden) > 1 else ''} "
            f"{', '.join(repr(character) for character in hidden)}, which a terminal would not show; use printable "
            "characters only.",
        )
    home = unknown_home(recipe.run.output_dir)
    _require(
        home is None,
        f"run.output_dir starts with {home}, but this machine knows no home folder for it; write the folder out in "
        "full.",
    )
    _require(
        0 <= recipe.run.seed <= MAX_SEED,
        f"run.seed must be in 0..{MAX_SEED} (2^32 - 1, what the data and sampling generators take), got "
        f"{recipe.run.seed}.",
    )
    _require(
        name.strip() != "" and "/" not in name and name not in (".", ".."),
        f"run.name must be a folder name (not empty, '.' or '..', no '/'), got '{name}'.",
    )
    _require(
        recipe.run.output_dir.strip() != "",
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
            unsafe = _shell_characters(value)
            _require(
                not unsafe,
                f"{key} holds {unsafe}, which a hostfile launch would pass through a shell; use letters, digits "
                f"and {SHELL_SAFE_PUNCTUATION} only.",
            )
        for what, path in shell_paths(recipe):
            unsafe = _shell_characters(path)
            _require(
                not unsafe,
                f"workers.hostfile: {what} {path} holds {unsafe}, which the launcher's remote shell would read as "
                f"more than a path; run from, and into, folders named with letters, digits and "
                f"{SHELL_SAFE_PUNCTUATION} only.",
            )


def _shell_characters(text: str) -> str:
    """The characters of `text` a shell reads as more than part of a word, quoted one by one ("" when none)."""
    return " ".join(repr(character) for character in sorted(set(SHELL_UNSAFE.findall(text))))


def _check_train_and_workers(recipe: Recipe) -> None:
    train, workers = recipe.train, recipe.workers
    _require(
        1 <= train.steps <= MAX_STEPS,
        f"train.steps must be in 1..{MAX_STEPS} (what checkpoint names hold), got {train.steps}.",
    )
    _require(train.prompts_per_step >= 1, f"train.prompts_per_step must be at least 1, got {train.prompts_per_step}.")
    _require(
        train.group_size >= 2,
        f"train.group_size must be at least 2 (GRPO compares responses within a group), got {train.group_size}.",
    )
    step_tokens = train.prompts_per_step * train.group_size * recipe.rollout.max_new_tokens
    _require(
        step_tokens <= MAX_STEP_TOKENS,
        f"a step would generate up to {step_tokens:,} tokens (train.prompts_per_step x train.group_size x "
        f"rollout.max_new_tokens), more than any machine holds (at most 2^40); lower one of them.",
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
    _require(rollout.max_new_tokens >= 1, f"rollout.max_new_tokens must be at least 1, got {rollout.max_new_tokens}.")
    _require(
        rollout.temperature == 0.0 or rollout.temperature >= MIN_TEMPERATURE,
        f"rollout.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {rollout.temperature}.",
    )
    _require(0.0 < rollout.top_p <= 1.0, f"rollout.top_p must be in (0, 1], got {rollout.top_p}.")
    _require(rollout.top_k >= 0, f"rollout.top_k must be >= 0 (0 keeps all tokens), got {rollout.top_k}.")
    _require(
        rollout.linear_forms in LINEAR_FORM_MODES,
        f"rollout.linear_forms must be one of {', '.join(LINEAR_FORM_MODES)}, got '{rollout.linear_forms}'.",
    )
    _require(
        rollout.dtype in ROLLOUT_DTYPE_SETTINGS,
        f"rollout.dtype must be one of {', '.join(ROLLOUT_DTYPE_SETTINGS)}, got '{rollout.dtype}'.",
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
    _require(
        actor.rollout_correction in CORRECTION_MODES,
        f"actor.rollout_correction must be one of {', '.join(CORRECTION_MODES)}, got '{actor.rollout_correction}'.",
    )
    _require(
        1.0 < actor.rollout_correction_cap <= MAX_CORRECTION_CAP,
        f"actor.rollout_correction_cap must be greater than 1 and at most {MAX_CORRECTION_CAP:g} (importance weights "
        f"are truncated at it), got {actor.rollout_correction_cap}.",
    )


def _check_checkpoint(recipe: Recipe) -> None:
    _require(
        recipe.checkpoint.every >= 1,
        f"checkpoint.every must be at least 1 (steps between checkpoints), got {recipe.checkpoint.every}.",
    )
    _require(recipe.checkpoint.keep >= 1, f"checkpoint.keep must be at least 1, got {recipe.checkpoint.keep}.")


def _check_trainer(recipe: Recipe) -> None:
    """What a TRL run takes (TRL's own settings are checked by tlt_cli/preflight.py)."""
    trainer, backend = recipe.train.trainer, recipe.rollout.backend
    if trainer != Trainer.trl:
        _require(
            not recipe.trl,
            f"trl.{next(iter(recipe.trl), '')} is set but train.trainer is {trainer}; set "
            "train.trainer: trl or remove the trl section.",
        )
        _require(
            backend != RolloutBackendName.trl, "rollout.backend trl (TRL's own generation) needs train.trainer: trl."
        )
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
    if backend == RolloutBackendName.trl:
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
    refuse(hostfile_problem(recipe), "workers.hostfile: ")


def _check_sglang_backend(recipe: Recipe) -> None:
    """rollout.sglang on its own, then how it fits the workers and the speculative section."""
    config = recipe.rollout.sglang
    refuse(sglang_config_problem(config))
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
    plan = checked_speculative_plan(recipe.speculative)
    if plan.mode == SpeculationMode.adaptive:
        refuse(one_algorithm_problem(plan.configs), "speculative.rules: ")


def check_speculative_section(section: SpeculativeSection) -> None:
    """The fixed shape, the decoder's settings and (mode adaptive) the rule table. Whether the shapes
    fit the drafter's vocabulary needs the model: `check_shapes_fit_draft_vocabulary`."""
    _check_shape("speculative", SpeculativeConfig(section.steps, section.topk, section.draft_tokens))
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
    for where, config in _rule_shapes(checked_speculative_plan(section)):
        _check_shape(where, config)


def checked_speculative_plan(section: SpeculativeSection) -> SpeculativePlan:
    """The section as a plan (tlt_cli/training/setup.py parses the rule table); RecipeError naming
    speculative.rules and the rule it cannot read."""
    try:
        return speculative_plan(section)
    except RuleTableError as error:
        raise RecipeError(str(error)) from None


def check_shapes_fit_draft_vocabulary(plan: SpeculativePlan, draft_vocab_size: int) -> None:
    """Every shape the plan names branches over at most the drafter's `draft_vocab_size` tokens."""
    for where, config in [("speculative", plan.shape), *_rule_shapes(plan)]:
        try:
            check_topk_fits(config, draft_vocab_size)
        except ValueError as error:
            raise RecipeError(f"{where}: {error}") from None


def _rule_shapes(plan: SpeculativePlan) -> list[tuple[str, SpeculativeConfig]]:
    """(where, shape) of every SD configuration of the rule table (empty unless the plan is adaptive)."""
    return [
        (f"speculative.rules: rule {number}", config)
        for number, rule in enumerate(plan.rules, start=1)
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
