"""What `tlt calibrate RECIPE` does, in one call: load the model pair as `tlt train` would, measure, choose the rules.

`calibrate(recipe_path, overrides, settings, output)` loads the recipe (with `key=value` overrides), checks
that calibrating it makes sense (embedded engine, a trained drafter) and that its output files can be
written (before minutes of measuring, not after), builds the target and its
initial drafter exactly as a training run starts them (built-in tiny model and offline drafter
warm-up cached under the model cache, on the first actor device, in the dtype of the actor's weights, decoded in
the rollout's precision as `rollout.dtype` chooses it),
and on `workers.threads_per_worker` threads generates `repeats` worker shards of the task
(prompts_per_step / workers.count prompts x group_size samples, the recipe's sampling and
max_new_tokens) with every configuration (tlt_cli/calibration/measure.py); it returns the
measurements by running batch size with the rules chosen from them (tlt_cli/calibration/rules.py).
Simplification: one process measures one worker's engine; contention between the recipe's
parallel workers is not reproduced.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from tlt_cli.calibration.measure import Cell, measure_shards
from tlt_cli.calibration.rules import BatchChoice, calibrated_rules
from tlt_cli.calibration.settings import (
    CalibrationError,
    CalibrationSettings,
    check_settings,
)
from tlt_cli.config import DrafterStart, Recipe, RolloutBackendName
from tlt_cli.errors import nearest_existing
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.model_pair import ModelPair
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.rules import RuleTableError, parse_label
from tlt_cli.speculative.shapes import shape_problem, topk_fit_problem
from tlt_cli.speculative.types import OFF, SpeculativeConfig
from tlt_cli.tasks.base import Task
from tlt_cli.training import setup
from tlt_cli.training.step import encoded_prompts, grouped_requests
from tlt_cli.tuning.threads import torch_threads

CALIBRATION_DIRECTORY_SUFFIX = "-calibration"
OUTPUT_FILE = "calibration.json"


@dataclass(frozen=True)
class CalibrationResult:
    recipe: Recipe
    command: str
    settings: CalibrationSettings
    batch_sizes: list[int]
    labels: list[str]
    cells: list[Cell]
    choices: list[BatchChoice]
    rules: list[dict]
    threads: int
    device: str
    drafter: str
    # the dtype the shards were decoded in and the figures that chose it (tlt_cli/tuning/precision.py)
    rollout_precision: dict
    # batch size -> the configuration speculative.mode auto's cost model picks there, given the accept lengths
    # measured here (`cost_model_choices`)
    model_choices: dict[int, str]
    # where the measurements' JSON goes (the YAML fragment goes next to it): checked writable before measuring
    output: Path


def calibrate(
    recipe_name: str,
    overrides: list[str],
    settings: CalibrationSettings,
    output: Path | None = None,
    on_shard: Callable[[str, int], None] | None = None,
) -> CalibrationResult:
    """Measure the recipe's model pair on this machine and choose its rule table (see the module docstring).

    recipe_name: a YAML path or a shipped recipe name, written into the command as given. output: the JSON
    file to write (None: `default_output`).
    """
    recipe = load_checked_recipe(resolve_recipe_path(recipe_name), overrides)
    check_settings(settings)
    check_recipe(recipe)
    output = output or default_output(recipe)
    check_output(output)
    largest = largest_running_batch(recipe)
    batch_sizes = batch_size_grid(settings.batch_sizes, largest)
    configs = parse_configs(settings.configs)
    task = setup.task(recipe)
    sampling = setup.sampling(recipe)
    # a worker's thread count from the start: the linear-form plan and the rollout precision are measured with it
    with torch_threads(recipe.workers.threads_per_worker):
        pair, tokenizer, drafter_source = load_model_pair(recipe)
        for config in configs.values():
            if config is not None:
                _check_topk(config, pair.drafter.vocabulary.size)
        requests_for = _shard_maker(task, tokenizer, recipe)
        cells = measure_shards(
            pair, batch_sizes, configs, requests_for, sampling, recipe.run.seed, settings.repeats, on_shard
        )
    _check_every_cell_ran(cells, settings.repeats)
    throughput = {
        size: {cell.label: cell.tokens_per_second for cell in cells if cell.batch_size == size} for size in batch_sizes
    }
    choices, rules = calibrated_rules(throughput, settings.margin, settings.candidates)
    costs = pair.decode.pass_costs
    model_choices = cost_model_choices(cells, configs, costs) if costs is not None else {}
    return CalibrationResult(
        recipe,
        command_line(recipe_name, overrides, settings),
        settings,
        batch_sizes,
        list(configs),
        cells,
        choices,
        rules,
        recipe.workers.threads_per_worker,
        str(pair.device),
        drafter_source,
        pair.decode.precision,
        model_choices,
        output,
    )


def cost_model_choices(
    cells: list[Cell], configs: dict[str, SpeculativeConfig | None], costs: PassCosts
) -> dict[int, str]:
    """Per batch size, the configuration with the most tokens per second as mode auto predicts them: the measured
    pass costs, and each cell's measured accept length as the tokens a pass emits (what mode auto learns online)."""
    choices = {}
    for size in sorted({cell.batch_size for cell in cells}):
        predicted = {
            cell.label: size * cell.accept_length / costs.step_seconds(configs[cell.label], size, cell.accept_length)
            for cell in cells
            if cell.batch_size == size and cell.decode_steps > 0
        }
        choices[size] = max(predicted, key=predicted.get) if predicted else OFF
    return choices


