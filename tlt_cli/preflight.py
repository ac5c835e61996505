"""The whole check of a recipe before anything starts: the one `validate`, `train`, `profile` and `calibrate` run.

`check_recipe(recipe, new_run)` raises a `RecipeError` naming the key (and the file, where one is
at fault) at the first problem, reading what the recipe names but building and writing nothing:
  1. values, ranges and how the sections fit (tlt_cli/recipe_checks.py);
  2. the task: its name, its options by the types and ranges it declares, its data files (a bad
     line is named), by building it;
  3. the model folder: no code of its own runs unless model.trust_remote_code says so, its config and
     tokenizer load (not the weights), the shapes in its safetensors headers fit the config, the
     tokenizer fits the model's vocabulary and encodes the task's first prompt (its chat template);
  4. a drafter folder given as drafter.init holds a drafter (its config readable, its weights' hash),
     and the SD shapes and the rule table fit the draft vocabulary of the drafter the run starts
     with (topk <= N);
  5. every plugin resolves to a class with worker or driver hooks (tlt_cli/plugins.py) that takes
     its options (so `os:system` is refused); under train.trainer trl, only driver-side plugins
     (loggers) and one that trains the drafter between TRL's processes;
  6. the run directory <run.output_dir>/<run.name> can be created, and (new_run) holds no run yet; the
     cache folder (model.cache_dir or $TLT_CACHE_DIR) is writable;
  7. with train.trainer trl: the installed TRL is supported and its GRPOConfig takes the recipe's
     settings and trl section (tlt_cli/integrations/trl_recipe.py; this imports TRL).
`tlt recipes validate` says ok exactly when this passes, so `tlt train` starts. What the machine
lacks is checked when a run starts, so a GPU recipe validates on a laptop: `check_memory(recipe)`, the
workers' estimated memory (tlt_cli/training/memory.py; tlt_cli/trainers.py calls it), then
`check_machine(recipe)`, the GPUs, SGLang and /dev/shm the recipe needs (tlt_cli/processes/machine_checks.py; the
driver calls it once the run to resume is known).

With tlt_cli/recipe_checks.py this module is the recipe gate, the only code that raises `RecipeError` for a
recipe that has loaded: the modules that know a rule (the SGLang section, the hostfile, the TRL section, the
memory estimate, the machine) return a problem sentence or None, and the gate refuses with it (`refuse`).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from tlt_cli.config import (
    FRESH_DRAFTER_STARTS,
    DrafterStart,
    PluginsConfig,
    Recipe,
    RecipeError,
    RolloutBackendName,
    RunConfig,
    Trainer,
)
from tlt_cli.drafter.model import CONFIG_FILE, read_drafter_metadata
from tlt_cli.drafter.vocabulary import resolve_draft_vocab_size
from tlt_cli.errors import UserError, nearest_existing
from tlt_cli.models.loading import check_weight_shapes, load_config_and_tokenizer, model_folder
from tlt_cli.models.tiny import cache_directory
from tlt_cli.plugins import DRIVER_HOOKS, WORKER_HOOKS, plugin_factory
from tlt_cli.processes.machine_checks import machine_problem
from tlt_cli.processes.run_directory import holds_run
from tlt_cli.recipe_checks import check_shapes_fit_draft_vocabulary, check_values, refuse
from tlt_cli.tasks.prompts import ChatTemplateTooSlow, encode_prompt
from tlt_cli.training import setup
from tlt_cli.training.memory import memory_problem

PLUGIN_HOOKS = WORKER_HOOKS + DRIVER_HOOKS


def check_recipe(recipe: Recipe, new_run: bool = False) -> None:
    """Raise RecipeError naming the key (and file) of the first problem that would stop a run of `recipe`."""
    plan = check_values(recipe)  # 1. values (tlt_cli/recipe_checks.py), and the speculative plan it built
    _check_task(recipe)  # 2. the task
    target_vocab_size = _check_model(recipe)  # 3. the model folder
    draft_vocab_size = _check_drafter_start(recipe, target_vocab_size)  # 4. the starting drafter
    check_shapes_fit_draft_vocabulary(plan, draft_vocab_size)
    _check_plugins(recipe.plugins)  # 5. the plugins
    if recipe.train.trainer == Trainer.trl:
        _check_trl_plugins(recipe)
    check_output_folder(recipe.run, new_run)  # 6. the run directory and the cache folder
    check_cache_folder(recipe)
    if recipe.train.trainer == Trainer.trl:  # 7. TRL's GRPOConfig
        from tlt_cli.integrations.trl_recipe import trl_recipe_problem

        refuse(trl_recipe_problem(recipe))


def check_memory(recipe: Recipe) -> None:
    """Raise RecipeError naming what to lower when the run's workers would not fit in this machine's memory."""
    refuse(memory_problem(recipe))


def check_machine(recipe: Recipe) -> None:
    """Raise RecipeError naming the key when this machine lacks the GPUs or the SGLang the recipe asks for, or the
    writable /dev/shm its processes need."""
    refuse(machine_problem(recipe))


def _check_task(recipe: Recipe) -> None:
    try:
        setup.task(recipe)
    except UserError as error:
        raise RecipeError(str(error)) from None


def _check_model(recipe: Recipe) -> int:
    """The model's (the target's) vocabulary size, once its config and tokenizer load and the tokenizer encodes
    the task's first prompt (through its chat template, as the workers will)."""
    try:
        config, tokenizer = load_config_and_tokenizer(recipe.model.path, recipe.model.trust_remote_code)
        check_weight_shapes(model_folder(recipe.model.path), config, recipe.model.trust_remote_code)
    except UserError as error:
        raise RecipeError(f"model.path: {error}") from None
    if len(tokenizer) > config.vocab_size:
        raise RecipeError(
            f"model.path: the tokenizer of {recipe.model.path} has {len(tokenizer)} tokens but the model's "
            f"vocabulary holds {config.vocab_size}; the tokenizer belongs to another model."
        )
    _check_prompt_encoding(recipe, tokenizer)
    return int(config.vocab_size)


