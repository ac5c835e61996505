"""One source for each key's help and default: the dataclass fields of tlt_cli/config/schema.py.

The contract (tlt_cli/recipe_help.py): in a shipped recipe the comment lines directly above every
key, joined with spaces, start with the key's help (a recipe may add a note after it);
`tlt recipes show` prints exactly the help above each key and loads back as the same recipe; and
the default recipe's values are the dataclass defaults (only run.name differs).
"""

import dataclasses
import re

import pytest
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import HELP, Recipe, RunConfig, load_recipe
from tlt_cli.recipes import RECIPES_DIRECTORY, shipped_recipes

runner = CliRunner()
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][A-Za-z0-9_]*):(\s|$)")
FREE_FORM = ("task.options.", "plugins.options.")


def help_by_key(section=None, prefix: str = "") -> dict[str, str]:
    """Dotted key -> help, for every key of the schema (sections included)."""
    section = Recipe() if section is None else section
    found = {}
    for key_field in dataclasses.fields(section):
        key, value = f"{prefix}{key_field.name}", getattr(section, key_field.name)
        found[key] = key_field.metadata.get(HELP, "")
        if dataclasses.is_dataclass(value):
            found.update(help_by_key(value, f"{key}."))
    return found


def comments_by_key(text: str) -> dict[str, str]:
    """Dotted key -> the comment lines directly above it, joined with spaces ("" when none)."""
    found, comment, path = {}, [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if match:
            depth = len(match["indent"]) // 2
            path = [*path[:depth], match["key"]]
            found[".".join(path)] = " ".join(comment)
        comment = []
    return found


def test_every_key_has_help():
    missing = [key for key, help_text in help_by_key().items() if not help_text.strip()]
    assert missing == []


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda path: path.name)
def test_shipped_recipe_comments_start_with_each_keys_help(path):
    helps = help_by_key()
    for key, comment in comments_by_key(path.read_text()).items():
        if key.startswith(FREE_FORM):
            continue
        assert key in helps, f"{path.name}: {key} is not a recipe key"
        help_text = helps[key]
        # the help, then (optionally) a note of the recipe's own after a space or a punctuation mark
        assert comment.startswith(help_text) and not comment[len(help_text) :][:1].isalnum(), (
            f"{path.name}: the comment above {key} must start with its help: {help_text!r}, got {comment!r}"
        )


def test_recipes_show_prints_exactly_the_help_and_loads_back(tmp_path):
    result = runner.invoke(app, ["recipes", "show", "tiny-cpu"])
    assert result.exit_code == 0, result.output
    assert comments_by_key(result.stdout) == help_by_key()
    shown = tmp_path / "shown.yaml"
    shown.write_text(result.stdout)
    assert load_recipe(shown) == load_recipe(RECIPES_DIRECTORY / "tiny-cpu.yaml")


def test_the_defaults_are_the_default_recipe():
    default_recipe = load_recipe(RECIPES_DIRECTORY / "tiny-cpu.yaml")
    assert default_recipe == dataclasses.replace(Recipe(), run=RunConfig(name="tiny-cpu"))
