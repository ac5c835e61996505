"""The `tlt` command line: thin Typer commands that resolve arguments and call the core.

    tlt train recipes/tiny-cpu.yaml [key=value ...]      # a new run
    tlt train --resume runs/tiny-cpu [key=value ...]     # continue it from its last checkpoint
    tlt recipes list | show NAME | validate PATH ...
    tlt profile runs/tiny-cpu | trace.jsonl | requests.csv | RECIPE [--json]
    tlt calibrate RECIPE [key=value ...] [--batch-sizes 1,2,4] [--write-recipe RECIPE]
    tlt export-drafter runs/tiny-cpu exported-drafter/
    tlt export-policy runs/tiny-cpu policy/ [--step N]
    tlt bench rollout | costs | update | runs --recipe RECIPE [key=value ...] [--out bench.json]
    tlt --version

Errors a user can cause print one line and exit with code 2; a failed run exits with 1. This module holds the app
and the commands of a run; `tlt bench` is cli/bench.py, `tlt drafter` cli/drafter.py, and cli/output.py what they
all print through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from tlt_cli.calibration.settings import (
    DEFAULT_CONFIGS,
    CalibrationSettings,
    parse_batch_sizes,
)
from tlt_cli.checkpoint import CheckpointError, next_run_advice
from tlt_cli.cli.bench import bench_app
from tlt_cli.cli.drafter import drafter_app
from tlt_cli.cli.output import USAGE_ERROR, console, error_console, fail
from tlt_cli.config import Recipe, load_recipe
from tlt_cli.display import LEGEND, keeps_one_line
from tlt_cli.errors import UserError
from tlt_cli.recipes import recipe_file, resolve_recipe_path, shipped_recipes
from tlt_cli.versions import out_of_range_warnings, version_table

if TYPE_CHECKING:
    from tlt_cli.processes.driver import RunSummary

app = typer.Typer(
    help="tlt: faster RL training of reasoning LLMs with lossless speculative decoding in the rollout long tail.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
# `tlt train`'s first line, once the recipe's keys are checked and before the heavy imports
LOADING_LINE = "tlt train: loading torch, transformers and DeepSpeed, then checking the recipe against the model"
# export-drafter's first line, before torch and transformers load (seconds, tens on a loaded machine)
EXPORT_DRAFTER_LOADING_LINE = "tlt export-drafter: loading torch and transformers"


class ColumnSet(str, enum.Enum):
    """`tlt train --columns`: the live table's columns."""

    watched = "watched"
    all = "all"


# the shell's code for a process ended by SIGTERM (128 + 15), as Ctrl-C's is 130
SIGTERM_EXIT = 143


def _version(value: bool) -> None:
    if value:
        for line in version_table():
            console.print(line, highlight=False)
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_version,
            is_eager=True,
            help="Print the versions of tlt, Python and its libraries, then exit.",
        ),
    ] = False,
) -> None:
    """tlt: faster RL training of reasoning LLMs."""
    for warning in out_of_range_warnings():
        error_console.print(
            f"[bold yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=keeps_one_line(error_console)
        )


@app.command(context_settings={"allow_extra_args": False})
def train(
    arguments: Annotated[
        list[str] | None,
        typer.Argument(
            help="RECIPE (a YAML file or a shipped recipe name) then key=value overrides.", show_default=False
        ),
    ] = None,
    resume: Annotated[
        Path | None, typer.Option("--resume", help="Continue the run in this directory from its last checkpoint.")
    ] = None,
    keep_log: Annotated[
        bool,
        typer.Option(
            "--keep-log",
            help="If the run fails before its first step, keep its logs (the traceback) instead of removing its run "
            "directory.",
        ),
    ] = False,
    columns: Annotated[
        ColumnSet,
        typer.Option(
            "--columns",
            help=f"The live table's columns: watched (fits 100 terminal columns) or all (every figure and plugin "
            f"column; trace.jsonl keeps them all either way). {LEGEND}",
        ),
    ] = ColumnSet.watched,
) -> None:
    """Run GRPO training with the TLT machinery on."""
    arguments = list(arguments or [])
    run_directory: Path | None = None
    try:
        with _sigterm_interrupts():
            recipe, resume_directory = _resolve_run(arguments, resume)
            run_directory = resume_directory or Path(recipe.run.output_dir).expanduser() / recipe.run.name
            summary = _run_training(recipe, resume_directory, keep_log, all_columns=columns == ColumnSet.all)
    except UserError as error:
        raise fail(str(error)) from None
    except KeyboardInterrupt as interrupt:
        how, code = _stopped(interrupt)
        if run_directory is None:  # stopped while the recipe was read: no run to continue
            raise fail(f"{how} before the run started.", code) from None
        raise fail(f"{how}; {_after_interrupt(run_directory)}.", code) from None
    console.print(f"done: {len(summary.steps)} steps, run directory {summary.run_directory}", markup=False)


