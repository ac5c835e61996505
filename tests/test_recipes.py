"""Recipe loading and validation: every shipped recipe loads; each kind of bad input is one line, exit 2."""

from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import (
    ActorConfig,
    LinearForms,
    Precision,
    RecipeError,
    RolloutBackendName,
    RolloutConfig,
    RolloutCorrection,
    RolloutDtype,
    SpeculativeMode,
    SpeculativeSection,
    TrainConfig,
    Trainer,
    load_recipe,
)
from tlt_cli.drafter.model import EagleDrafter, save_drafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.models.loading import load_policy
from tlt_cli.preflight import check_recipe
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipe_help import key_help
from tlt_cli.recipes import resolve_recipe_path, shipped_recipes
from tlt_cli.training import setup

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
    recipe_file.write_text("run:\n  name: off\nspeculative:\n  mode: off\nrollout:\n  sglang:\n    colocated: false\n")
    recipe = load_checked_recipe(recipe_file)
    assert recipe.run.name == "off" and recipe.speculative.mode == "off" and recipe.rollout.sglang.colocated is False
    # a boolean key takes true or false only: OmegaConf would read the word (or a number) as a bool
    recipe_file.write_text("rollout:\n  sglang:\n    colocated: no\n")
    with pytest.raises(RecipeError, match="key 'rollout.sglang.colocated' has the wrong type \\('no' is not true or"):
        load_checked_recipe(recipe_file)
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
    "out of range": ("train:\n  steps: 0\n", [], "train.steps must be in 1..999999999"),
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
    "bad mode": (
        "speculative:\n  mode: sometimes\n",
        [],
        "speculative.mode must be one of off, fixed, adaptive, auto, got 'sometimes'.",
    ),
    "override bad trainer": (
        "run: {name: t}\n",
        ["train.trainer=tlr"],
        "train.trainer must be one of native, trl, got 'tlr'.",
    ),
    "bad rollout correction": (
        "actor:\n  rollout_correction: tokens\n",
        [],
        "actor.rollout_correction must be one of token, sequence, off, got 'tokens'.",
    ),
    "rollout correction cap at most 1": (
        "run: {name: t}\n",
        ["actor.rollout_correction_cap=1.0"],
        "actor.rollout_correction_cap must be in (1, 10000] (importance weights are truncated at it), got 1.0.",
    ),
    "mode a mapping": (
        "speculative:\n  mode: {a: 1}\n",
        [],
        "speculative.mode must be one of off, fixed, adaptive, auto, got {a: 1}.",
    ),
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


@pytest.mark.parametrize(
    "name",
    ["unknown key", "out of range", "override wrong type", "invalid yaml", "rollout correction cap at most 1"],
)
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


@pytest.mark.parametrize(
    "choice, section_name, section, key",
    [
        (SpeculativeMode, "speculative", SpeculativeSection, "mode"),
        (Trainer, "train", TrainConfig, "trainer"),
        (LinearForms, "rollout", RolloutConfig, "linear_forms"),
        (RolloutDtype, "rollout", RolloutConfig, "dtype"),
        (Precision, "actor", ActorConfig, "precision"),
        (RolloutCorrection, "actor", ActorConfig, "rollout_correction"),
    ],
)
def test_choice_keys_take_their_enum_and_their_help_lists_every_choice(choice, section_name, section, key):
    for member in choice:
        recipe = load_checked_recipe(resolve_recipe_path("tiny-cpu"), [f"{section_name}.{key}={member.value}"])
        assert getattr(getattr(recipe, section_name), key) is member
        assert member.value in key_help(section, key)
    # `tlt recipes show` writes the spelling a recipe uses
    shown = runner.invoke(app, ["recipes", "show", "tiny-cpu"]).output
    assert f"  {key}: {getattr(section(), key).value}\n" in shown


