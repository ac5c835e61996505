"""A recipe as YAML with each key's help above it: what `tlt recipes show` prints.

The help of a key is the `help` metadata of its dataclass field (tlt_cli/config/schema.py), written as
comment lines wrapped at 100 columns directly above the key. The shipped recipes follow the same
contract: the comment lines directly above every key, joined with spaces, start with the key's help
(a recipe may go on with a note of its own), which tests/test_recipes.py checks. The output loads
back as the same recipe.
"""

from __future__ import annotations

import dataclasses
import textwrap
from enum import Enum
from typing import Any

import yaml

from tlt_cli.config import HELP, Recipe

WIDTH = 100
INDENT = "  "


def commented_yaml(recipe: Recipe) -> str:
    """Every key of `recipe` with its value, each under its help as comment lines."""
    return "\n".join(_section_lines(recipe, "")) + "\n"


def key_help(section_class: type, key: str) -> str:
    """The help text of `key` in a section dataclass of tlt_cli/config/schema.py."""
    return next(key_field.metadata[HELP] for key_field in dataclasses.fields(section_class) if key_field.name == key)


def comment_lines(help_text: str, indent: str) -> list[str]:
    """`help_text` as comment lines at `indent`, wrapped at WIDTH columns."""
    return [f"{indent}# {line}" for line in textwrap.wrap(help_text, WIDTH - len(indent) - 2, break_on_hyphens=False)]


def _section_lines(section: Any, indent: str) -> list[str]:
    lines = []
    for key_field in dataclasses.fields(section):
        value = getattr(section, key_field.name)
        lines += comment_lines(key_field.metadata[HELP], indent)
        if dataclasses.is_dataclass(value):
            lines += [f"{indent}{key_field.name}:", *_section_lines(value, indent + INDENT)]
        elif isinstance(value, list | tuple) and value and all(isinstance(item, dict) for item in value):
            lines += [f"{indent}{key_field.name}:", *(f"{indent}{INDENT}- {_flow(item)}" for item in value)]
        else:
            lines.append(f"{indent}{key_field.name}: {_flow(value)}")
    return lines


def _flow(value: Any) -> str:
    """A value as one line of flow-style YAML (words YAML 1.1 reads as booleans are quoted)."""
    text = yaml.safe_dump(_plain(value), default_flow_style=True, width=float("inf"), sort_keys=False)
    return text.removesuffix("\n...\n").strip()


def _plain(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, Enum):
        return value.value
    return value
