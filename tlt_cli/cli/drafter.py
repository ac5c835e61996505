"""`tlt drafter ...`: the drafter tlt holds for a model (tlt_cli/drafter/library.py); `warmup` trains one offline."""

from __future__ import annotations

from typing import Annotated

import typer

from tlt_cli.cli.output import console, fail
from tlt_cli.config import load_recipe
from tlt_cli.errors import UserError
from tlt_cli.recipes import resolve_recipe_path

drafter_app = typer.Typer(help="The drafter tlt holds for a model: warm one up.", no_args_is_help=True)


@drafter_app.command("warmup", context_settings={"allow_extra_args": False})
def drafter_warmup(
    arguments: Annotated[
        list[str],
        typer.Argument(
            help="RECIPE (a YAML file or a shipped recipe name) then key=value overrides.", show_default=False
        ),
    ],
) -> None:
    """Warm up the recipe's drafter offline (as drafter.init=warmup does), cache it and make it the one tlt holds for
    the model, so every later run on the model starts with it. Stopped after its generation, it resumes there."""
    from tlt_cli.display import PhaseProgress
    from tlt_cli.drafter.warmup import report_lines
    from tlt_cli.training.setup import model_cache, warmed_up_drafter

    try:
        recipe = load_recipe(resolve_recipe_path(arguments[0]), arguments[1:])
        with PhaseProgress(console, "drafter warm-up") as progress:
            folder, report = warmed_up_drafter(recipe, model_cache(recipe), progress)
    except UserError as error:
        raise fail(str(error)) from None
    except KeyboardInterrupt:
        raise fail("interrupted; run the same command again to continue from what was sampled.", 130) from None
    if report is None:
        console.print(f"the recipe's warm-up is already cached in {folder}; tlt holds it for the model", markup=False)
        return
    for line in report_lines(report, recipe.rollout.temperature):
        console.print(line, markup=False)
    console.print(f"cached in {folder}, held for the model", markup=False)