def test_rollout_backend_takes_its_enum_and_its_help_lists_every_backend():
    """One meaning of rollout.backend: the enum (the choice of a TRL run or an SGLang section is checked apart)."""
    for member in RolloutBackendName:
        recipe = load_recipe(resolve_recipe_path("tiny-cpu"), [f"rollout.backend={member.value}"])
        assert recipe.rollout.backend is member
        assert member.value in key_help(RolloutConfig, "backend")
    # refused by the loader, as every choice key is: the override named, then the choices
    with pytest.raises(
        RecipeError,
        match="^override 'rollout.backend=vllm': rollout.backend must be one of embedded, sglang, trl, got 'vllm'.$",
    ):
        load_recipe(resolve_recipe_path("tiny-cpu"), ["rollout.backend=vllm"])


def draft_vocabulary_recipe(overrides: list[str]):
    """tiny-cpu (builtin:tiny-arith, 66 tokens) drafting one level of `topk` branches."""
    return load_checked_recipe(
        resolve_recipe_path("tiny-cpu"),
        ["speculative.mode=fixed", "speculative.steps=1", "speculative.draft_tokens=0", *overrides],
    )


def test_topk_is_checked_once_against_the_draft_vocabulary_of_the_drafter_the_run_starts_with(tmp_path):
    # the values alone do not know the vocabulary: no bound there but the shapes' own (64 branches)
    draft_vocabulary_recipe(["speculative.topk=64", "drafter.vocab_size=16", "drafter.init=warmup"])
    # a fresh drafter (random, or online: the default) drafts over the target's 66 tokens: the shapes' cap binds
    check_recipe(draft_vocabulary_recipe(["speculative.topk=20", "drafter.init=random"]))
    check_recipe(draft_vocabulary_recipe(["speculative.topk=64"]))
    with pytest.raises(RecipeError, match="topk is 67; set it to at most 64"):
        check_recipe(draft_vocabulary_recipe(["speculative.topk=67", "drafter.init=random"]))
    # the warm-up keeps drafter.vocab_size tokens: 20 branches fit the target, not 16 draft tokens
    with pytest.raises(RecipeError, match="^speculative: speculative topk is 20; .* draft vocabulary size 16[.]$"):
        check_recipe(draft_vocabulary_recipe(["speculative.topk=20", "drafter.vocab_size=16", "drafter.init=warmup"]))
    # a saved drafter keeps its own vocabulary, whatever drafter.vocab_size says
    target, _ = load_policy("builtin:tiny-arith")
    save_drafter(EagleDrafter(target, vocabulary=DraftVocabulary(torch.arange(8), 66)), tmp_path / "drafter")
    saved = [f"drafter.init={tmp_path / 'drafter'}", "drafter.vocab_size=32"]
    check_recipe(draft_vocabulary_recipe(["speculative.topk=8", *saved]))
    with pytest.raises(RecipeError, match="draft vocabulary size 8"):
        check_recipe(draft_vocabulary_recipe(["speculative.topk=9", *saved]))
    # the rule table's shapes, in mode adaptive, meet the same bound
    rules = "speculative.rules=[{batch: [1, null], use: s1-k9-t10}]"
    with pytest.raises(RecipeError, match="^speculative.rules: rule 1: .*draft vocabulary size 8"):
        check_recipe(draft_vocabulary_recipe(["speculative.topk=1", "speculative.mode=adaptive", rules, *saved]))


@pytest.mark.parametrize(
    "path", [path for path in shipped_recipes() if path.name != "gpu-sglang.yaml"], ids=lambda path: path.name
)
def test_the_shipped_cpu_recipes_start_step_0_without_an_offline_warm_up(path, tmp_path):
    # the warm-up took 5-35 minutes before step 0 on a 2-core CPU (issue 48); it runs only where a recipe asks:
    # with auto (the default), a cache that holds no drafter for the model starts fresh and writes nothing
    recipe = load_recipe(path)
    assert recipe.drafter.init == "auto"
    assert setup.prepare_drafter(recipe, tmp_path) == (None, None)
    assert list(tmp_path.iterdir()) == []
