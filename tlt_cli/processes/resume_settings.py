"""What `tlt train --resume RUN` continues with: the run's own recipe.yaml, and the overrides that change it.

`resumed_recipe(run_directory, recipe_name, overrides)` is the recipe a resume runs: the run's recipe.yaml
with the key=value overrides applied. A recipe named beside --resume is refused in one sentence unless it
equals recipe.yaml (the run folder describes the run by its own recipe; a change is an override). An
override the checkpoint cannot honour is refused (UNCHANGEABLE; workers.count is checked against the
checkpoint by the driver, the model by its recorded identity). `changed_settings(before, after)` lists
what a resume changes, old -> new: the composition root (tlt_cli/trainers.py) prints it with
`describe_changes`, puts it in the trace's run record, and the driver writes the changed recipe.yaml
(atomically) when the resumed run records its first step, so every later step is described by it.

Settings the checkpoint's shape does not depend on may change: the group size, the prompts per step and the
response length (the update's tensors are shaped per step, the optimizer state per parameter), the
learning rate, the temperature, the precisions (the weights and optimizer state stay float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tlt_cli.atomic_files import not_a_file
from tlt_cli.config import Recipe, load_recipe, recipe_to_dict
from tlt_cli.errors import UserError
from tlt_cli.processes.run_directory import RECIPE_FILE
from tlt_cli.recipes import resolve_recipe_path

# settings a checkpoint cannot be resumed under another value of, and why
UNCHANGEABLE = {
    "run.name": "the run directory is the one --resume names",
    "run.output_dir": "the run directory is the one --resume names",
    "train.trainer": "each trainer writes checkpoints of its own layout",
    "actor.zero_stage": "the checkpoint's optimizer state is sharded for its ZeRO stage",
}
# most changed keys a refusal of a differing recipe lists
LISTED_KEYS = 5


def resumed_recipe(run_directory: Path, recipe_name: str | None, overrides: list[str]) -> Recipe:
    """The run's recipe.yaml with `overrides` applied; UserError when `recipe_name` differs from it or an override
    changes a setting the checkpoint cannot honour."""
    own_path = run_directory / RECIPE_FILE
    if not own_path.is_file():
        raise UserError(
            f"--resume {run_directory}: it has no {RECIPE_FILE} ({own_path} {not_a_file(own_path)}), so it is not a "
            "tlt run directory or it was damaged; give the run directory tlt train made, or start a new run."
        )
    own = load_recipe(own_path)
    if recipe_name is not None:
        differing = list(changed_settings(own, load_recipe(resolve_recipe_path(recipe_name))))
        if differing:
            listed = ", ".join(differing[:LISTED_KEYS]) + (", ..." if len(differing) > LISTED_KEYS else "")
            raise UserError(
                f"--resume continues run {run_directory} under its own recipe {own_path}, and {recipe_name} differs "
                f"from it ({listed}); drop {recipe_name} and give what should change as key=value overrides."
            )
    resumed = load_recipe(own_path, overrides)
    for key, (old, new) in changed_settings(own, resumed).items():
        if key in UNCHANGEABLE:
            raise UserError(
                f"{key}: a resume cannot change it from {old!r} to {new!r} ({UNCHANGEABLE[key]}); resume without "
                f"{key}={new}, or start a new run."
            )
    return resumed


def changed_settings(before: Recipe, after: Recipe) -> dict[str, tuple[Any, Any]]:
    """Each dotted key whose value differs, with its old and new value, in the recipe's order."""
    old, new = _flattened(recipe_to_dict(before)), _flattened(recipe_to_dict(after))
    # an empty mapping and no key are one setting (task.options {} -> {"path": ...} changes task.options.path only)
    return {
        key: (old.get(key), new.get(key))
        for key in {**old, **new}
        if old.get(key) != new.get(key) and not (_unset(old.get(key)) and _unset(new.get(key)))
    }


def _unset(value: Any) -> bool:
    return value is None or value == {}


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """`resuming with changed settings: key old -> new, ...`"""
    return "resuming with changed settings: " + ", ".join(
        f"{key} {old} -> {new}" for key, (old, new) in changes.items()
    )


def _flattened(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat.update(_flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
