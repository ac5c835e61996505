"""`tlt calibrate`: steps bucketed by batch size, rules from measurements (pure), the YAML fragment as a recipe,
--write-recipe, the CLI on a tiny pair, errors."""

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from omegaconf import OmegaConf
from tiny_models import save_tiny_pair
from typer.testing import CliRunner

from tlt_cli.calibration.calibrate import batch_size_grid, load_model_pair
from tlt_cli.calibration.measure import bucket_of, bucket_totals, time_shard
from tlt_cli.calibration.recipe_text import RecipeEditError, write_rules_into_recipe
from tlt_cli.calibration.rules import (
    CALIBRATED_BY,
    BatchChoice,
    calibrated_rules,
    fragment_text,
    rules_block,
    rules_from_choices,
)
from tlt_cli.cli import app
from tlt_cli.config import load_recipe, recipe_from_config
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine.linear_forms import linear_layers, shape_key
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.tiny import (
    build_tiny_model,
    tiny_model_config,
    tiny_tokenizer,
)
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.model_pair import ModelPair, fixed_decoder, shard_engine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.rules import build_rules
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig

torch.set_num_threads(1)
runner = CliRunner()
TINY_RECIPE = RECIPES_DIRECTORY / "tiny-cpu.yaml"


def test_a_step_counts_for_the_largest_grid_size_not_above_its_batch():
    grid = [2, 4, 8]
    assert [bucket_of(size, grid) for size in (1, 2, 3, 4, 7, 8, 32)] == [2, 2, 2, 4, 4, 8, 8]
    steps = [DecodeStep(8, 8, 0.5), DecodeStep(6, 9, 0.25), DecodeStep(5, 7, 0.25), DecodeStep(1, 3, 0.125)]
    totals = bucket_totals(steps, grid)
    assert (totals[8].decode_steps, totals[8].row_steps, totals[8].tokens, totals[8].seconds) == (1, 8, 8, 0.5)
    assert (totals[4].decode_steps, totals[4].row_steps, totals[4].tokens, totals[4].seconds) == (2, 11, 16, 0.5)
    assert (totals[2].decode_steps, totals[2].row_steps, totals[2].tokens) == (1, 1, 3)


def test_sd_is_chosen_only_where_it_beats_off_by_the_margin_and_equal_neighbours_merge():
    throughput = {
        1: {"off": 100.0, "s2-k1-t3": 180.0, "s4-k1-t5": 175.0},
        2: {"off": 100.0, "s2-k1-t3": 150.0, "s4-k1-t5": 120.0},
        4: {"off": 100.0, "s2-k1-t3": 104.0, "s4-k1-t5": 80.0},  # +4%: not worth it at a 5% margin
        8: {"off": 100.0, "s2-k1-t3": 70.0, "s4-k1-t5": 50.0},
    }
    choices, rules = calibrated_rules(throughput, margin=0.05, max_candidates=2)
    assert [(choice.batch_size, choice.use) for choice in choices] == [
        (1, "s2-k1-t3"),
        (2, "s2-k1-t3"),
        (4, "off"),
        (8, "off"),
    ]
    assert choices[0].candidates == ("s4-k1-t5",) and choices[2].candidates == ("s2-k1-t3",)
    # candidates of a merged rule are those every merged batch size kept
    assert rules == [{"batch": [1, 3], "use": "s2-k1-t3"}, {"batch": [4, None], "use": "off"}]
    assert len(build_rules(rules)) == 2


def test_buckets_start_at_one_end_open_and_keep_shared_candidates():
    choices = [
        BatchChoice(2, "s4-k1-t5", ("s2-k1-t3", "off")),
        BatchChoice(4, "s4-k1-t5", ("s2-k1-t3",)),
        BatchChoice(16, "off", ()),
    ]
    assert rules_from_choices(choices) == [
        {"batch": [1, 15], "use": "s4-k1-t5", "candidates": ["s2-k1-t3"]},
        {"batch": [16, None], "use": "off"},
    ]
    assert rules_from_choices([BatchChoice(1, "off", ())]) == [{"batch": [1, None], "use": "off"}]


def test_no_candidates_when_asked_for_none_and_off_everywhere_when_sd_never_pays():
    throughput = {1: {"off": 100.0, "s2-k1-t3": 99.0}, 8: {"off": 100.0, "s2-k1-t3": 60.0}}
    choices, rules = calibrated_rules(throughput, margin=0.05, max_candidates=0)
    assert all(choice.candidates == () for choice in choices)
    assert rules == [{"batch": [1, None], "use": "off"}]