def _check_prompt_encoding(recipe: Recipe, tokenizer: Any) -> None:
    prompt = setup.task(recipe).problem(0).prompt
    try:
        encode_prompt(tokenizer, prompt)
    except ChatTemplateTooSlow as error:
        raise RecipeError(f"model.path {model_folder(recipe.model.path)}: {error}") from None
    except Exception as error:  # the chat template is the folder's own Jinja code: any error is the folder's
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(
            f"model.path: the chat template of the tokenizer in {model_folder(recipe.model.path)} fails on the "
            f"task's first prompt ({reason}); fix chat_template in its tokenizer_config.json."
        ) from None


def check_cache_folder(recipe: Recipe) -> None:
    """The tlt cache (model.cache_dir, else $TLT_CACHE_DIR or ~/.cache/tlt) is a folder tlt can write, or can be
    made."""
    cache = cache_directory(recipe.model.cache_dir)
    key = "model.cache_dir" if recipe.model.cache_dir else "the cache folder ($TLT_CACHE_DIR, else ~/.cache/tlt)"
    existing = nearest_existing(cache)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "not a folder" if not existing.is_dir() else "not writable"
        raise RecipeError(
            f"{key}: {cache} cannot hold tlt's cache (built models, drafter warm-ups, compiled ops): {existing} is "
            f"{what}; point it at a writable folder."
        )


def _check_drafter_start(recipe: Recipe, target_vocab_size: int) -> int:
    """N, the draft vocabulary of the drafter the run starts with: the warm-up's (drafter.vocab_size
    for this target), all of the target's (random; and auto's bound, whichever drafter tlt holds), or a saved
    drafter's own, once its folder checks."""
    init = recipe.drafter.init
    if init in FRESH_DRAFTER_STARTS or init == DrafterStart.auto:
        return target_vocab_size
    if init == DrafterStart.warmup:
        return resolve_draft_vocab_size(recipe.drafter.vocab_size, target_vocab_size)
    if not (Path(init) / CONFIG_FILE).is_file():
        raise RecipeError(
            f"drafter.init: {init} is not a drafter folder (it has no {CONFIG_FILE}); give auto, online, warmup, "
            "random or a folder tlt saved a drafter in."
        )
    try:
        return read_drafter_metadata(Path(init))["draft_vocab_size"]
    except UserError as error:
        raise RecipeError(f"drafter.init: {error}") from None


