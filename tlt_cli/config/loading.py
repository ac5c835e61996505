"""The recipe loader: a YAML file merged with `key=value` overrides onto the schema, as a `Recipe`.

`load_recipe(path, overrides)` is the only way a recipe enters the program: it reads the file as
YAML 1.2 (tlt's reader: true/false the only booleans, no duplicate keys, no aliases, bounded size and
nesting), merges it and the overrides onto the dataclasses of tlt_cli/config/schema.py with OmegaConf,
and returns a `Recipe` whose keys and types are right. Every problem is a `RecipeError` whose message
is one sentence naming the file, the override or the key (a close key suggested), which the CLI
prints before exiting with code 2. `recipe_to_yaml` and `recipe_to_dict` give a resolved recipe back.
"""

from __future__ import annotations

import dataclasses
import re
import typing
import unicodedata
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from tlt_cli.atomic_files import not_a_file
from tlt_cli.config.choices import RecipeChoice, RecipeError
from tlt_cli.config.schema import Recipe
from tlt_cli.errors import did_you_mean

# a recipe is a few KB of YAML; refusing bigger files keeps a mistaken path from hanging the parser
MAX_RECIPE_BYTES = 1 << 20
# a recipe's lists and mappings nest a few levels (speculative.rules: 4); deeper is a mistake, and far deeper
# would exhaust the recursion of the YAML parser and of OmegaConf
MAX_NESTING = 32


class _RecipeYamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true and false. YAML 1.1 also reads yes/no/on/off as booleans, which
    would turn `speculative.mode: off` or `run.name=off` into False; as words they stay strings, and a
    boolean key refuses them, as any value but true or false (`_boolean_refusal`: OmegaConf would read
    "yes", "off" or 2 as a bool). A key given
    twice in one mapping is an error, not a silent override, and so is an alias (`*name`): a recipe
    writes its values out, and an alias can nest itself or expand a few lines into billions of nodes."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} is not allowed in a recipe; write the value out", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = []
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)


_RecipeYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A recipe file's or an override value's YAML, with YAML 1.2 booleans (see _RecipeYamlLoader); a YAMLError
    when its lists and mappings nest deeper than MAX_NESTING."""
    too_deep = YAMLError(f"its lists and mappings nest more than {MAX_NESTING} deep; a recipe nests a few levels")
    try:
        content = yaml.load(text, Loader=_RecipeYamlLoader)
    except RecursionError:
        raise too_deep from None
    if _nesting(content) > MAX_NESTING:
        raise too_deep
    return content


def _nesting(value: Any) -> int:
    """How deep lists and mappings nest in `value` (a scalar: 0), counted without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict | list):
            pending += [(inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item)]
    return deepest


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe and apply `key=value` overrides: a Recipe with the right keys and types (values unchecked)."""
    recipe_path = Path(path)
    content = _read_sections(recipe_path)
    try:
        loaded = OmegaConf.create(content)
    except OmegaConfBaseException as error:
        raise RecipeError(f"recipe file {recipe_path} is not a valid recipe: {_first_line(error)}.") from None
    _check_sections(loaded, str(recipe_path))
    return recipe_from_config(loaded, overrides, origin=str(recipe_path))


def _read_sections(recipe_path: Path) -> dict:
    """The recipe file's top-level mapping, or a RecipeError naming the file (and the line, for bad YAML)."""
    if not recipe_path.is_file():
        raise RecipeError(
            f"recipe file {recipe_path} {not_a_file(recipe_path)}; pass the path of a YAML recipe (see `tlt recipes "
            "list`)."
        )
    if recipe_path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"recipe file {recipe_path} is {recipe_path.stat().st_size} bytes; a recipe is a few KB of "
            f"YAML (at most {MAX_RECIPE_BYTES})."
        )
    raw = recipe_path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise RecipeError(
            f"recipe file {recipe_path} is not UTF-8 text (byte 0x{raw[error.start]:02x} at line {line}); "
            "save it as UTF-8."
        ) from None
    try:
        content = read_yaml(text)
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"recipe file {recipe_path} is not valid YAML{where}: {_first_line(error)}.") from None
    if content is None:
        raise RecipeError(
            f"recipe file {recipe_path} is empty; start from a shipped recipe (`tlt recipes show tiny-cpu`)."
        )
    if not isinstance(content, dict):
        raise RecipeError(
            f"recipe file {recipe_path} must hold a mapping of sections (run:, model:, ...), not a list or a scalar."
        )
    return content


def _check_sections(loaded: DictConfig, origin: str) -> None:
    sections = [section.name for section in dataclasses.fields(Recipe)]
    for section, value in loaded.items():
        _require(
            section in sections,
            f"{origin}: section '{section}' is not a recipe section; {did_you_mean(str(section), sections)}"
            f"sections are: {', '.join(sections)}.",
        )
        _require(
            isinstance(value, DictConfig), f"{origin}: section '{section}' must be a mapping of keys, got {value!r}."
        )


def recipe_from_config(
    loaded: DictConfig, overrides: list[str] | tuple[str, ...] = (), origin: str = "recipe"
) -> Recipe:
    """Merge a loaded config and overrides onto the schema: a Recipe with the right keys and types."""
    schema = OmegaConf.structured(Recipe)
    refusal = _first_boolean_refusal(OmegaConf.to_container(loaded))
    if refusal is not None:
        raise RecipeError(f"{origin}: {refusal}")
    try:
        merged = OmegaConf.merge(schema, loaded)
    except (OmegaConfBaseException, TypeError) as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None
    for override in overrides:
        merged = _apply_override(merged, override)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None