def test_default_grid_is_powers_of_two_up_to_the_first_running_batch():
    assert batch_size_grid((), 32) == [1, 2, 4, 8, 16, 32]
    assert batch_size_grid((), 24) == [1, 2, 4, 8, 16, 24]
    assert batch_size_grid((4, 1), 8) == [1, 4]


def test_fragment_merged_into_the_tiny_recipe_validates():
    _, rules = calibrated_rules(
        {
            1: {"off": 100.0, "s4-k2-t8": 150.0, "s2-k1-t3": 148.0},
            4: {"off": 100.0, "s4-k2-t8": 90.0, "s2-k1-t3": 96.0},
        },
        margin=0.05,
        max_candidates=2,
    )
    fragment = fragment_text(rules, "tlt calibrate recipes/tiny-cpu.yaml --batch-sizes 1,4")
    assert (
        fragment.startswith("# speculative decoding in the rollout\nspeculative:")
        and "# calibrated by: tlt calibrate recipes/tiny-cpu.yaml" in fragment
    )
    merged = OmegaConf.merge(OmegaConf.load(TINY_RECIPE), OmegaConf.create(fragment))
    recipe = recipe_from_config(merged)
    assert recipe.speculative.mode == "adaptive" and recipe.speculative.rules == rules
    assert rules[-1] == {"batch": [4, None], "use": "off", "candidates": ["s2-k1-t3"]}


def test_write_recipe_replaces_only_the_rules_block_and_keeps_comments(tmp_path):
    recipe_path = tmp_path / "tiny.yaml"
    shutil.copy(TINY_RECIPE, recipe_path)
    original = recipe_path.read_text()
    _, first = calibrated_rules({1: {"off": 100.0, "s2-k1-t3": 150.0}, 8: {"off": 100.0, "s2-k1-t3": 80.0}}, 0.05, 2)
    write_rules_into_recipe(recipe_path, first, "tlt calibrate first")
    _, second = calibrated_rules({1: {"off": 100.0, "s4-k1-t5": 150.0}, 2: {"off": 100.0, "s4-k1-t5": 140.0}}, 0.05, 2)
    write_rules_into_recipe(recipe_path, second, "tlt calibrate second")
    edited = recipe_path.read_text()
    assert "tlt calibrate first" not in edited and edited.count("# calibrated by: tlt calibrate second") == 1
    assert edited.count("rules:") == 1 and "mode: adaptive" in edited
    # the shipped recipe has no table (mode auto): the block comes with its key's help, every other comment is kept
    added = (CALIBRATED_BY, *(line.strip() for line in rules_block(second, "", "  ") if line.strip().startswith("#")))
    assert [
        line for line in original.splitlines() if line.lstrip().startswith("#") and not line.lstrip().startswith(added)
    ] == [line for line in edited.splitlines() if line.lstrip().startswith("#") and not line.lstrip().startswith(added)]
    before, after = load_recipe(TINY_RECIPE), load_recipe(recipe_path)
    assert after.speculative.rules == second and after.drafter == before.drafter and after.rollout == before.rollout


def test_write_recipe_appends_a_missing_section_and_refuses_what_it_cannot_edit(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("# tlt train plain.yaml\nrun:\n  name: plain\n")
    rules = [{"batch": [1, None], "use": "s2-k1-t3"}]
    write_rules_into_recipe(plain, rules, "tlt calibrate plain.yaml")
    assert load_recipe(plain).speculative.rules == rules and plain.read_text().startswith(
        "# tlt train plain.yaml\nrun:"
    )
    assert "\n\n# speculative decoding in the rollout\nspeculative:\n" in plain.read_text()  # under its help
    flow = tmp_path / "flow.yaml"
    flow.write_text("run: {name: flow}\nspeculative: {mode: fixed}\n")
    with pytest.raises(RecipeEditError, match="paste the printed fragment"):
        write_rules_into_recipe(flow, rules, "tlt calibrate flow.yaml")
    assert flow.read_text() == "run: {name: flow}\nspeculative: {mode: fixed}\n"
    assert list(tmp_path.glob(".*")) == []


@pytest.fixture(scope="module")
def tiny_pair_recipe(tmp_path_factory) -> Path:
    """A recipe over a tiny random model folder and a random drafter folder (no warm-up)."""
    folder = tmp_path_factory.mktemp("pair")
    save_tiny_pair(folder)
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        f"# tlt train {recipe}\nrun: {{name: probe, output_dir: {folder}}}\nmodel: {{path: {folder / 'model'}}}\n"
        "train: {prompts_per_step: 2, group_size: 2}\nworkers: {count: 1}\n"
        f"speculative:\n  # plain decoding until calibrated\n  mode: off\ndrafter: {{init: {folder / 'drafter'}}}\n"
    )
    return recipe


