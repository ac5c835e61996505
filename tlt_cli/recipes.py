"""Where shipped recipes live and how a name on the command line becomes a recipe file.

`tlt train tiny-cpu` and `tlt train recipes/tiny-cpu.yaml` both work: a name that is not an
existing file is looked up among the shipped recipes, which install with tlt as package data of
`tlt_recipes` (the repository's recipes/ folder), so a plain `pip install .` finds them too.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

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
