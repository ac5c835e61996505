"""`tlt calibrate --write-recipe PATH`: replace the `speculative.rules` block of a recipe file in place, comments kept.

The edit is textual, on the top-level `speculative:` section only: `mode:` becomes `adaptive`, and
the `rules:` key with its items (and the comment lines a previous calibration wrote above it) is
replaced by the new block with the calibration command in a comment above it; everything else is
left byte for byte. A file without a `speculative:` section gets one appended. The edited text is
then loaded as a recipe and must equal the old recipe with only `speculative.mode` and
`speculative.rules` changed; otherwise nothing is written and the caller is told to paste the
fragment by hand.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

from tlt_cli.calibration.rules import (
    CALIBRATED_BY,
    fragment_text,
    rules_block,
    rules_comment,
)
from tlt_cli.config import Recipe, SpeculativeMode
from tlt_cli.errors import UserError
from tlt_cli.recipe_checks import load_checked_recipe

SECTION = re.compile(r"^speculative:\s*(#.*)?$")
TOP_LEVEL = re.compile(r"^[^\s#]")


class RecipeEditError(ValueError):
    """The recipe file could not be rewritten safely; the message says to paste the fragment instead."""


def check_recipe_to_rewrite(path: Path) -> Recipe:
    """The recipe at `path`, checked, and RecipeEditError unless its file and folder can be written: what
    `tlt calibrate --write-recipe` asks before it measures anything."""
    try:
        recipe = load_checked_recipe(path)
    except UserError as error:
        raise RecipeEditError(f"--write-recipe {path}: {error}") from None
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
        raise RecipeEditError(
            f"--write-recipe {path}: the file or its folder cannot be written; give a recipe file you can write."
        )
    return recipe


def write_rules_into_recipe(path: Path, rules: list[dict], command: str) -> None:
    """Rewrite `path` so its speculative section is adaptive with `rules` (see the module docstring)."""
    before = check_recipe_to_rewrite(path)
    text = path.read_text(encoding="utf-8")
    candidate = path.with_name(f".{path.name}.calibrated")
    candidate.write_text(edited_recipe_text(text, rules, command), encoding="utf-8")
    expected = replace(before, speculative=replace(before.speculative, mode=SpeculativeMode.adaptive, rules=rules))
    try:
        after = load_checked_recipe(candidate)
    except UserError as error:
        candidate.unlink()
        raise RecipeEditError(
            f"--write-recipe {path}: the rewritten file is not a valid recipe ({error}); "
            "paste the printed fragment into it by hand."
        ) from None
    if after != expected:
        candidate.unlink()
        raise RecipeEditError(
            f"--write-recipe {path}: the rewritten file does not read back as the same recipe with the "
            "new rules; paste the printed fragment into it by hand."
        )
    candidate.replace(path)


def edited_recipe_text(text: str, rules: list[dict], command: str) -> str:
    """`text` with its speculative section made adaptive with `rules` (a new section appended if none)."""
    lines = text.splitlines()
    start = next((number for number, line in enumerate(lines) if SECTION.match(line)), None)
    if start is None:
        separator = [""] if lines and lines[-1].strip() else []
        return "\n".join([*lines, *separator, fragment_text(rules, command).rstrip("\n")]) + "\n"
    end = next((number for number in range(start + 1, len(lines)) if TOP_LEVEL.match(lines[number])), len(lines))
    # comment lines at column 0 just before the next section belong to that section
    while end > start + 1 and lines[end - 1].startswith("#"):
        end -= 1
    section = _edited_section(lines[start + 1 : end], rules, command)
    return "\n".join([*lines[: start + 1], *section, *lines[end:]]) + "\n"


def _edited_section(body: list[str], rules: list[dict], command: str) -> list[str]:
    indent = next((_indent(line) for line in body if line.strip() and not line.lstrip().startswith("#")), "  ")
    body = _with_mode_adaptive(body, indent)
    key = next((number for number, line in enumerate(body) if line.startswith(f"{indent}rules:")), None)
    if key is None:
        last = max((number for number, line in enumerate(body) if line.strip()), default=-1)
        return [*body[: last + 1], *rules_block(rules, command, indent), *body[last + 1 :]]
    first = key
    while first > 0 and _is_calibration_comment(body[first - 1], indent):
        first -= 1
    after = key + 1
    # the old items: deeper lines, `- ` items at the key's own indent, and blank lines between them
    while after < len(body) and (
        not body[after].strip() or len(_indent(body[after])) > len(indent) or body[after].startswith(f"{indent}- ")
    ):
        after += 1
    while after > key + 1 and not body[after - 1].strip():
        after -= 1
    return [*body[:first], *rules_block(rules, command, indent), *body[after:]]


def _with_mode_adaptive(body: list[str], indent: str) -> list[str]:
    mode = re.compile(rf"^{re.escape(indent)}mode:\s*[^#\s]*(\s*#.*)?$")
    for number, line in enumerate(body):
        match = mode.match(line)
        if match:
            return [*body[:number], f"{indent}mode: adaptive{match.group(1) or ''}", *body[number + 1 :]]
    return [f"{indent}mode: adaptive", *body]


def _is_calibration_comment(line: str, indent: str) -> bool:
    """The comment lines `rules_block` writes above `rules:`."""
    return line.startswith(f"{indent}{CALIBRATED_BY}") or line in rules_comment(indent)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]