def _run_training(recipe: Recipe, resume_directory: Path | None, keep_log: bool, all_columns: bool) -> RunSummary:
    """The run (tlt_cli/trainers.py), its TrainingFailed one sentence and exit 1."""
    from tlt_cli.processes.driver import TrainingFailed
    from tlt_cli.trainers import train as run_training

    try:
        return run_training(recipe, console, resume_directory, keep_log, all_columns=all_columns)
    except TrainingFailed as error:
        raise fail(str(error), code=1) from None


def _loading_heavy_modules() -> None:
    """The line before torch, transformers and DeepSpeed load (tens of seconds on a loaded machine), so the
    console does not open with a silent wait."""
    console.print(LOADING_LINE, markup=False, highlight=False, soft_wrap=keeps_one_line(console))


def _after_interrupt(run_directory: Path) -> str:
    """What to do after an interrupted `tlt train`, true of the run directory as the interrupt left it."""
    if not run_directory.exists():  # stopped in the drafter warm-up or a check: no run was made
        return f"the run had not started ({run_directory} was not made), so there is nothing to resume: run it again"
    return next_run_advice(run_directory)


class Terminated(KeyboardInterrupt):
    """SIGTERM reached `tlt train`: it stops as on Ctrl-C (workers and servers stopped, checkpoints kept)."""


def _interrupt_on_sigterm(signum: int, frame: object) -> None:
    # a second SIGTERM must not cut the clean stop short (SIGKILL still can)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """Within: SIGTERM raises Terminated, so the command stops as on Ctrl-C, its clean-up run."""
    previous = signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stopped(interrupt: KeyboardInterrupt) -> tuple[str, int]:
    """How a command was stopped and the exit code the shell gives it: Ctrl-C's 130, SIGTERM's 143."""
    return ("terminated", SIGTERM_EXIT) if isinstance(interrupt, Terminated) else ("interrupted", 130)


def _resolve_run(arguments: list[str], resume: Path | None) -> tuple[Recipe, Path | None]:
    """(recipe, the run directory to resume or None) from the arguments and --resume; the recipe checked whole."""
    has_recipe = bool(arguments) and "=" not in arguments[0]
    overrides = arguments[1:] if has_recipe else arguments
    if resume is None and not has_recipe:
        raise UserError("give a recipe: tlt train RECIPE [key=value ...] (see `tlt recipes list`).")
    if resume is not None and not resume.is_dir():
        raise CheckpointError(
            f"--resume {resume} is not a directory; pass the run directory printed when the run started."
        )
    if resume is None:
        recipe = load_recipe(recipe_file(arguments[0]), overrides)  # keys and values checked before torch loads
        _loading_heavy_modules()
        return _whole_checked_recipe(recipe, new_run=True), None
    _loading_heavy_modules()  # a resume reads its run directory with modules that import torch
    from tlt_cli.processes.resume_settings import resumed_recipe

    recipe = resumed_recipe(resume, arguments[0] if has_recipe else None, overrides)
    return _whole_checked_recipe(recipe, new_run=False), resume


def _whole_checked_recipe(recipe: Recipe, new_run: bool) -> Recipe:
    """`recipe`, checked whole (tlt_cli/preflight.py)."""
    from tlt_cli.preflight import check_recipe

    check_recipe(recipe, new_run=new_run)
    if recipe.model.trust_remote_code:
        error_console.print(
            f"warning: model.trust_remote_code is true, so the Python code that the model folder {recipe.model.path} "
            "ships may run.",
            markup=False,
            highlight=False,
            soft_wrap=keeps_one_line(error_console),
        )
    return recipe