def test_cli_measures_a_tiny_pair_and_writes_json_fragment_and_recipe(tiny_pair_recipe, tmp_path):
    output = tmp_path / "out" / "calibration.json"
    rewritten = tmp_path / "rewritten.yaml"
    shutil.copy(tiny_pair_recipe, rewritten)
    result = runner.invoke(
        app,
        [
            "calibrate",
            str(tiny_pair_recipe),
            "rollout.max_new_tokens=40",
            "--batch-sizes",
            "1,4",
            "--configs",
            "off,s2-k1-t3,s2-k2-t4,ngram2,s2-k1-t3+ngram2,s2-k1-t3|ngram2",
            "--repeats",
            "2",
            "--output",
            str(output),
            "--write-recipe",
            str(rewritten),
        ],
    )
    assert result.exit_code == 0, result.output
    for text in (
        "decode throughput by running batch size",
        "s2-k1-t3",
        "s2-k2-t4",
        "s2-k1-t3+ngram2",
        "s2-k1-t3|ngram2",
        "speculative:",
        "mode: adaptive",
        "rules:",
    ):
        assert text in result.output, text
    written = json.loads(output.read_text())
    assert written["settings"]["batch_sizes"] == [1, 4] and written["settings"]["configs"] == [
        "off",
        "s2-k1-t3",
        "s2-k2-t4",
        "ngram2",
        "s2-k1-t3+ngram2",
        "s2-k1-t3|ngram2",
    ]
    cells = {(cell["batch_size"], cell["config"]): cell for cell in written["measurements"]}
    assert len(cells) == 12 and all(len(cell["shards"]) == 2 for cell in cells.values())
    assert cells[(1, "off")]["accept_length"] == 1.0 and cells[(4, "off")]["ratio_vs_off"] == 1.0
    # off emits one token per running row and step; a chain of 2 at most three
    assert all(
        shard["tokens"] == shard["row_steps"]
        for cell in (cells[(1, "off")], cells[(4, "off")])
        for shard in cell["shards"]
    )
    assert 1.0 <= cells[(4, "s2-k1-t3")]["accept_length"] <= 3.0
    assert 1.0 <= cells[(4, "ngram2")]["accept_length"] <= 3.0  # model-free: at most 2 proposed + the bonus
    # every shard runs 4 rows of at most 40 tokens: the buckets share out all of its tokens
    for label in ("off", "s2-k1-t3", "s2-k2-t4", "ngram2", "s2-k1-t3+ngram2", "s2-k1-t3|ngram2"):
        for repeat in range(2):
            shard_tokens = sum(cells[(size, label)]["shards"][repeat]["tokens"] for size in (1, 4))
            assert 4 <= shard_tokens <= 4 * 40
    assert written["command"].startswith(
        f"tlt calibrate {tiny_pair_recipe} rollout.max_new_tokens=40 --batch-sizes 1,4"
    )
    rules = written["rules"]
    assert rules[0]["batch"][0] == 1 and rules[-1]["batch"][1] is None and len(build_rules(rules)) == len(rules)
    fragment = output.with_suffix(".yaml").read_text()
    recipe = recipe_from_config(OmegaConf.merge(OmegaConf.load(tiny_pair_recipe), OmegaConf.create(fragment)))
    assert recipe.speculative.rules == rules
    assert (
        load_recipe(rewritten).speculative.rules == rules
        and "# plain decoding until calibrated" in rewritten.read_text()
    )


