"""Whole rollouts with speculative.mode auto against plain decoding and fixed shapes, per batch size and dtype.

    python scripts/bench_auto_rollout.py --recipe recipes/real-cpu.yaml --batch-sizes 1,4,16 \
        --dtypes float32,bfloat16 --repeats 2 --out benchmarks/bench_auto_rollout.json

Loads the recipe's target and its starting drafter as `tlt train` starts them and, per rollout dtype, the decode
plan a run would have (setup.py `decode_plan_for`: linear forms and the pass costs measured in that dtype). For each
batch size B it generates B rows (B // group_size prompts of the recipe's task x group_size samples, grouped as a
GRPO step groups them, so n-gram drafts read the siblings) to their natural end, the running batch shrinking as
responses end, with each variant in turn (so machine load hits them alike):
  off    plain decoding steps
  fixed  one SD configuration at every step (--fixed)
  auto   the cost-model schedule of mode auto; one schedule per (dtype, B) kept across repeats, as a worker keeps its
         schedule across steps (repeat 1 starts from the priors)
Every decode step is timed. Prints per variant the response tokens and seconds beside each other (variants sample
different lengths), tokens per second and its ratio to off, auto against the best fixed shape, and for auto the
cost model's predicted tokens per second beside the measured; writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.calibration.calibrate import load_model_pair
from tlt_cli.calibration.measure import ModelPair, fixed_decoder, time_shard
from tlt_cli.config import RolloutDtype, SpeculativeMode, load_recipe
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.modes import speculative_decoder
from tlt_cli.speculative.rules import parse_label
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.tasks.registry import build_task
from tlt_cli.training import setup

DEFAULT_FIXED = "ngram4,s2-k1-t3,s4-k1-t5,s2-k1-t3+ngram4"


def requests_for(recipe, tokenizer, task, rows: int, first_prompt: int) -> list[RolloutRequest]:
    """`rows` requests: ceil(rows / group_size) prompts, group_size samples each (fewer for B < group_size)."""
    group_size = min(recipe.train.group_size, rows)
    prompts = [
        tuple(encode_prompt(tokenizer, task.problem(first_prompt + number).prompt))
        for number in range(-(-rows // group_size))
    ]
    return [RolloutRequest(row, prompts[row // group_size], group=row // group_size) for row in range(rows)]


def pair_in(recipe, dtype: str) -> ModelPair:
    """The target and drafter with the decode plan of `dtype` (pass costs included, for mode auto)."""
    recipe = dataclasses.replace(recipe, rollout=dataclasses.replace(recipe.rollout, dtype=RolloutDtype(dtype)))
    pair, _, _ = load_model_pair(recipe)
    return pair


def run(pair: ModelPair, decoder, requests, sampling, seed: int) -> dict:
    steps = time_shard(pair, decoder, requests, sampling, seed)
    return {"seconds": sum(step.seconds for step in steps), "tokens": sum(step.tokens for step in steps)}


def decoder_factories(pair: ModelPair, auto, fixed: list[str]) -> dict:
    """name -> a maker of the decoder a rollout runs with (auto: the one schedule, kept across repeats)."""
    factories = {"off": lambda: fixed_decoder(pair, None), "auto": lambda: auto}
    for label in fixed:
        config = parse_label(label)
        factories[f"fixed {label}"] = lambda config=config: fixed_decoder(pair, config)
    return factories


def bench(recipe, arguments) -> dict:
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    sampling = SamplingParams(
        recipe.rollout.max_new_tokens, recipe.rollout.temperature, recipe.rollout.top_p, recipe.rollout.top_k
    )
    plan = setup.speculative_plan(dataclasses.replace(recipe.speculative, mode=SpeculativeMode.auto, rules=[]))
    results: dict = {}
    for dtype in arguments.dtypes.split(","):
        pair = pair_in(recipe, dtype)
        tokenizer = setup.policy_and_tokenizer(recipe)[1]
        for rows in (int(size) for size in arguments.batch_sizes.split(",")):
            decode = setup.decode_plan_for(
                pair.target,
                pair.drafter,
                dtype,
                recipe.rollout.linear_forms,
                setup.model_cache(recipe),
                rows,
                speculates=True,
                costs=True,
            )
            auto = speculative_decoder(plan, pair.drafter, recipe.run.seed, decode.pass_costs)
            variants = decoder_factories(pair, auto, arguments.fixed.split(","))
            cell = {name: [] for name in variants}
            for repeat in range(arguments.repeats):
                requests = requests_for(recipe, tokenizer, task, rows, arguments.first_prompt + repeat * rows)
                for name, make in variants.items():
                    cell[name].append(run(pair, make(), requests, sampling, recipe.run.seed + repeat))
            usage = auto.adaptive_schedule.take_usage()
            cell["auto usage"] = {label: dataclasses.asdict(value) for label, value in usage.items()}
            results[f"{dtype} B={rows}"] = cell
            Console().print(f"done: {dtype} B={rows}")
    return results


def summarize(results: dict) -> dict:
    summary = {}
    for key, cell in results.items():
        runs = {name: value for name, value in cell.items() if name != "auto usage"}
        rates = {
            name: statistics.median(run["tokens"] / run["seconds"] for run in values) for name, values in runs.items()
        }
        fixed = {name: rate for name, rate in rates.items() if name.startswith("fixed")}
        usage = cell["auto usage"]
        sd = [value for label, value in usage.items() if label != "off"]
        predicted = sum(value["predicted_tokens"] for value in sd) / max(
            sum(value["predicted_seconds"] for value in sd), 1e-9
        )
        measured = sum(value["tokens"] for value in sd) / max(sum(value["seconds"] for value in sd), 1e-9)
        all_seconds = sum(value["seconds"] for value in usage.values())
        summary[key] = {
            "tokens_per_second": rates,
            "vs_off": {name: rate / rates["off"] for name, rate in rates.items()},
            "auto_vs_best_fixed": rates["auto"] / max(fixed.values()) if fixed else None,
            "auto_sd_share": sum(value["seconds"] for value in sd) / all_seconds if all_seconds else 0.0,
            "auto_sd_tokens_per_second": {"predicted": predicted if sd else None, "measured": measured if sd else None},
            "auto_configs": {label: value["decode_steps"] for label, value in usage.items()},
        }
    return summary


def render(results: dict, summary: dict) -> None:
    table = Table(title="whole rollouts: response tokens / seconds (tokens/s, ratio to off), median run")
    table.add_column("dtype, batch")
    names = [name for name in next(iter(results.values())) if name != "auto usage"]
    for name in names:
        table.add_column(name, justify="right")
    table.add_column("auto / best fixed", justify="right")
    table.add_column("auto SD share; SD tok/s measured (predicted)", justify="right")
    for key, cell in results.items():
        row = summary[key]
        cells = []
        for name in names:
            last = cell[name][-1]
            rate, ratio = row["tokens_per_second"][name], row["vs_off"][name]
            cells.append(f"{last['tokens']} / {last['seconds']:.1f} s ({rate:.1f}, {ratio:.2f}x)")
        sd = row["auto_sd_tokens_per_second"]
        rates = f"{sd['measured']:.1f} ({sd['predicted']:.1f})" if sd["measured"] is not None else "-"
        table.add_row(key, *cells, f"{row['auto_vs_best_fixed']:.2f}x", f"{row['auto_sd_share']:.0%}; {rates}")
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/real-cpu.yaml")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--fixed", default=DEFAULT_FIXED, help="fixed SD configurations, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--first-prompt", type=int, default=100_000, help="index of the first task problem used")
    parser.add_argument("--out", type=Path, default=Path("bench-auto-rollout.json"))
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_args()
    recipe = load_recipe(resolve_recipe_path(arguments.recipe), arguments.overrides)
    torch.set_num_threads(recipe.workers.threads_per_worker)
    results = bench(recipe, arguments)
    summary = summarize(results)
    render(results, summary)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps({"summary": summary, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