@recipes_app.command("list")
def recipes_list() -> None:
    """List the shipped recipes with the command that runs each."""
    for path in shipped_recipes():
        first_line = path.read_text(encoding="utf-8").splitlines()[0].lstrip("# ").strip()
        console.print(f"[bold]{path.stem}[/]  {first_line}", highlight=False)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="A shipped recipe name or a YAML path.")]) -> None:
    """Print a recipe resolved against the defaults: every key with its value, under its help as comments."""
    from tlt_cli.recipe_checks import load_checked_recipe
    from tlt_cli.recipe_help import commented_yaml

    try:
        console.print(
            commented_yaml(load_checked_recipe(recipe_file(name))),
            highlight=False,
            markup=False,
            soft_wrap=keeps_one_line(console),
        )
    except UserError as error:
        raise fail(str(error)) from None


@recipes_app.command("validate")
def recipes_validate(
    arguments: Annotated[
        list[str], typer.Argument(help="Recipe names or YAML paths, and key=value overrides applied to each.")
    ],
) -> None:
    """Check recipes as `tlt train` would before it starts (an existing run directory is noted, not refused). Exit 2
    if any is invalid."""
    from tlt_cli.processes.run_directory import holds_run

    names, overrides = _validate_arguments(arguments)
    invalid = 0
    for name in names:
        try:
            recipe = _whole_checked_recipe(load_recipe(recipe_file(name), overrides), new_run=False)
            run_directory = Path(recipe.run.output_dir).expanduser() / recipe.run.name
            existing = (
                f" (note: {run_directory} already holds a run; `tlt train` of it needs --resume {run_directory} or "
                "another run.name)"
                if holds_run(run_directory)
                else ""
            )
            console.print(
                f"ok  {name}: valid{existing}", highlight=False, markup=False, soft_wrap=keeps_one_line(console)
            )
        except UserError as error:
            invalid += 1
            error_console.print(
                f"[bold red]invalid[/] {escape(str(error))}", highlight=False, soft_wrap=keeps_one_line(error_console)
            )
    if invalid:
        raise typer.Exit(USAGE_ERROR)


def _validate_arguments(arguments: list[str]) -> tuple[list[str], list[str]]:
    """(recipe names or paths, overrides); a bare recipe key (`train.steps`) is a malformed override, not a name."""
    sections = {section.name for section in dataclasses.fields(Recipe)}

    def is_override(argument: str) -> bool:
        bare_key = argument.split(".")[0] in sections and not argument.endswith((".yaml", ".yml"))
        return "=" in argument or (bare_key and not Path(argument).exists())

    return [argument for argument in arguments if not is_override(argument)], list(filter(is_override, arguments))


@app.command(context_settings={"allow_extra_args": False})
def profile(
    source: Annotated[
        str,
        typer.Argument(
            help="A run directory, a trace.jsonl, a CSV/JSONL of per-request records (step, worker, start, end, "
            "tokens), or a recipe (records a fresh rollout)."
        ),
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value overrides when SOURCE is a recipe.", show_default=False)
    ] = None,
    steps: Annotated[int, typer.Option(help="Rollout steps to record when SOURCE is a recipe (no training).")] = 2,
    output_dir: Annotated[
        Path | None,
        typer.Option(
            "--output-dir",
            help="Folder for the PNGs (default: the run directory, the input's folder, or "
            "<run.output_dir>/<run.name>-profile for a recipe).",
        ),
    ] = None,
    tail_batch: Annotated[
        int, typer.Option(help="A worker is in the tail while it has at most this many requests in flight.")
    ] = 4,
    sd_speedup: Annotated[
        float | None,
        typer.Option(
            help="SD speedup of tail decoding for the projection (default: measured from the trace, else assumed 2.0)."
        ),
    ] = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print the profile as JSON (for scripts) instead of tables.")
    ] = False,
    plots: Annotated[
        bool, typer.Option("--plots/--no-plots", help="Write the timeline and length-histogram PNGs.")
    ] = True,
) -> None:
    """Show the long tail of rollouts: lengths, idle workers, SD time and acceptance, projected speedup."""
    from tlt_cli.profile.analysis import profile_to_json
    from tlt_cli.profile.profiler import profile_source
    from tlt_cli.profile.report import render_profile

    try:
        result = profile_source(source, overrides, steps, output_dir, tail_batch, sd_speedup, pictures=plots)
    except UserError as error:
        raise fail(str(error)) from None
    if json_output:
        typer.echo(
            json.dumps(
                {**profile_to_json(result.profile), "pictures": [str(path) for path in result.pictures]},
                indent=2,
                allow_nan=False,  # strict JSON: records.py refuses NaN and Infinity, so none reaches here
            )
        )
        return
    render_profile(console, result.profile, result.segments, result.lengths, result.pictures)