def check_recipe(recipe: Recipe) -> None:
    """Calibration measures the embedded engine with a trained drafter; refuse what it cannot describe."""
    if recipe.rollout.backend != RolloutBackendName.embedded:
        raise CalibrationError(
            f"rollout.backend is {recipe.rollout.backend}; tlt calibrate measures the embedded engine, "
            "so calibrate with rollout.backend=embedded."
        )
    if recipe.drafter.init == DrafterStart.random:
        raise CalibrationError(
            "drafter.init is random, so accept lengths would say nothing about the drafter a run trains; "
            "calibrate with drafter.init=warmup or a drafter folder."
        )


def largest_running_batch(recipe: Recipe) -> int:
    """The running batch a worker starts each rollout with: its prompts times group_size."""
    return recipe.train.prompts_per_step // recipe.workers.count * recipe.train.group_size


def batch_size_grid(requested: tuple[int, ...], largest: int) -> list[int]:
    """The requested batch sizes, checked; or powers of two up to `largest`, and `largest` itself."""
    if not requested:
        return sorted({*(2**power for power in range(int(math.log2(largest)) + 1)), largest})
    if any(size < 1 for size in requested) or len(set(requested)) != len(requested):
        raise CalibrationError(
            f"--batch-sizes {','.join(map(str, requested))}: give distinct sizes of at least 1, e.g. 1,2,4,8."
        )
    if max(requested) > largest:
        raise CalibrationError(
            f"--batch-sizes asks for {max(requested)}, but a worker's running batch never exceeds {largest} "
            "(train.prompts_per_step / workers.count x train.group_size); measure up to that."
        )
    return sorted(requested)


def parse_configs(labels: tuple[str, ...]) -> dict[str, SpeculativeConfig | None]:
    """Labels -> configurations, `off` first (it is always measured: every choice is made against it)."""
    configs: dict[str, SpeculativeConfig | None] = {OFF: None}
    for label in labels:
        try:
            config = parse_label(label)
        except RuleTableError as error:
            raise CalibrationError(f"--configs: {error}") from None
        if config is not None and config.label() in configs:
            raise CalibrationError(f"--configs lists {config.label()} twice.")
        if config is not None:
            _check_shape(label, config)
            configs[config.label()] = config
    if len(configs) == 1:
        raise CalibrationError("--configs has no SD configuration; add at least one, e.g. off,s4-k1-t5.")
    return configs


def _check_shape(label: str, config: SpeculativeConfig) -> None:
    """The shape `label` (as the user typed it) names can run; the error quotes the label, not its parsed form."""
    problem = shape_problem(config)
    if problem is not None:
        raise CalibrationError(f"--configs {label}: {problem}")


def _check_topk(config: SpeculativeConfig, draft_vocab_size: int) -> None:
    problem = topk_fit_problem(config, draft_vocab_size)
    if problem is not None:
        raise CalibrationError(f"--configs {config.label()}: {problem}")


