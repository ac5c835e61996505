"""The table of a recipe's value checks: the declared ranges, then the rules that span keys and sections.

`check_values(recipe)` takes a `Recipe` the loader built (keys, types and choices are right by then),
raises a `RecipeError` naming the key at the first value that cannot run, and returns the recipe's
speculative plan, built once. It runs the checks it lists in order: every number's range as the schema
declares it with the key (tlt_cli/config/ranges.py `range_problem`; nothing here restates one), then
the rules no single key holds: the run's folder names, a step's token count, the SD shapes and rule
table, the actor's placement against the workers and the hostfile, the SGLang section against the
workers. It reads no model, task data or plugin; tlt_cli/preflight.py runs it first, then checks those
(the whole check the commands run before anything starts). This module and tlt_cli/preflight.py are the
gate: the modules that know a rule only answer with values or a problem sentence, and the gate raises.
Those it asks: the schema's ranges, the hostfile parser, the SGLang section's and rule table's problems
(tlt_cli/sglang/config.py, tlt_cli/sglang/adaptive.py), the speculative plan (tlt_cli/training/setup.py
parses the rule table into it) and the SD shape problems (tlt_cli/speculative/shapes.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from tlt_cli.config import (
    CPU_DEVICES,
    DrafterConfig,
    DrafterStart,
    Recipe,
    RecipeError,
    RolloutBackendName,
    SpeculativeMode,
    SpeculativeSection,
    Trainer,
    is_control_character,
    load_recipe,
    number_problem,
    range_problem,
)
from tlt_cli.engine.sampling import MIN_TEMPERATURE
from tlt_cli.processes.hostfile import hostfile_problem, ranks_per_node, shell_paths
from tlt_cli.sglang.adaptive import one_algorithm_problem
from tlt_cli.sglang.config import sglang_config_problem
from tlt_cli.speculative.plan import SpeculationMode, SpeculativePlan
from tlt_cli.speculative.rules import RuleTableError
from tlt_cli.speculative.shapes import shape_problem, topk_fit_problem
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.setup import speculative_plan

# a TRL run generates with tlt's embedded engine, or with TRL's own generation (rollout.backend trl, the baseline)
TRL_BACKENDS = (RolloutBackendName.embedded, RolloutBackendName.trl)
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = ("builtin:tiny-arith",)
# the longest folder name Linux file systems take (NAME_MAX), in bytes
FOLDER_NAME_BYTES = 255
# what a shell reads as itself in a word (shlex.quote leaves such words alone); anything else is refused in run
# paths under a hostfile launch
SHELL_SAFE_PUNCTUATION = "@ % + = : , . / _ -"
SHELL_UNSAFE = re.compile(r"[^\w@%+=:,./-]", re.ASCII)
# what a recipe's integers must fit in: torch tensors and the trace's readers hold 64-bit integers
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


def check_values(recipe: Recipe) -> SpeculativePlan:
    """Raise RecipeError naming the key of the first value the recipe cannot run with: the table, in order.
    Returns the speculative plan it checked (built once), for the checks that need the model."""
    _check_numbers(recipe)  # every float finite, every integer within 64 bits
    _check_ranges(recipe)  # every number within the range its key declares (rollout.sglang: with that backend)
    _check_run(recipe)  # run.name, run.output_dir (a folder, printable, shell-safe under a hostfile)
    _check_train_and_workers(recipe)  # a step's token count, whole groups per worker
    _check_model_path(recipe.model.path)  # a built-in model's name, or a path
    plan = checked_speculative_plan(recipe.speculative)
    check_speculative_section(recipe.speculative, plan)  # SD shapes and the rule table's
    _check_drafter(recipe.drafter)  # drafter.init
    _check_plugins(recipe)  # plugins.enabled names, plugins.options for enabled plugins
    _check_actor_placement(recipe)  # actor.devices against workers and the hostfile
    _check_trainer(recipe)  # what train.trainer trl takes
    _check_temperature(recipe.rollout.temperature)  # 0 (greedy), or not so small the logits overflow
    if recipe.rollout.backend == RolloutBackendName.sglang:
        _check_sglang_backend(recipe, plan)  # rollout.sglang, and how it fits the workers and the rule table
    return plan


def _check_temperature(temperature: float) -> None:
    """rollout.temperature is 0 (greedy) or at least MIN_TEMPERATURE: logits divided by less overflow to inf (the
    schema's range says >= 0; this is the gap inside it)."""
    _require(
        temperature == 0.0 or temperature >= MIN_TEMPERATURE,
        f"rollout.temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {temperature}.",
    )


def _check_numbers(section: Any, prefix: str = "") -> None:
    """Every float key is a finite number, every integer key fits in 64 bits (config/ranges.py `number_problem`)."""
    refuse(number_problem(section, prefix))


def _check_ranges(recipe: Recipe) -> None:
    """Each section's own keys against the ranges the schema declares with them (rollout.sglang is a section of
    its own, checked with the rest of it when that backend runs)."""
    for section_field in dataclasses.fields(recipe):
        section = getattr(recipe, section_field.name)
        if dataclasses.is_dataclass(section):
            refuse(range_problem(section, f"{section_field.name}."))


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
    step_tokens = train.prompts_per_step * train.group_size * recipe.rollout.max_new_tokens
    _require(
        step_tokens <= MAX_STEP_TOKENS,
        f"a step would generate up to {step_tokens:,} tokens (train.prompts_per_step x train.group_size x "
        f"rollout.max_new_tokens), more than any machine holds (at most 2^40); lower one of them.",
    )
    _require(
        train.prompts_per_step % workers.count == 0,
        f"train.prompts_per_step ({train.prompts_per_step}) must be a multiple of workers.count "
        f"({workers.count}) so every worker gets whole groups.",
    )


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
    """actor.devices and workers.hostfile: possible on some machine (CUDA is checked at run time)."""
    devices = recipe.actor.devices
    on_gpus = devices != CPU_DEVICES
    if on_gpus:
        _require(
            isinstance(devices, list)
            and len(devices) >= 1
            and all(isinstance(device, int) and not isinstance(device, bool) and device >= 0 for device in devices),
            f"actor.devices must be cpu or a list of GPU indices like [0, 1], got {devices!r}.",
        )
        _require(len(set(devices)) == len(devices), f"actor.devices lists a GPU twice: {devices}.")
    if recipe.workers.hostfile is None:
        _require(
            not on_gpus or len(devices) == recipe.workers.count,
            f"actor.devices lists {len(devices) if on_gpus else 0} GPUs for workers.count {recipe.workers.count}; "
            "give one GPU per worker rank.",
        )
        return
    refuse(hostfile_problem(recipe), "workers.hostfile: ")


def _check_sglang_backend(recipe: Recipe, plan: SpeculativePlan) -> None:
    """rollout.sglang on its own, then how it fits the workers and the speculative `plan`."""
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
    if plan.mode == SpeculationMode.adaptive:
        refuse(one_algorithm_problem(plan.configs), "speculative.rules: ")


def check_speculative_section(section: SpeculativeSection, plan: SpeculativePlan) -> None:
    """The fixed shape of `section` and (mode adaptive) the rule table's, which `plan` (made from `section`)
    holds. Whether the shapes fit the drafter's vocabulary needs the model: `check_shapes_fit_draft_vocabulary`."""
    refuse(shape_problem(SpeculativeConfig(section.steps, section.topk, section.draft_tokens)), "speculative: ")
    for where, config in _rule_shapes(plan):
        refuse(shape_problem(config), f"{where}: ")


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
        refuse(topk_fit_problem(config, draft_vocab_size), f"{where}: ")


def _rule_shapes(plan: SpeculativePlan) -> list[tuple[str, SpeculativeConfig]]:
    """(where, shape) of every SD configuration of the rule table (empty unless the plan is adaptive)."""
    return [
        (f"speculative.rules: rule {number}", config)
        for number, rule in enumerate(plan.rules, start=1)
        for config in rule.configs
        if config is not None
    ]


def _check_drafter(drafter: DrafterConfig) -> None:
    _require(
        drafter.init in DrafterStart.__members__ or Path(drafter.init).is_dir(),
        f"drafter.init must be auto, online, warmup, random or a drafter folder, got '{drafter.init}'.",
    )


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
