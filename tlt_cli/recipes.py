"""Where shipped recipes live and how a name on the command line becomes a recipe file.

`tlt train tiny-cpu` and `tlt train recipes/tiny-cpu.yaml` both work: a name that is not an
existing file is looked up among the shipped recipes, which install with tlt as package data of
`tlt_recipes` (the repository's recipes/ folder), so a plain `pip install .` finds them too. `recipe_file(name)`
is that path, or a refusal with a "did you mean" when nothing by that name exists (imports nothing heavy, so a
mistyped name is reported at once).
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from tlt_cli.errors import UserError, did_you_mean

RECIPES_DIRECTORY = Path(str(files("tlt_recipes")))


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES_DIRECTORY.glob("*.yaml"))


def resolve_recipe_path(name: str) -> Path:
    """The file itself if it exists, else the shipped recipe of that name (load_recipe reports a miss)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = RECIPES_DIRECTORY / f"{path.stem}.yaml"
    return shipped if path.parent == Path(".") and shipped.is_file() else path


def recipe_file(name: str) -> Path:
    """`resolve_recipe_path(name)`; a UserError, with the closest shipped name, when no file by that name exists."""
    path = resolve_recipe_path(name)
    if path.exists():
        return path
    hint = did_you_mean(path.stem, [shipped.stem for shipped in shipped_recipes()]) if path.parent == Path(".") else ""
    raise UserError(
        f"recipe file {path} does not exist; {hint}pass the path of a YAML recipe or a shipped recipe's name "
        "(see `tlt recipes list`)."
    )
