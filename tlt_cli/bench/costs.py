"""`tlt bench costs`: what the passes of a decode step cost on this machine, per running rows x tokens per row, the
grid speculative/costs.py's `PassCosts` holds and mode auto chooses with, measured afresh (never from the cache).

    tlt bench costs --recipe recipes/real-cpu.yaml --rows 1,4,16 --tokens 1,2,4,8 --dtypes float32,bfloat16

Per dtype it takes the decode plan `tlt train` makes (common.run_decode_plan: the dtype and the linear forms)
and times the target's forward over each rows x tokens point, logits included, over a 64-token prefix, as
tuning/pass_costs.py measures it (a plain step is 1 token a row; a verify pass the root and its drafted nodes),
the stable median of at most --repeats rounds (tuning/timing.py `stable_medians`); and the drafter's forward
over a few entry counts. Beside each point: the cost per token against a plain step of as many rows (below
1/tokens a token, a verify pass is nearly free).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from tlt_cli.bench.common import (
    MAX_BENCH_ROWS,
    BenchError,
    BenchReport,
    Progress,
    bench_recipe,
    dtype_label,
    model_pair,
    parse_dtypes,
    parse_numbers,
    print_load,
    render_table,
    run_decode_plan,
    starting_drafter_folder,
    worker_threads,
)
from tlt_cli.config import Recipe
from tlt_cli.rollout.model_pair import ModelPair
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.speculative.types import MAX_VERIFIED_TOKENS
from tlt_cli.tuning.pass_costs import measure_pass_costs


@dataclass(frozen=True)
class CostSettings:
    """What `tlt bench costs` measures: running rows, tokens per row, dtypes (empty: the recipe's), rounds."""

    rows: str = "1,2,4,8,16"
    tokens: str = "1,2,4,8"
    dtypes: str = ""
    repeats: int = 3


@dataclass(frozen=True)
class CostGrid:
    """The settings parsed: ascending rows and tokens, the dtypes, rounds."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    dtypes: list[str]
    rounds: int


def cost_grid(settings: CostSettings, recipe: Recipe) -> CostGrid:
    """The settings parsed and checked (a BenchError naming the option), before any model is loaded."""
    if settings.repeats < 1:
        raise BenchError(f"--repeats is {settings.repeats}; give 1 or more.")
    return CostGrid(
        tuple(sorted(set(parse_numbers("--rows", settings.rows, MAX_BENCH_ROWS)))),
        tuple(sorted(set(parse_numbers("--tokens", settings.tokens, MAX_VERIFIED_TOKENS)))),
        parse_dtypes(settings.dtypes, recipe),
        settings.repeats,
    )


def bench_costs(
    recipe: Recipe,
    drafter_folder: Path | None,
    pair: ModelPair,
    grid: CostGrid,
    report: BenchReport,
    progress: Progress,
) -> dict[str, PassCosts]:
    """dtype (common.dtype_label) -> the pass costs measured in the decode plan of that dtype, each dtype announced
    to `progress` as it starts and ends."""
    costs = {}
    for dtype in grid.dtypes:
        with progress.measuring(
            f"{dtype}: {len(grid.rows)} rows x {len(grid.tokens)} tokens, at most {grid.rounds} round(s)"
        ):
            plan = run_decode_plan(recipe, drafter_folder, dtype, max(grid.rows))
            label = dtype_label(dtype, plan)
            report.decode_plans[label] = plan.to_dict()
            costs[label] = measure_pass_costs(
                pair.target,
                pair.drafter,
                plan.torch_dtype,
                plan.linear_plan,
                grid.rows,
                grid.tokens,
                most_rounds=grid.rounds,
            )
    return costs


def summarize(costs: dict[str, PassCosts]) -> dict:
    """Per dtype and (rows, tokens): the pass's milliseconds and its cost per token against a plain step."""
    return {
        dtype: {
            f"{rows}x{tokens}": {
                "milliseconds": grid.target_ms[row_index][token_index],
                "per_token_vs_plain": grid.target_ms[row_index][token_index]
                / (tokens * grid.target_seconds(rows, 1) * 1e3),
            }
            for row_index, rows in enumerate(grid.rows)
            for token_index, tokens in enumerate(grid.tokens)
        }
        for dtype, grid in costs.items()
    }


def render(console: Console, costs: dict[str, PassCosts], summary: dict) -> None:
    """One row per (dtype, rows), a column per tokens per row; then the drafter's passes."""
    grid = next(iter(costs.values()))
    rows = [
        [
            f"{dtype}, rows {row_count}",
            *(
                f"{summary[dtype][f'{row_count}x{tokens}']['milliseconds']:.2f} ms "
                f"({summary[dtype][f'{row_count}x{tokens}']['per_token_vs_plain']:.2f})"
                for tokens in grid.tokens
            ),
        ]
        for dtype, dtype_costs in costs.items()
        for row_count in dtype_costs.rows
    ]
    title = "target forward per pass, logits included (per token against a plain step of as many rows)"
    render_table(console, title, ["dtype, rows", *(f"{tokens} tokens/row" for tokens in grid.tokens)], rows)
    if grid.drafter_entries:
        drafter_rows = [
            [dtype, *(f"{ms:.2f} ms" for ms in dtype_costs.drafter_ms)] for dtype, dtype_costs in costs.items()
        ]
        columns = ["dtype", *(f"{entries} entries" for entries in grid.drafter_entries)]
        render_table(console, "drafter forward per pass", columns, drafter_rows)


def run_costs_bench(
    recipe_name: str, overrides: list[str], settings: CostSettings, out: Path, console: Console
) -> dict:
    """`tlt bench costs`: load, measure every dtype's grid, print the tables, write the JSON."""
    recipe = bench_recipe(recipe_name, overrides)
    grid = cost_grid(settings, recipe)  # refused before the model loads, not after
    report = BenchReport.start("tlt bench costs", recipe_name, overrides, settings, [], grid.rounds)
    print_load(console, report.machine["usable_cores"])
    folder = starting_drafter_folder(recipe, console)
    with console.status("loading the target and its starting drafter as tlt train does"):
        pair, _ = model_pair(recipe, folder)
    with worker_threads(recipe), console.status("timing the passes"):
        costs = bench_costs(recipe, folder, pair, grid, report, Progress(console, len(grid.dtypes)))
    summary = summarize(costs)
    render(console, costs, summary)
    written = report.write(out, {dtype: grid.to_dict() for dtype, grid in costs.items()}, summary)
    print_load(console, report.machine["usable_cores"])
    console.print(f"wrote {out}", highlight=False, soft_wrap=True)
    return written
