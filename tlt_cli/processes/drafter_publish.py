"""A run's drafter, carried to the next run on the model: the driver publishes it to the library when the run ends.

Called by the driver (driver.py `_train_in`) when the workers stop, whether the run finished, failed or was
stopped: the drafter of the run's newest complete checkpoint (the sidecar saves it there, rank 0) becomes the
newest drafter tlt holds for the model (tlt_cli/drafter/library.py), with the accept length the drafter reached
in the last step before that checkpoint. A held drafter that drafted better (a longer accept length) than the
run's is kept instead; `drafter.init: auto` on the next run starts from whichever the library holds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tlt_cli.checkpoint import DRAFTER_DIRECTORY, CheckpointError, latest_checkpoint
from tlt_cli.config import Recipe
from tlt_cli.drafter import library
from tlt_cli.drafter.model import CONFIG_FILE, DrafterLoadError
from tlt_cli.errors import UserError
from tlt_cli.models.loading import model_folder

LOGGER = logging.getLogger(__name__)


def publish_run_drafter(recipe: Recipe, run_directory: Path, cache: Path, steps: list[dict[str, Any]]) -> str | None:
    """Publish the drafter of the run's newest complete checkpoint; the console's sentence on it (None: the run
    has no checkpointed drafter). `steps`: the trace's step records."""
    try:
        checkpoint = latest_checkpoint(run_directory)
    except CheckpointError:
        return None
    drafter_folder = checkpoint.directory / DRAFTER_DIRECTORY
    if not (drafter_folder / CONFIG_FILE).is_file():
        return None
    last_step = checkpoint.next_step - 1
    accept_length = last_accept_length(steps, last_step)
    try:
        model = model_folder(recipe.model.path)
    except UserError as error:  # the model folder went away during the run: nothing to key the drafter by
        LOGGER.warning("the run's drafter was not kept for the next run (%s)", error)
        return None
    held = library.newest(cache, model)
    if held is not None and _held_drafts_better(held[1], accept_length):
        return (
            f"drafter: kept the one tlt holds for this model (accept length {held[1].accept_length:.2f}); this run's "
            f"reached {accept_length:.2f}"
        )
    record = library.DrafterRecord(
        source=f"run {recipe.run.name}, step {last_step}",
        model=recipe.model.path,
        accept_length=accept_length,
        temperature=recipe.rollout.temperature,
    )
    try:
        library.publish(cache, model, drafter_folder, record)
    except (OSError, DrafterLoadError) as error:
        LOGGER.warning("the run's drafter was not kept for the next run (%s)", error)
        return None
    reached = f", accept length {accept_length:.2f}" if accept_length is not None else ""
    return f"drafter: kept for the next run on this model (step {last_step}{reached})"


def last_accept_length(steps: list[dict[str, Any]], last_step: int) -> float | None:
    """The drafter's accept length in the newest step up to `last_step` that drafted with it (None: none did)."""
    measured = [
        record["drafter_accept_length"]
        for record in steps
        if record.get("step", -1) <= last_step and record.get("drafter_accept_length") is not None
    ]
    return float(measured[-1]) if measured else None


def _held_drafts_better(held: library.DrafterRecord, accept_length: float | None) -> bool:
    if held.accept_length is None:
        return False
    return accept_length is None or held.accept_length > accept_length