def load_model_pair(recipe: Recipe) -> tuple[ModelPair, PreTrainedTokenizerBase, str]:
    """(the target and its initial drafter as a training run starts them, the tokenizer, where the drafter came
    from), decoding in the rollout's precision with the pass costs measured for a worker's rows
    (setup.py `model_pair` and `decode_plan`)."""
    # the drafter a run would start with, whatever the recipe's speculative mode is now; an online start's fresh
    # drafter says nothing of the drafter the run trains, so the offline warm-up's stands in for it
    drafter_start = replace(recipe.drafter, init="warmup") if recipe.drafter.init == "online" else recipe.drafter
    folder, _ = setup.prepare_drafter(replace(recipe, drafter=drafter_start), setup.model_cache(recipe), needed=True)
    # the forms a worker's engine computes the pair's linear layers with (EmbeddedRollout), so calibrated costs are
    # the costs a run pays, and the precision it decodes in: the SD economics (what a verify costs against a step)
    # change with it; and the pass costs mode auto chooses with, for the table the cost model would choose
    request = setup.PlanRequest(rows=recipe.samples_per_worker, speculates=True, costs=True)
    decode = setup.decode_plan(recipe, folder, request)
    pair, tokenizer = setup.model_pair(recipe, decode, folder)
    return pair, tokenizer, str(folder)


def _shard_maker(
    task: Task, tokenizer: PreTrainedTokenizerBase, recipe: Recipe
) -> Callable[[int], list[RolloutRequest]]:
    """requests_for(repeat): one worker shard of fresh prompts, group_size rows of each, as a training step hands
    out."""
    prompts_per_shard = recipe.train.prompts_per_step // recipe.workers.count

    def requests_for(repeat: int) -> list[RolloutRequest]:
        problems = [task.problem(repeat * prompts_per_shard + number) for number in range(prompts_per_shard)]
        return grouped_requests(encoded_prompts(tokenizer, problems), recipe.train.group_size)

    return requests_for


def _check_every_cell_ran(cells: list[Cell], repeats: int) -> None:
    """A bucket no decode step reached has no rate to compare; say how to get one."""
    for cell in cells:
        if cell.decode_steps == 0:
            raise CalibrationError(
                f"no decode step ran at running batch size {cell.batch_size} with {cell.label} in {repeats} "
                "shard(s) (responses ended together); raise --repeats or measure other --batch-sizes."
            )


def command_line(recipe_name: str, overrides: list[str], settings: CalibrationSettings) -> str:
    """The `tlt calibrate` command that reproduces this calibration, every setting explicit."""
    words = ["tlt", "calibrate", recipe_name, *overrides]
    if settings.batch_sizes:
        words += ["--batch-sizes", ",".join(map(str, settings.batch_sizes))]
    words += [
        "--configs",
        ",".join(settings.configs),
        "--repeats",
        str(settings.repeats),
        "--margin",
        str(settings.margin),
        "--candidates",
        str(settings.candidates),
    ]
    return shlex.join(words)


def default_output(recipe: Recipe) -> Path:
    """<run.output_dir>/<run.name>-calibration/calibration.json"""
    return Path(recipe.run.output_dir).expanduser() / f"{recipe.run.name}{CALIBRATION_DIRECTORY_SUFFIX}" / OUTPUT_FILE


def fragment_path(json_path: Path) -> Path:
    """The YAML fragment's file, next to the measurements' JSON."""
    return json_path.with_suffix(".yaml")


def check_output(json_path: Path) -> None:
    """CalibrationError naming --output when the JSON or the fragment next to it cannot be written there: one is a
    folder, or the closest existing part of their folder is a file or not writable."""
    for path in (json_path, fragment_path(json_path)):
        if path.is_dir():
            raise CalibrationError(f"--output {json_path}: {path} is a folder; give the path of a JSON file.")
    existing = nearest_existing(json_path.parent)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "a file, not a folder" if not existing.is_dir() else "not writable"
        raise CalibrationError(
            f"--output {json_path}: its folder cannot be created or written ({existing} is {what}); "
            "choose another --output."
        )
