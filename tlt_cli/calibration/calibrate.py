"""What `tlt calibrate RECIPE` does, in one call: load the model pair as `tlt train` would, measure, choose the rules.

`calibrate(recipe_path, overrides, settings)` loads the recipe (with `key=value` overrides), checks
that calibrating it makes sense (embedded engine, a trained drafter), builds the target and its
initial drafter exactly as a training run starts them (built-in tiny model and offline drafter
warm-up cached under the model cache, on the first actor device, in the actor's precision),
measures the grid (tlt_cli/calibration/measure.py) on `workers.threads_per_worker` threads with the
recipe's sampling settings; at running batch size B it times the prompts of the B longest responses
of a pool of worker shards (`group_size` samples of each prompt), so windows stay inside real responses,
and returns the measurements with the rules chosen from them (tlt_cli/calibration/rules.py).
Simplification: one process measures one worker's engine; contention between the recipe's
parallel workers is not reproduced.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tlt_cli.adaptive import OFF, RuleTableError, parse_label
from tlt_cli.calibration.measure import (
    Cell,
    ModelPair,
    measure_grid,
    prompts_by_response_length,
    window_token_budget,
)
from tlt_cli.calibration.rules import BatchChoice, calibrated_rules
from tlt_cli.calibration.settings import (
    CalibrationError,
    CalibrationSettings,
    check_settings,
)
from tlt_cli.config import CPU_DEVICES, Recipe, load_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.speculative import check_speculative_config
from tlt_cli.rollout.types import RolloutRequest, SamplingParams, SpeculativeConfig
from tlt_cli.tasks.base import Task
from tlt_cli.tasks.registry import build_task

CALIBRATION_DIRECTORY_SUFFIX = "-calibration"
OUTPUT_FILE = "calibration.json"
# worker shards generated per repeat to find rows with long responses
POOL_SHARDS = 4


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


def calibrate(recipe_name: str, overrides: list[str], settings: CalibrationSettings,
              on_window: Callable[[int, str, int], None] | None = None) -> CalibrationResult:
    """Measure the recipe's model pair on this machine and choose its rule table (see the module docstring).

    recipe_name: a YAML path or a shipped recipe name, written into the command as given.
    """
    recipe = load_recipe(resolve_recipe_path(recipe_name), overrides)
    check_settings(settings)
    check_recipe(recipe)
    largest = largest_running_batch(recipe)
    batch_sizes = batch_size_grid(settings.batch_sizes, largest)
    configs = parse_configs(settings.configs)
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    pair, tokenizer, drafter_source = load_model_pair(recipe)
    for config in configs.values():
        if config is not None:
            _check_shape(config, pair.drafter.config.vocab_size)
    sampling = SamplingParams(window_token_budget(settings.warmup_steps, settings.timed_steps, configs),
                              recipe.rollout.temperature, recipe.rollout.top_p, recipe.rollout.top_k)
    threads = torch.get_num_threads()
    torch.set_num_threads(recipe.workers.threads_per_worker)
    try:
        shard_sampling = replace(sampling, max_new_tokens=recipe.rollout.max_new_tokens)
        requests_for = _long_request_maker(pair, task, tokenizer, recipe, shard_sampling)
        cells = measure_grid(pair, batch_sizes, configs, requests_for, sampling, recipe.run.seed,
                             settings.warmup_steps, settings.timed_steps, settings.repeats, on_window)
    finally:
        torch.set_num_threads(threads)
    throughput = {size: {cell.label: cell.tokens_per_second for cell in cells if cell.batch_size == size} for size in batch_sizes}
    choices, rules = calibrated_rules(throughput, settings.margin, settings.candidates)
    return CalibrationResult(recipe, command_line(recipe_name, overrides, settings), settings, batch_sizes, list(configs),
                             cells, choices, rules, recipe.workers.threads_per_worker, str(pair.device), drafter_source)


def check_recipe(recipe: Recipe) -> None:
    """Calibration measures the embedded engine with a trained drafter; refuse what it cannot describe."""
    if recipe.rollout.backend != "embedded":
        raise CalibrationError(f"rollout.backend is {recipe.rollout.backend}; tlt calibrate measures the embedded engine, "
                               "so calibrate with rollout.backend=embedded.")
    if recipe.drafter.init == "random":
        raise CalibrationError("drafter.init is random, so accept lengths would say nothing about the drafter a run trains; "
                               "calibrate with drafter.init=warmup or a drafter folder.")


def largest_running_batch(recipe: Recipe) -> int:
    """The running batch a worker starts each rollout with: its prompts times group_size."""
    return recipe.train.prompts_per_step // recipe.workers.count * recipe.train.group_size


def batch_size_grid(requested: tuple[int, ...], largest: int) -> list[int]:
    """The requested batch sizes, checked; or powers of two up to `largest`, and `largest` itself."""
    if not requested:
        return sorted({*(2**power for power in range(int(math.log2(largest)) + 1)), largest})
    if any(size < 1 for size in requested) or len(set(requested)) != len(requested):
        raise CalibrationError(f"--batch-sizes {','.join(map(str, requested))}: give distinct sizes of at least 1, e.g. 1,2,4,8.")
    if max(requested) > largest:
        raise CalibrationError(f"--batch-sizes asks for {max(requested)}, but a worker's running batch never exceeds {largest} "
                               "(train.prompts_per_step / workers.count x train.group_size); measure up to that.")
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
            _check_shape(config, vocab_size=2**31)
            configs[config.label()] = config
    if len(configs) == 1:
        raise CalibrationError("--configs has no SD configuration; add at least one, e.g. off,s4-k1-t5.")
    return configs


def _check_shape(config: SpeculativeConfig, vocab_size: int) -> None:
    try:
        check_speculative_config(config, vocab_size)
    except ValueError as error:
        raise CalibrationError(f"--configs {config.label()}: {error}") from None


def load_model_pair(recipe: Recipe) -> tuple[ModelPair, PreTrainedTokenizerBase, str]:
    """(the target and its initial drafter as a training run starts them, the tokenizer, where the drafter came from)."""
    from tlt_cli.drafter.initial import initial_drafter, prepare_initial_drafter
    from tlt_cli.models.loading import load_policy
    from tlt_cli.trainer import cache_directory

    cache = cache_directory(recipe)
    dtype = torch.bfloat16 if recipe.actor.precision == "bf16" else torch.float32
    device = torch.device("cpu" if recipe.actor.devices == CPU_DEVICES else f"cuda:{recipe.actor.devices[0]}")
    target, tokenizer = load_policy(recipe.model.path, cache_dir=cache)
    target = target.to(device, dtype).eval()
    # the drafter a run would start with, whatever the recipe's speculative mode is now
    folder, _ = prepare_initial_drafter(replace(recipe, speculative=replace(recipe.speculative, mode="fixed")), cache)
    drafter = initial_drafter(recipe, folder, target).to(device, dtype).eval()
    return ModelPair(target, drafter, tokenizer.pad_token_id, tokenizer.eos_token_id, device), tokenizer, str(folder)


def _long_request_maker(pair: ModelPair, task: Task, tokenizer: PreTrainedTokenizerBase, recipe: Recipe,
                        sampling: SamplingParams) -> Callable[[int, int], list[RolloutRequest]]:
    """requests_for(batch_size, repeat): B rows whose natural responses are among the longest.

    A window holds the batch at B rows for a fixed number of decode steps, and a row that would
    have ended keeps decoding past its end, into text no rollout ever produces (and that drafts
    badly). So for each repeat this generates POOL_SHARDS worker shards of the task (their
    prompts, group_size samples each, plain decoding with the recipe's sampling and
    max_new_tokens) and hands out the prompts of the B longest responses of that pool: at small B
    exactly the rows a rollout's tail is made of, at large B rows that stay inside real responses
    for the whole window.
    """
    pools: dict[int, list[tuple[int, ...]]] = {}
    prompts_per_pool = POOL_SHARDS * (recipe.train.prompts_per_step // recipe.workers.count)

    def longest_first(repeat: int) -> list[tuple[int, ...]]:
        if repeat not in pools:
            prompts = [tuple(tokenizer.encode(task.problem(repeat * prompts_per_pool + number).prompt, add_special_tokens=False))
                       for number in range(prompts_per_pool)]
            pools[repeat] = prompts_by_response_length(pair, prompts, recipe.train.group_size, sampling, recipe.run.seed + repeat)
        return pools[repeat]

    def requests_for(batch_size: int, repeat: int) -> list[RolloutRequest]:
        return [RolloutRequest(row, prompt) for row, prompt in enumerate(longest_first(repeat)[:batch_size])]

    return requests_for


def command_line(recipe_name: str, overrides: list[str], settings: CalibrationSettings) -> str:
    """The `tlt calibrate` command that reproduces this calibration, every setting explicit."""
    words = ["tlt", "calibrate", recipe_name, *overrides]
    if settings.batch_sizes:
        words += ["--batch-sizes", ",".join(map(str, settings.batch_sizes))]
    words += ["--configs", ",".join(settings.configs), "--warmup-steps", str(settings.warmup_steps),
              "--timed-steps", str(settings.timed_steps), "--repeats", str(settings.repeats),
              "--margin", str(settings.margin), "--candidates", str(settings.candidates)]
    return shlex.join(words)


def default_output(recipe: Recipe) -> Path:
    """<run.output_dir>/<run.name>-calibration/calibration.json"""
    return Path(recipe.run.output_dir) / f"{recipe.run.name}{CALIBRATION_DIRECTORY_SUFFIX}" / OUTPUT_FILE