@app.command(context_settings={"allow_extra_args": False})
def calibrate(
    recipe: Annotated[
        str,
        typer.Argument(
            help="A YAML recipe or a shipped recipe name: its target model, initial drafter, task and sampling are "
            "measured."
        ),
    ],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="key=value overrides of the recipe.", show_default=False)
    ] = None,
    batch_sizes: Annotated[
        str,
        typer.Option(
            help="Running batch sizes to measure, e.g. 1,2,4,8 (default: powers of two up to a worker's first "
            "running batch)."
        ),
    ] = "",
    configs: Annotated[
        str,
        typer.Option(
            help="SD configurations to compare with off: off or s<steps>-k<topk>-t<draft tokens>, comma-separated."
        ),
    ] = ",".join(DEFAULT_CONFIGS),
    repeats: Annotated[
        int, typer.Option(help="Worker shards each configuration generates to their natural end.")
    ] = CalibrationSettings.repeats,
    margin: Annotated[
        float,
        typer.Option(
            help="SD is chosen only where it beats off by more than this fraction; runners-up within it become "
            "bandit candidates."
        ),
    ] = CalibrationSettings.margin,
    candidates: Annotated[
        int, typer.Option(help="Most runners-up kept per rule as the bandit's candidates (0: none).")
    ] = CalibrationSettings.candidates,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            help="JSON of every measurement; the YAML fragment goes next to it (default: "
            "<run.output_dir>/<run.name>-calibration/calibration.json).",
        ),
    ] = None,
    write_recipe: Annotated[
        Path | None,
        typer.Option(
            "--write-recipe",
            help="Also rewrite the speculative.rules block of this recipe file in place (comments kept).",
        ),
    ] = None,
) -> None:
    """Measure SD off vs SD configurations by running batch size on this machine and write the adaptive rule table."""
    from tlt_cli.calibration.recipe_text import RecipeEditError

    try:
        settings = CalibrationSettings(
            parse_batch_sizes(batch_sizes),
            tuple(part for part in configs.split(",") if part.strip()),
            repeats,
            margin,
            candidates,
        )
        calibrate_and_report(recipe, list(overrides or []), settings, output, write_recipe)
    except (RecipeEditError, UserError) as error:
        raise fail(str(error)) from None


def calibrate_and_report(
    recipe: str, overrides: list[str], settings: CalibrationSettings, output: Path | None, write_recipe: Path | None
) -> None:
    """`tlt calibrate`'s work: measure with a status line of the shard it is on, print and write the result, and
    rewrite the recipe's rules when asked (a recipe that cannot be rewritten is refused before measuring)."""
    from tlt_cli.calibration.calibrate import calibrate as run_calibration
    from tlt_cli.calibration.recipe_text import check_recipe_to_rewrite, write_rules_into_recipe
    from tlt_cli.calibration.report import render_calibration, write_calibration

    def show(label: str, repeat: int) -> None:
        status.update(f"calibrating: shard {repeat + 1} of {settings.repeats}, {label}")

    if write_recipe is not None:  # refused before the measurement, not after it
        check_recipe_to_rewrite(write_recipe)
    with console.status(
        "loading the model pair (the tiny model and the drafter warm-up run once, then are cached)"
    ) as status:
        result = run_calibration(recipe, overrides, settings, output, on_shard=show)
    render_calibration(console, result)
    json_path, fragment_path = write_calibration(result)
    console.print(f"wrote {json_path} and {fragment_path}", highlight=False)
    if write_recipe is not None:
        write_rules_into_recipe(write_recipe, result.rules, result.command)
        console.print(f"rewrote speculative.rules in {write_recipe}", highlight=False)


def _progress(line: str) -> None:
    """A command's progress line, as it is (no markup)."""
    console.print(line, markup=False, highlight=False, soft_wrap=keeps_one_line(console))