def test_shards_are_timed_with_the_linear_forms_a_worker_uses(tiny_pair_recipe, tmp_path):
    """rollout.linear_forms=auto: the pair's plan covers the target's and the drafter's shapes, measured into
    model.cache_dir, and every shard's engine drafts with it; off: plain F.linear."""
    cache = tmp_path / "cache"
    recipe = load_checked_recipe(tiny_pair_recipe, ["rollout.linear_forms=auto", f"model.cache_dir={cache}"])
    pair, _, _ = load_model_pair(recipe)
    assert pair.decode.linear_plan is not None
    shapes = {shape_key(layer.weight) for layer in linear_layers([pair.target, pair.drafter])}
    assert shapes <= set(pair.decode.linear_plan.forms) and list(cache.rglob("*.json"))
    assert shard_engine(pair, fixed_decoder(pair, None)).speculative.drafter_forms.plan is pair.decode.linear_plan
    recipe = load_checked_recipe(tiny_pair_recipe, ["rollout.linear_forms=off", f"model.cache_dir={cache}"])
    pair, _, _ = load_model_pair(recipe)
    assert pair.decode.linear_plan is None
    assert shard_engine(pair, fixed_decoder(pair, None)).speculative.drafter_forms is None


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["no-such-recipe.yaml"], "does not exist"),
        (["{recipe}", "--batch-sizes", "1,x"], "--batch-sizes '1,x'"),
        (["{recipe}", "--batch-sizes", "0,2"], "distinct sizes of at least 1"),
        (["{recipe}", "--batch-sizes", "64"], "never exceeds 4"),
        (["{recipe}", "--configs", "off,bogus"], "'bogus' is not an SD configuration"),
        (["{recipe}", "--configs", "off"], "no SD configuration"),
        (["{recipe}", "--configs", "s2-k1-t7"], "--configs s2-k1-t7"),
        (["{recipe}", "--configs", "off,ngram0"], "'ngram0' is not an SD configuration"),
        (["{recipe}", "--configs", "s0-k0-t0"], "--configs s0-k0-t0: speculative steps is 0"),
        (["{recipe}", "--repeats", "0"], "--repeats is 0"),
        (["{recipe}", "drafter.init=random"], "drafter.init is random"),
        (["{recipe}", "train.nope=1"], "train.nope"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_pair_recipe, arguments, message):
    result = runner.invoke(app, ["calibrate", *[argument.format(recipe=tiny_pair_recipe) for argument in arguments]])
    assert result.exit_code == 2, result.output
    assert (
        message in result.output and len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    )


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("a_file/out/calibration.json", "a_file is a file, not a folder); choose another --output."),
        ("a_folder", "a_folder is a folder; give the path of a JSON file."),
        ("fragment.json", "fragment.yaml is a folder; give the path of a JSON file."),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_measuring(tiny_pair_recipe, tmp_path, output, message):
    """Refused before the model pair loads (`load_model_pair` would take minutes on a real model), one line, exit 2."""
    (tmp_path / "a_file").write_text("not a folder\n")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "fragment.yaml").mkdir()
    before = sorted(tmp_path.rglob("*"))
    with mock.patch("tlt_cli.calibration.calibrate.load_model_pair", side_effect=AssertionError("measured")):
        result = runner.invoke(app, ["calibrate", str(tiny_pair_recipe), "--output", str(tmp_path / output)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().endswith(message) and len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output and sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("config", [None, SpeculativeConfig(2), SpeculativeConfig(3, topk=2, draft_tokens=6)])
def test_decode_steps_count_every_response_token_once_as_the_batch_shrinks(config):
    tokenizer = tiny_tokenizer()
    model_config = tiny_model_config(
        tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    target = build_tiny_model(0, model_config).eval()
    drafter = EagleDrafter(target, seed=0)
    prompts = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in ("a1=", "a2b3=", "a4b5c6=")]
    requests = [RolloutRequest(row, prompts[row // 2]) for row in range(6)]
    sampling = SamplingParams(max_new_tokens=120, temperature=1.0)  # a random model ends a row with p ~ 1/66 per token
    engine = EmbeddedEngine(
        target,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        speculative=SpeculativeDecoder(drafter, lambda batch_size: config),
    )
    steps = []
    # seed 0: every row outlives the prefill (a row ending at its first token would start the steps at 5)
    completions = engine.generate(requests, sampling, torch.Generator().manual_seed(0), on_decode_step=steps.append)
    sizes = [step.batch_size for step in steps]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 6 and len(set(sizes)) > 1
    assert all(
        step.seconds > 0 and 1 <= step.tokens <= step.batch_size * (1 + (config.steps if config else 0))
        for step in steps
    )
    # the prefill emits each row's first token; every other response token comes from exactly one decode step
    assert sum(step.tokens for step in steps) == sum(len(completion.response_ids) - 1 for completion in completions)
    # time_shard is that generation with the configuration fixed: the same steps, timed afresh
    pair = ModelPair(target, drafter, tokenizer.pad_token_id, tokenizer.eos_token_id, torch.device("cpu"))
    timed = time_shard(pair, fixed_decoder(pair, config), requests, sampling, seed=0)
    assert [(step.batch_size, step.tokens) for step in timed] == [(step.batch_size, step.tokens) for step in steps]
