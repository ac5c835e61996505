"""Recipe loading and validation: every shipped recipe loads; each kind of bad input is one line, exit 2."""

from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import RecipeError
from tlt_cli.preflight import check_recipe
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import shipped_recipes

runner = CliRunner()


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda path: path.name)
def test_every_shipped_recipe_loads_and_says_how_to_run_it(path):
    recipe = load_checked_recipe(path)
    first_line = path.read_text().splitlines()[0]
    assert first_line.startswith("# tlt train ") and path.name in first_line
    assert recipe.train.steps >= 1


def test_overrides_are_typed_and_applied():
    recipe = load_checked_recipe(
        shipped_recipes()[0], ["train.steps=3", "actor.lr=1e-4", "task.options.path=data.jsonl"]
    )
    assert recipe.train.steps == 3 and recipe.actor.lr == 1e-4
    assert recipe.task.options["path"] == "data.jsonl"


def test_string_keys_keep_words_yaml_reads_as_booleans():
    recipe = load_checked_recipe(shipped_recipes()[0], ["run.name=off", "speculative.mode=off"])
    assert recipe.run.name == "off" and recipe.speculative.mode == "off"
    assert load_checked_recipe(shipped_recipes()[0], ["run.name=Yes"]).run.name == "Yes"
    with pytest.raises(RecipeError, match="train.steps"):
        load_checked_recipe(shipped_recipes()[0], ["train.steps=off"])


def test_an_override_without_a_value_says_so():
    with pytest.raises(RecipeError, match=r"gives model.path no value; write model.path=<value>"):
        load_checked_recipe(shipped_recipes()[0], ["model.path="])


def test_recipe_files_read_yes_no_on_off_as_words_and_refuse_repeated_keys(tmp_path):
    recipe_file = tmp_path / "words.yaml"
    recipe_file.write_text("run:\n  name: off\nspeculative:\n  mode: off\nrollout:\n  sglang:\n    colocated: no\n")
    recipe = load_checked_recipe(recipe_file)
    assert recipe.run.name == "off" and recipe.speculative.mode == "off" and recipe.rollout.sglang.colocated is False
    recipe_file.write_text("run:\n  name: a\nrun:\n  name: b\n")
    with pytest.raises(RecipeError, match="line 3: key 'run' appears twice"):
        load_checked_recipe(recipe_file)


def test_recipe_is_frozen():
    recipe = load_checked_recipe(shipped_recipes()[0])
    with pytest.raises(FrozenInstanceError):
        recipe.train.steps = 5


MALFORMED = {
    "unknown section": ("trian:\n  steps: 3\n", [], "section 'trian'"),
    "unknown key": ("train:\n  stepz: 3\n", [], "train.stepz"),
    "wrong type": ("train:\n  steps: many\n", [], "train.steps"),
    "wrong float": ("actor:\n  lr: fast\n", [], "actor.lr"),
    "invalid yaml": ("train: [\n", [], "not valid YAML at line"),
    "not a mapping": ("- a\n- b\n", [], "mapping of sections"),
    "section not a mapping": ("train: 5\n", [], "section 'train'"),
    "null value": ("train:\n  steps: null\n", [], "train.steps"),
    "out of range": ("train:\n  steps: 0\n", [], "train.steps must be at least 1"),
    "bad choice": ("rollout:\n  backend: vllm\n", [], "rollout.backend"),
    "uneven shards": ("train:\n  prompts_per_step: 5\n", [], "multiple of workers.count"),
    "group too small": ("train:\n  group_size: 1\n", [], "train.group_size"),
    "top_p range": ("rollout:\n  top_p: 1.5\n", [], "rollout.top_p"),
    "missing model folder": ("model:\n  path: /nonexistent/model\n", [], "model.path"),
    "unknown builtin": ("model:\n  path: builtin:huge\n", [], "builtin:tiny-arith"),
    "override unknown key": ("run: {name: t}\n", ["train.stepz=3"], "train.stepz"),
    "override without =": ("run: {name: t}\n", ["train.steps"], "key=value"),
    "override wrong type": ("run: {name: t}\n", ["train.steps=abc"], "train.steps"),
    "bad zero stage": ("actor:\n  zero_stage: 4\n", [], "actor.zero_stage"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_recipe_is_one_clear_line(tmp_path, name):
    text, overrides, expected = MALFORMED[name]
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as caught:
        check_recipe(load_checked_recipe(path, overrides))
    message = str(caught.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("name", ["unknown key", "out of range", "override wrong type", "invalid yaml"])
def test_cli_exits_2_with_one_line_and_no_traceback(tmp_path, name):
    text, overrides, expected = MALFORMED[name]
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    result = runner.invoke(app, ["train", str(path), *overrides])
    assert result.exit_code == 2, result.output
    assert expected in result.output and "Traceback" not in result.output


def test_cli_missing_recipe_file_exits_2(tmp_path):
    result = runner.invoke(app, ["train", str(tmp_path / "absent.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_cli_resume_of_a_directory_without_checkpoints_exits_2(tmp_path):
    (tmp_path / "recipe.yaml").write_text(Path(shipped_recipes()[0]).read_text())
    result = runner.invoke(app, ["train", "--resume", str(tmp_path)])
    assert result.exit_code == 2 and "no checkpoint" in result.output


def test_cli_validate_and_version():
    assert runner.invoke(app, ["recipes", "validate", "tiny-cpu"]).exit_code == 0
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and "tlt " in result.output
