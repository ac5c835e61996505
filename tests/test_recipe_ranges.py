"""Each number key's range is declared once, with the key: its help shows it, and one check refuses a value outside it.

The cases are made from the schema: every key declared with a range (tlt_cli/config/ranges.py) gets a value just
outside each end, which `tlt recipes validate` refuses with exit 2 and the one sentence the range writes, and the
value on each included end, which the range admits. The recipe gate builds the speculative plan once per check.
"""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

from tlt_cli import recipe_checks
from tlt_cli.cli import app
from tlt_cli.config import RANGE, Range, Recipe, SGLangConfig, range_problem
from tlt_cli.preflight import check_recipe
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.sglang.config import sglang_config_problem
from tlt_cli.training import setup

runner = CliRunner()
SGLANG_SECTION = "rollout.sglang."


def ranged_keys(section=None, prefix: str = "") -> dict[str, tuple[object, str, Range]]:
    """Dotted key -> (its section's default instance, its field name, its declared Range), for every ranged key."""
    section = Recipe() if section is None else section
    found = {}
    for key_field in dataclasses.fields(section):
        value = getattr(section, key_field.name)
        if dataclasses.is_dataclass(value):
            found.update(ranged_keys(value, f"{prefix}{key_field.name}."))
        elif RANGE in key_field.metadata:
            found[f"{prefix}{key_field.name}"] = (section, key_field.name, key_field.metadata[RANGE])
    return found


def outside_values(declared: Range) -> list[float]:
    """A value just below the range and one just above it (where it has that end)."""
    values = []
    if declared.minimum is not None:
        values.append(declared.minimum if declared.exclusive_minimum else declared.minimum - 1)
    if declared.maximum is not None:
        values.append(declared.maximum if declared.exclusive_maximum else declared.maximum + 1)
    return values


def test_the_keys_a_recipe_bounds_declare_their_range():
    declared = ranged_keys()
    assert {
        "run.seed",
        "train.steps",
        "train.group_size",
        "rollout.top_p",
        "actor.zero_stage",
        "actor.rollout_correction_cap",
        "speculative.bandit_epsilon",
        "drafter.vocab_size",
        "rollout.sglang.mem_fraction",
    } <= set(declared)
    assert declared["train.steps"][2] == Range(1, 999_999_999, integer=True, note="what checkpoint names hold")
    assert declared["rollout.top_p"][2].phrase() == "in (0, 1]"


@pytest.mark.parametrize("key", list(ranged_keys()))
def test_each_keys_help_ends_with_its_range(key):
    section, name, declared = ranged_keys()[key]
    help_text = next(field.metadata["help"] for field in dataclasses.fields(section) if field.name == name)
    assert help_text.endswith(f"; {declared.described()}")
    assert "must" not in declared.described()


@pytest.mark.parametrize("key", [key for key in ranged_keys() if not key.startswith(SGLANG_SECTION)])
def test_a_value_outside_a_declared_range_is_one_sentence_exit_2(key):
    section, name, declared = ranged_keys()[key]
    kind = type(getattr(section, name))
    for value in outside_values(declared):
        override = f"{key}={kind(value)}"
        result = runner.invoke(app, ["recipes", "validate", "tiny-cpu", override])
        assert result.exit_code == 2, (override, result.output)
        expected = declared.refusal(key, kind(value))
        assert expected in result.output and "Traceback" not in result.output
        assert result.output.strip().endswith(expected), result.output


@pytest.mark.parametrize("key", [key for key in ranged_keys() if key.startswith(SGLANG_SECTION)])
def test_the_sglang_sections_ranges_are_checked_with_that_section(key):
    section, name, declared = ranged_keys()[key]
    kind = type(getattr(section, name))
    for value in outside_values(declared):
        config = dataclasses.replace(SGLangConfig(), **{name: kind(value)})
        assert sglang_config_problem(config) == declared.refusal(key, kind(value))


@pytest.mark.parametrize("key", list(ranged_keys()))
def test_the_ends_a_range_includes_are_admitted(key):
    section, name, declared = ranged_keys()[key]
    kind = type(getattr(section, name))
    ends = [
        end
        for end, exclusive in (
            (declared.minimum, declared.exclusive_minimum),
            (declared.maximum, declared.exclusive_maximum),
        )
        if end is not None and not exclusive
    ]
    for end in ends:
        assert range_problem(dataclasses.replace(section, **{name: kind(end)})) is None


@pytest.mark.parametrize(
    "declared, phrase",
    [
        (Range(1, 9, integer=True), "in 1..9"),
        (Range(0, 1, exclusive_minimum=True), "in (0, 1]"),
        (Range(0, 1, exclusive_minimum=True, exclusive_maximum=True), "in (0, 1)"),
        (Range(0, 1), "in [0, 1]"),
        (Range(2, integer=True), "at least 2"),
        (Range(0, exclusive_minimum=True), "positive"),
        (Range(1, exclusive_minimum=True), "greater than 1"),
        (Range(maximum=4), "at most 4"),
        (Range(maximum=1, exclusive_maximum=True), "less than 1"),
    ],
)
def test_a_range_reads_as_words(declared, phrase):
    assert declared.phrase() == phrase
    assert declared.refusal("a.key", 7) == f"a.key must be {phrase}, got 7."


def test_the_speculative_plan_is_built_once_per_check(monkeypatch):
    """The gate's section check, its SGLang check and the draft-vocabulary check all read one plan."""
    built, original = [], setup.speculative_plan

    def counted(section):
        built.append(section)
        return original(section)

    # the gate's own name for it, and setup's (which the checks after the values might ask)
    monkeypatch.setattr(recipe_checks, "speculative_plan", counted)
    monkeypatch.setattr(setup, "speculative_plan", counted)
    recipe = load_checked_recipe(resolve_recipe_path("tiny-cpu"), ["speculative.mode=adaptive"])
    built.clear()
    check_recipe(recipe)
    assert len(built) == 1
    sglang = load_checked_recipe(
        resolve_recipe_path("tiny-cpu"),
        ["rollout.backend=sglang", "rollout.sglang.colocated=false", "rollout.sglang.gpus=[0,1]"],
    )
    built.clear()
    recipe_checks.check_values(sglang)
    assert len(built) == 1