def _apply_override(merged: DictConfig, override: str) -> DictConfig:
    shown = _shortened(override)
    if "=" not in override:
        raise RecipeError(f"override '{shown}' must have the form key=value, e.g. train.steps=10.")
    key, _, value = override.partition("=")
    key = key.strip()
    if key.count(".") >= MAX_NESTING:  # OmegaConf recurses once a level (a RecursionError at about a thousand)
        raise RecipeError(
            f"override key '{_shortened(key)}' nests more than {MAX_NESTING} deep; a recipe nests a few levels."
        )
    free_form = key.startswith(FREE_FORM_SECTIONS)
    if not free_form and OmegaConf.select(merged, key, default=_MISSING_KEY) is _MISSING_KEY:
        raise RecipeError(f"override key '{_shortened(key)}' is not a recipe key; {_suggest(key)}")
    # YAML folds a line break of a plain word into a space (`run.name=$'a\nb'` would silently become "a b") and
    # stops at a tab or an escape: either way the sentence names the character
    holds_control = RecipeError(
        f"override '{shown}': the value holds a control character (a line break, a tab), which YAML would turn "
        "into a space or refuse; use printable characters only."
    )
    control = any(is_control_character(character) for character in value)
    try:
        content = read_yaml(value)
        parsed = OmegaConf.create()
        OmegaConf.update(parsed, key, content)
    except (YAMLError, OmegaConfBaseException) as error:
        if control:
            raise holds_control from None
        raise RecipeError(f"override '{shown}': the value is not valid YAML ({_first_line(error)}).") from None
    if isinstance(content, str) and control:
        raise holds_control
    refusal = _boolean_refusal(key, content)
    if refusal is not None:
        raise RecipeError(f"override '{shown}': {refusal}")
    try:
        return OmegaConf.merge(merged, parsed)
    except (OmegaConfBaseException, TypeError) as error:
        raise RecipeError(f"override '{shown}': {_describe(error)}") from None


def _shortened(text: str, limit: int = 80) -> str:
    """`text` as an error message quotes it, on one line: control characters escaped (a newline as \\n), whole up
    to `limit` characters, else its start and an ellipsis."""
    text = "".join(repr(character)[1:-1] if is_control_character(character) else character for character in text)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def is_control_character(character: str) -> bool:
    """A control character (newline, tab, escape, DEL, ...): one a terminal does not show as itself."""
    return unicodedata.category(character) == "Cc"


_MISSING_KEY = object()
# keys under these take any name (options passed through to the chosen task or plugin)
FREE_FORM_SECTIONS = ("task.options.", "plugins.options.", "trl.")


def _describe(error: OmegaConfBaseException | TypeError) -> str:
    if isinstance(error, TypeError):  # OmegaConf's merge of a list into a section, or a section into a list
        return "a list cannot take the place of a section, nor a section the place of a list or value."
    key = getattr(error, "full_key", None) or "?"
    message = _first_line(error)
    choice = _key_type(key)
    if isinstance(choice, type) and issubclass(choice, RecipeChoice):
        return choice.refusal(key, getattr(error, "value", None))
    if "not in struct" in message or ("Key '" in message and "not in" in message):
        return f"key '{key}' is not a recipe key; {_suggest(key)}"
    if "Value '" in message or "Invalid type" in message or "could not convert" in message.lower():
        return f"key '{key}' has the wrong type ({message})."
    if "Incompatible value 'None'" in message:  # YAML reads an empty value as null, which this key does not take
        return f"gives {key} no value; write {key}=<value>."
    if "Missing mandatory value" in message:
        return f"key '{key}' must be set."
    return f"key '{key}': {message}."


def _boolean_refusal(key: str, value: Any) -> str | None:
    """The refusal of `value` for a boolean key that is not true or false (OmegaConf would read "yes", "off", 1 or
    2 as a bool); None for any other key or value."""
    if _key_type(key) is bool and not isinstance(value, bool):
        return f"key '{key}' has the wrong type ({value!r} is not true or false)."
    return None


def _first_boolean_refusal(content: Any, prefix: str = "") -> str | None:
    """The first `_boolean_refusal` among a recipe file's values (nested sections included), or None."""
    if not isinstance(content, dict):
        return None
    for name, value in content.items():
        key = f"{prefix}{name}"
        refusal = _first_boolean_refusal(value, f"{key}.") if isinstance(value, dict) else _boolean_refusal(key, value)
        if refusal is not None:
            return refusal
    return None


def _key_type(key: str) -> Any:
    """The schema's type of a dotted recipe key, or None for a key the schema does not have."""
    kind: Any = Recipe
    for name in key.split("."):
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            return None
        kind = typing.get_type_hints(kind).get(name)
    return kind


def _suggest(key: str) -> str:
    """The keys to choose from, after a "did you mean" for the closest one to `key`."""
    section = key.split(".")[0]
    section_types = typing.get_type_hints(Recipe)
    if section not in section_types:
        full_keys = [
            f"{name}.{key_field.name}"
            for name, kind in section_types.items()
            if dataclasses.is_dataclass(kind)
            for key_field in dataclasses.fields(kind)
        ]
        return f"{did_you_mean(key, [*section_types, *full_keys])}sections are: {', '.join(section_types)}."
    names = [key_field.name for key_field in dataclasses.fields(section_types[section])]
    hint = did_you_mean(key, [f"{section}.{name}" for name in names])
    return f"{hint}keys of '{section}' are: {', '.join(names)}."


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, as written into every run directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain values (nested dicts, lists, str, numbers): what loggers record as config."""
    return OmegaConf.to_container(OmegaConf.structured(recipe), enum_to_str=True)
