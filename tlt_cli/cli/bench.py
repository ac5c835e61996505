"""`tlt bench rollout | costs | update | runs`: thin commands over tlt_cli/bench/, each printing a table and
writing JSON that names the machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tlt_cli.cli.output import console, fail
from tlt_cli.errors import UserError

bench_app = typer.Typer(
    help="Benchmarks on this machine, over a recipe: each prints a table and writes JSON naming the machine.",
    no_args_is_help=True,
)
RecipeOption = Annotated[str, typer.Option("--recipe", help="A YAML recipe or a shipped recipe name.")]
OverridesArgument = Annotated[
    list[str] | None, typer.Argument(help="key=value overrides of the recipe.", show_default=False)
]
RepeatsOption = Annotated[int, typer.Option(help="Times each measurement is repeated.")]


def _bench_out(name: str) -> typer.Option:
    return typer.Option("--out", help=f"The JSON file to write (default: bench-{name}.json).")


@bench_app.command("rollout", context_settings={"allow_extra_args": False})
def bench_rollout(
    recipe: RecipeOption,
    overrides: OverridesArgument = None,
    batch_sizes: Annotated[str, typer.Option(help="Rows a rollout generates, comma-separated.")] = "1,4,16",
    dtypes: Annotated[str, typer.Option(help="Rollout dtypes, comma-separated (default: the recipe's).")] = "",
    fixed: Annotated[
        str, typer.Option(help="Fixed SD shapes compared with auto and plain: s<steps>-k<topk>-t<tokens>, ngram<N>.")
    ] = "ngram4,s2-k1-t3,s4-k1-t5,s2-k1-t3+ngram4",
    repeats: RepeatsOption = 2,
    first_prompt: Annotated[int, typer.Option(help="The task problem the first rollout's prompts start at.")] = 100_000,
    generate: Annotated[
        bool, typer.Option("--generate", help="Also run transformers' generate on the same rows (no tlt engine).")
    ] = False,
    out: Annotated[Path, _bench_out("rollout")] = Path("bench-rollout.json"),
) -> None:
    """Whole rollouts with SD auto vs plain decoding vs fixed shapes: whether and how much SD pays here."""
    from tlt_cli.bench.rollout import RolloutSettings, run_rollout_bench

    settings = RolloutSettings(batch_sizes, dtypes, fixed, repeats, first_prompt, generate)
    try:
        run_rollout_bench(recipe, list(overrides or []), settings, out, console)
    except UserError as error:
        raise fail(str(error)) from None


@bench_app.command("costs", context_settings={"allow_extra_args": False})
def bench_costs(
    recipe: RecipeOption,
    overrides: OverridesArgument = None,
    rows: Annotated[str, typer.Option(help="Running rows of a pass, comma-separated.")] = "1,2,4,8,16",
    tokens: Annotated[
        str, typer.Option(help="Tokens per row of a pass (1: a plain step), comma-separated.")
    ] = "1,2,4,8",
    dtypes: Annotated[str, typer.Option(help="Rollout dtypes, comma-separated (default: the recipe's).")] = "",
    repeats: RepeatsOption = 3,
    out: Annotated[Path, _bench_out("costs")] = Path("bench-costs.json"),
) -> None:
    """What a plain step and a verify pass cost on this machine, per running rows x tokens per row."""
    from tlt_cli.bench.costs import CostSettings, run_costs_bench

    try:
        run_costs_bench(recipe, list(overrides or []), CostSettings(rows, tokens, dtypes, repeats), out, console)
    except UserError as error:
        raise fail(str(error)) from None


@bench_app.command("update", context_settings={"allow_extra_args": False})
def bench_update(
    recipe: RecipeOption,
    overrides: OverridesArgument = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(help="NAME:key=value,key=value, a variant of the recipe (repeatable; the first is the baseline)."),
    ] = None,
    repeats: RepeatsOption = 2,
    profile: Annotated[
        bool, typer.Option("--profile", help="Also profile an update: by operator category, its roofline by phase.")
    ] = False,
    steps: Annotated[int, typer.Option(help="Rollout-and-update steps after the update, with their peaks.")] = 0,
    response_tokens: Annotated[
        int,
        typer.Option(
            help="Mean response length of the measured batch, lengths drawn long-tailed (0: every response "
            "rollout.max_new_tokens long, the worst case)."
        ),
    ] = 0,
    out: Annotated[Path, _bench_out("update")] = Path("bench-update.json"),
) -> None:
    """One worker's GRPO update per variant, each in a fresh process: seconds, product-rate share, peak memory."""
    from tlt_cli.bench.update import MeasurementFailed, UpdateSettings, run_update_bench

    settings = UpdateSettings(tuple(variant or ()), repeats, profile, steps, response_tokens)
    try:
        run_update_bench(recipe, list(overrides or []), settings, out, console)
    except UserError as error:
        raise fail(str(error)) from None
    except MeasurementFailed as error:
        raise fail(str(error), code=1) from None


@bench_app.command("runs", context_settings={"allow_extra_args": False})
def bench_runs(
    recipe: RecipeOption,
    overrides: OverridesArgument = None,
    variants: Annotated[
        str,
        typer.Option(
            help="Variants, comma-separated, the first the baseline: off, tlt, auto, adaptive, trl, embedded."
        ),
    ] = "off,tlt",
    seeds: Annotated[str, typer.Option(help="run.seed of each run, comma-separated.")] = "0",
    steps: Annotated[int, typer.Option(help="Training steps of each run.")] = 20,
    skip: Annotated[int, typer.Option(help="First steps of each run left out of the time means.")] = 0,
    variant_override: Annotated[
        list[str] | None, typer.Option(help="VARIANT:key=value, an override of one variant only (repeatable).")
    ] = None,
    output_dir: Annotated[Path, typer.Option(help="Where the runs' folders go.")] = Path("runs/bench-runs"),
    from_runs: Annotated[bool, typer.Option("--from-runs", help="Summarize the runs left in --output-dir.")] = False,
    variant: Annotated[
        list[str] | None, typer.Option(help="NAME:key=value,key=value, a variant of its own (repeatable).")
    ] = None,
    fidelity: Annotated[
        bool,
        typer.Option("--fidelity", help="Step by step: does the rollout sample the learner? (own variants: SD off)"),
    ] = False,
    out: Annotated[Path, _bench_out("runs")] = Path("bench-runs.json"),
) -> None:
    """End-to-end tlt train runs, variants x seeds: step, rollout and update seconds, lengths, reward, rollout KL."""
    from tlt_cli.bench.runs import RunsSettings, TrainingRunFailed, run_runs_bench

    settings = RunsSettings(
        variants,
        seeds,
        steps,
        skip,
        tuple(variant_override or ()),
        output_dir,
        from_runs,
        tuple(variant or ()),
        fidelity,
    )
    try:
        run_runs_bench(recipe, list(overrides or []), settings, out, console)
    except UserError as error:
        raise fail(str(error)) from None
    except TrainingRunFailed as error:
        raise fail(str(error), code=1) from None