@app.command("export-drafter")
def export_drafter(
    source: Annotated[
        Path, typer.Argument(help="A run directory (its latest checkpoint), a checkpoint folder, or a drafter folder.")
    ],
    output: Annotated[
        Path, typer.Argument(help="Folder to write: config.json, model.safetensors, README.md (the model card).")
    ],
    recipe: Annotated[
        str | None,
        typer.Option(help="Recipe naming the target model and task; required for a drafter folder outside a run."),
    ] = None,
    include_shared: Annotated[
        bool,
        typer.Option(
            "--include-shared",
            help="Also write the target's embedding (and untied lm_head), which SGLang takes from the target anyway.",
        ),
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Replace OUTPUT when it holds a previous export (and nothing else).")
    ] = False,
    prompts: Annotated[int, typer.Option(help="Held-out prompts the accept length is measured on.")] = 8,
    draft_steps: Annotated[
        int, typer.Option(help="Draft tokens per verify pass (a chain) when measuring acceptance.")
    ] = 4,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Longest response when measuring (default: the recipe's rollout.max_new_tokens).")
    ] = None,
) -> None:
    """Export the trained drafter as a Hugging Face folder SGLang serves as an EAGLE draft model."""
    _progress(EXPORT_DRAFTER_LOADING_LINE)
    from tlt_cli.processes.distributed import choose_deepspeed_accelerator

    choose_deepspeed_accelerator()  # before transformers imports DeepSpeed, which warns when it guesses
    from tlt_cli.export import export_drafter as run_export
    from tlt_cli.models.loading import ModelLoadError
    from tlt_cli.sglang.drafter_format import DrafterFormatError

    recipe_path = resolve_recipe_path(recipe) if recipe is not None else None
    try:
        summary = run_export(
            source, output, recipe_path, include_shared, force, prompts, max_new_tokens, draft_steps, tell=_progress
        )
    except (DrafterFormatError, ModelLoadError) as error:  # ExportError is a DrafterFormatError
        raise fail(str(error)) from None
    for warning in summary.warnings:
        error_console.print(
            f"warning: {warning}", markup=False, highlight=False, soft_wrap=keeps_one_line(error_console)
        )
    measurement = summary.measurement
    console.print(
        f"exported {summary.architecture} drafter to {summary.output_dir}: "
        f"accept length {measurement.accept_length:.3f} "
        f"({measurement.verify_passes} verify passes on {measurement.prompts} held-out prompts; reload reproduces "
        f"{summary.reloaded_accept_length:.3f}); model card in README.md",
        highlight=False,
        soft_wrap=keeps_one_line(console),
    )


@app.command("export-policy")
def export_policy(
    run: Annotated[Path, typer.Argument(help="A run directory (runs/<run.name>) with checkpoints.")],
    output: Annotated[
        Path, typer.Argument(help="New folder to write: config.json, model.safetensors, tokenizer files.")
    ],
    step: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="The checkpoint written after this RL step, counted from 0 as the trace and the live table count "
            "(step 2: checkpoints/step_000003; default: the latest).",
        ),
    ] = None,
) -> None:
    """Export the trained policy at a checkpoint as a Hugging Face folder (AutoModelForCausalLM.from_pretrained)."""
    from tlt_cli.processes.distributed import choose_deepspeed_accelerator

    choose_deepspeed_accelerator()  # before transformers imports DeepSpeed, which warns when it guesses
    from tlt_cli.export_policy import export_policy as run_export

    try:
        with _sigterm_interrupts():
            summary = run_export(run, output, step)
    except UserError as error:  # a ModelLoadError or CheckpointError too
        raise fail(str(error)) from None
    except KeyboardInterrupt as interrupt:
        how, code = _stopped(interrupt)
        raise fail(f"{how}; nothing was exported (its staging folder is removed).", code) from None
    for warning in summary.warnings:
        error_console.print(
            f"warning: {warning}", markup=False, highlight=False, soft_wrap=keeps_one_line(error_console)
        )
    console.print(
        f"exported the policy of checkpoint {Path(summary.checkpoint).name}, written after RL step {summary.rl_step} "
        f"({summary.dtype}), to {summary.output_dir}; reloaded "
        f"with transformers, its log-probs equal the checkpoint's on {summary.checked_prompts} held-out prompts",
        highlight=False,
        soft_wrap=keeps_one_line(console),
    )
    if summary.held_drafter is not None:
        console.print(
            "the run's drafter is held for the exported policy: a run on it starts with that drafter",
            highlight=False,
            soft_wrap=keeps_one_line(console),
        )


app.add_typer(drafter_app, name="drafter")
app.add_typer(bench_app, name="bench")
