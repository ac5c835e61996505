"""Whole rollouts: the adaptive engine vs always off vs always on (each fixed configuration).

    python scripts/bench_adaptive_rollout.py --repeats 5 --out benchmarks/bench_adaptive_rollout.json

Loads the recipe's target and its initial drafter exactly as `tlt train` starts them, then
generates one worker's shard per repeat, from task problem --first-prompt on (default 100000, so
not the problems `tlt calibrate` measured the rule table on) (prompts_per_step / workers prompts x group_size samples,
the recipe's sampling and max_new_tokens; the running batch shrinks as responses end) with:
  off       plain decoding steps
  fixed     one SD configuration at every step: each one --fixed lists (default: tlt calibrate's
            default configurations) and each one the rule table uses
  adaptive  the recipe's rule table (speculative.mode=adaptive)
Variants run in turn within each repeat, so machine load hits them alike. Every decode step is
timed and counted in its phase: `large` while the running batch is at least --large-batch (where
SD costs more than it saves), `tail` below; a step counts with the running batch it began with,
from its start to the end of its bookkeeping, and for the response tokens it added. Prints
emitted tokens per second over the whole rollout and per phase, with ratios to off (sampled
outputs differ between variants sample for sample, so rates, not times, are compared), and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.calibration.calibrate import load_model_pair
from tlt_cli.calibration.measure import bucket_totals, time_shard
from tlt_cli.calibration.settings import DEFAULT_CONFIGS
from tlt_cli.config import load_recipe
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.modes import speculative_decoder
from tlt_cli.speculative.rules import parse_label
from tlt_cli.speculative.types import OFF
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.tasks.registry import build_task
from tlt_cli.training.setup import speculative_plan

PHASES = ("large", "tail")


def variants(plan, seed: int, drafter, fixed: list[str]) -> dict[str, callable]:
    """name -> a factory of a fresh decoder (a new schedule per rollout, as each worker step starts one)."""
    in_table = {config.label() for config in plan.configs}
    labels = sorted((in_table | set(fixed)) - {OFF}, key=lambda label: (parse_label(label).steps, label))
    factories = {"off": lambda: SpeculativeDecoder(drafter, lambda batch_size: None)}
    for label in labels:
        factories[f"fixed {label}"] = fixed_factory(drafter, label)
    factories["adaptive"] = lambda: speculative_decoder(plan, drafter, seed)
    return factories


def fixed_factory(drafter, label: str):
    config = parse_label(label)
    return lambda: SpeculativeDecoder(drafter, config)


def run_shard(pair, decoder, requests, sampling, seed: int, large_batch: int) -> dict[str, list[float]]:
    """Per phase, [seconds, response tokens] of the shard's decode steps (each counted with the batch it began with)."""
    totals = bucket_totals(time_shard(pair, decoder, requests, sampling, seed), [1, large_batch])
    return {phase: [totals[size].seconds, totals[size].tokens] for phase, size in (("tail", 1), ("large", large_batch))}


def summarize(measurements: dict[str, list[dict[str, list[float]]]]) -> dict:
    """Per variant and phase: the median over repeats of emitted tokens per second, and its ratio to off."""

    def rate(runs, phases):
        return statistics.median(
            [sum(run[p][1] for p in phases) / max(sum(run[p][0] for p in phases), 1e-9) for run in runs]
        )

    scopes = {"whole rollout": PHASES, "large": ("large",), "tail": ("tail",)}
    rates = {
        name: {scope: rate(runs, phases) for scope, phases in scopes.items()} for name, runs in measurements.items()
    }
    return {
        name: {
            scope: {"tokens_per_second": value, "vs_off": value / rates["off"][scope]}
            for scope, value in by_scope.items()
        }
        for name, by_scope in rates.items()
    }


def render(summary: dict, large_batch: int) -> None:
    table = Table(
        title=f"whole rollouts of one worker shard: tokens/s (ratio to off); large = running batch >= {large_batch}"
    )
    for column in ("variant", "whole rollout", "large-batch phase", "tail phase"):
        table.add_column(column, justify="right")
    for name, by_scope in summary.items():
        table.add_row(
            name,
            *(
                f"{by_scope[scope]['tokens_per_second']:.0f} ({by_scope[scope]['vs_off']:.2f}x)"
                for scope in ("whole rollout", "large", "tail")
            ),
        )
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-cpu")
    parser.add_argument("--repeats", type=int, default=5, help="shards generated per variant; the median counts")
    parser.add_argument(
        "--large-batch", type=int, default=8, help="running batch sizes from here on count as the large phase"
    )
    parser.add_argument(
        "--fixed", default=",".join(DEFAULT_CONFIGS), help="fixed SD configurations to compare, comma-separated"
    )
    parser.add_argument("--first-prompt", type=int, default=100_000, help="index of the first task problem used")
    parser.add_argument("--out", type=Path, default=Path("bench-adaptive-rollout.json"))
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_args()
    recipe = load_recipe(resolve_recipe_path(arguments.recipe), ["speculative.mode=adaptive", *arguments.overrides])
    plan = speculative_plan(recipe.speculative)  # a bad table fails here, before any work
    torch.set_num_threads(recipe.workers.threads_per_worker)
    pair, tokenizer, _ = load_model_pair(recipe)
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    sampling = SamplingParams(
        recipe.rollout.max_new_tokens, recipe.rollout.temperature, recipe.rollout.top_p, recipe.rollout.top_k
    )
    prompts_per_shard = recipe.train.prompts_per_step // recipe.workers.count
    factories = variants(
        plan, recipe.run.seed, pair.drafter, [label for label in arguments.fixed.split(",") if label.strip()]
    )
    measurements: dict[str, list[dict[str, list[float]]]] = {name: [] for name in factories}
    for repeat in range(arguments.repeats):
        first = arguments.first_prompt + repeat * prompts_per_shard
        prompts = [
            tuple(encode_prompt(tokenizer, task.problem(first + number).prompt)) for number in range(prompts_per_shard)
        ]
        requests = [
            RolloutRequest(row, prompts[row // recipe.train.group_size])
            for row in range(prompts_per_shard * recipe.train.group_size)
        ]
        for name, factory in factories.items():
            measurements[name].append(
                run_shard(pair, factory(), requests, sampling, recipe.run.seed + repeat, arguments.large_batch)
            )
    summary = summarize(measurements)
    render(summary, arguments.large_batch)
    arguments.out.write_text(
        json.dumps(
            {
                "rules": [dict(rule) for rule in recipe.speculative.rules],
                "summary": summary,
                "measurements": measurements,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