def _check_plugins(plugins: PluginsConfig) -> None:
    for name in plugins.enabled:
        factory = _plugin_factory(name)
        if not inspect.isclass(factory) or not any(callable(getattr(factory, hook, None)) for hook in PLUGIN_HOOKS):
            kind = "a class without any hook" if inspect.isclass(factory) else f"a {type(factory).__name__}"
            raise RecipeError(
                f"plugins.enabled: '{name}' is {kind}, not a plugin; a plugin is a class with some of the "
                f"hooks {', '.join(PLUGIN_HOOKS)}."
            )
        options = plugins.options.get(name, {})
        try:
            inspect.signature(factory).bind(recipe=None, **options)
        except TypeError as error:
            raise RecipeError(
                f"plugins.options.{name}: plugin '{name}' cannot be built with recipe= and the options "
                f"{sorted(options)} ({error})."
            ) from None


def _check_trl_plugins(recipe: Recipe) -> None:
    """A TRL run drives no worker hooks: it takes loggers, and a drafter-training plugin TRL's processes can run."""
    for name in recipe.plugins.enabled:
        factory = _plugin_factory(name)
        trains_drafter = getattr(factory, "trains_drafter", False)
        if recipe.rollout.backend == RolloutBackendName.trl and trains_drafter:
            raise RecipeError(
                f"plugins.enabled: {name} trains the drafter, which rollout.backend trl (TRL's own generation) "
                "does not use; leave it out of plugins.enabled."
            )
        if any(hasattr(factory, hook) for hook in WORKER_HOOKS) and not hasattr(factory, "trl_process_sidecar"):
            raise RecipeError(
                f"plugins.enabled: {name} hooks into tlt's own worker loop, which a TRL run does not run; a TRL "
                "run takes plugins with driver-side hooks only (loggers) and one that trains the drafter."
            )


def _plugin_factory(name: str) -> Any:
    try:
        return plugin_factory(name)
    except UserError as error:
        raise RecipeError(f"plugins.enabled: {error}") from None
    except Exception as error:  # the plugin's own module failed to import: the user's code, not tlt's
        raise RecipeError(
            f"plugins.enabled: plugin '{name}' cannot be imported ({type(error).__name__}: {error})."
        ) from None


def check_output_folder(run: RunConfig, new_run: bool) -> None:
    """The run directory <output_dir>/<name> can be created (every existing part is a writable folder).

    With new_run, it must not hold a run already (`tlt train` refuses to mix two runs in one folder).
    """
    run_directory = Path(run.output_dir).expanduser() / run.name
    try:
        _check_run_directory(run_directory, new_run)
    except OSError as error:  # a path the file system refuses (a part too long, too many links)
        raise RecipeError(
            f"run.output_dir: the run directory {run_directory} cannot be created ({error.strerror or error})."
        ) from None


def _check_run_directory(run_directory: Path, new_run: bool) -> None:
    existing = nearest_existing(run_directory)
    key = "run.name" if existing == run_directory else "run.output_dir"
    if not existing.is_dir():
        raise RecipeError(
            f"{key}: {existing} is a file, not a folder, so the run directory {run_directory} cannot be "
            "created; choose another run.output_dir."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"{key}: the run directory {run_directory} cannot be created: {existing} is not writable.")
    if new_run and holds_run(run_directory):
        raise RecipeError(
            f"run.name: the run directory {run_directory} already holds a run; resume it with "
            f"--resume {run_directory} or choose another name with run.name=<name>."
        )
