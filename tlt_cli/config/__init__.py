"""Recipes: the schema (typed, frozen dataclasses) and the loader (YAML merged with `key=value` overrides).

`load_recipe(path, overrides)` is the only way a recipe enters the program: it reads the file as
YAML 1.2, merges it and the overrides onto the schema's dataclasses with OmegaConf, and returns a
`Recipe` whose keys and types are right. Values (ranges, choices, how sections fit together, the
files a recipe names) are checked by tlt_cli/recipe_checks.py and tlt_cli/preflight.py, which the
commands call before anything starts. Every problem becomes a `RecipeError` whose message is one
sentence naming the key, which the CLI prints before exiting with code 2.

  schema.py   the sections as frozen dataclasses, each key declared once with `setting(default, help)`:
              its default is the default recipe's value (recipes/tiny-cpu.yaml, checked by a test), its
              help text is what `tlt recipes show` prints above the key, and a number's range is declared
              there too; the choice keys' enums
  ranges.py   a number key's `Range`, the words its help ends with, and `range_problem`, the one check of
              every declared range
  loading.py  the YAML reader, the merge of file and overrides, the one-sentence refusals naming the key

Import the names from here (`from tlt_cli.config import Recipe, load_recipe`). The package imports no
other part of tlt but tlt_cli/errors.py, and nothing heavy (no torch).
"""

from __future__ import annotations

from tlt_cli.config.choices import (
    Bfloat16Rounding,
    DrafterLossKind,
    DrafterStart,
    LinearForms,
    Precision,
    RecipeChoice,
    RecipeError,
    RolloutBackendName,
    RolloutCorrection,
    RolloutDtype,
    ServedDtype,
    SpeculativeMode,
    Trainer,
)
from tlt_cli.config.loading import (
    FREE_FORM_SECTIONS,
    MAX_NESTING,
    MAX_RECIPE_BYTES,
    is_control_character,
    load_recipe,
    read_yaml,
    recipe_from_config,
    recipe_to_dict,
    recipe_to_yaml,
)
from tlt_cli.config.ranges import RANGE, Range, number_problem, range_problem
from tlt_cli.config.schema import (
    CPU_DEVICES,
    DEFAULT_RULES,
    FRESH_DRAFTER_STARTS,
    HELP,
    MAX_SEED,
    MAX_STEPS,
    ActorConfig,
    CheckpointConfig,
    DrafterConfig,
    ModelConfig,
    PluginsConfig,
    Recipe,
    RolloutConfig,
    RunConfig,
    SGLangConfig,
    SpeculativeSection,
    TaskConfig,
    TrainConfig,
    WorkersConfig,
    setting,
)

__all__ = [
    "CPU_DEVICES",
    "DEFAULT_RULES",
    "FRESH_DRAFTER_STARTS",
    "FREE_FORM_SECTIONS",
    "HELP",
    "MAX_NESTING",
    "MAX_RECIPE_BYTES",
    "MAX_SEED",
    "MAX_STEPS",
    "RANGE",
    "ActorConfig",
    "CheckpointConfig",
    "DrafterConfig",
    "DrafterLossKind",
    "DrafterStart",
    "LinearForms",
    "ModelConfig",
    "PluginsConfig",
    "Precision",
    "Recipe",
    "RecipeChoice",
    "RecipeError",
    "RolloutBackendName",
    "RolloutConfig",
    "Bfloat16Rounding",
    "RolloutCorrection",
    "RolloutDtype",
    "Range",
    "RunConfig",
    "ServedDtype",
    "SGLangConfig",
    "SpeculativeMode",
    "SpeculativeSection",
    "TaskConfig",
    "TrainConfig",
    "Trainer",
    "WorkersConfig",
    "is_control_character",
    "load_recipe",
    "read_yaml",
    "recipe_from_config",
    "recipe_to_dict",
    "number_problem",
    "range_problem",
    "recipe_to_yaml",
    "setting",
]
