"""Where a resumed run starts: its checkpoint, checked against the recipe and model it resumes with.

`resume_point` finds the checkpoint (run_directory.py: checked, covered by the trace) and refuses one written
by another worker count or for another model (`check_same_model`); `resumed_changes` prints and records what
settings the resume changes (resume_settings.py), once the run's plan has made the recipe's choices concrete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from tlt_cli.checkpoint import CheckpointError
from tlt_cli.config import Recipe, load_recipe
from tlt_cli.display import keeps_one_line
from tlt_cli.errors import UserError
from tlt_cli.models.identity import identity_difference, model_identity
from tlt_cli.models.loading import load_config_and_tokenizer
from tlt_cli.processes.resume_settings import changed_settings, describe_changes
from tlt_cli.processes.run_directory import RECIPE_FILE, resume_checkpoint, trained_from

# config.json keys that shape a model's weights: a resume onto a model that differs in one cannot load the checkpoint
MODEL_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def resume_point(run_directory: Path, recipe: Recipe, console: Console) -> tuple[Path, int]:
    """The checkpoint to resume from (run_directory.py: checked, covered by the trace, written by as many workers
    as the recipe has); each warning one line."""
    checkpoint, warnings = resume_checkpoint(run_directory)
    written_by = checkpoint.state.get("world_size")
    if isinstance(written_by, int) and written_by != recipe.workers.count:
        # each rank's optimizer shard and sampling stream belong to its rank: another count cannot load them
        raise CheckpointError(
            f"workers.count: checkpoint {checkpoint.directory} was written by {written_by} workers, the recipe has "
            f"{recipe.workers.count}; resume with workers.count={written_by}."
        )
    check_same_model(run_directory, recipe)
    for warning in warnings:
        console.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=keeps_one_line(console))
    console.print(
        resuming_sentence(checkpoint.directory, checkpoint.next_step, recipe.train.steps),
        markup=False,
        highlight=False,
        soft_wrap=keeps_one_line(console),
    )
    return checkpoint.directory, checkpoint.next_step


def resuming_sentence(checkpoint_directory: Path, next_step: int, total_steps: int) -> str:
    """The line that says where a resume starts: the checkpoint and the step (steps count from 0)."""
    if next_step >= total_steps:
        return f"resuming from {checkpoint_directory}: all {total_steps} steps are done, none is left to run"
    return (
        f"resuming from {checkpoint_directory}, written after step {next_step - 1}: the run continues at step "
        f"{next_step} of steps 0-{total_steps - 1}"
    )


def check_same_model(run_directory: Path, recipe: Recipe) -> None:
    """CheckpointError when model.path now holds another model than the one the run was trained from: by the
    identity recorded at its start (config, shapes, weights digest), else (a run started by an older tlt) by the
    shape keys of the config its recipe.yaml names; a model that cannot be read any more is left for the load to
    judge."""
    recorded = trained_from(run_directory)
    if recorded is not None:
        difference = identity_difference(recorded, model_identity(recipe.model.path, recipe.model.trust_remote_code))
        if difference is not None:
            raise CheckpointError(
                f"model.path: {recipe.model.path} now holds another model than run {run_directory} was trained from "
                f"({difference}); resume with the model the run started from, or start a new run."
            )
        return
    try:
        started_with = load_recipe(run_directory / RECIPE_FILE).model
    except UserError:
        return
    if started_with.path == recipe.model.path:
        return
    try:
        before = load_config_and_tokenizer(started_with.path, started_with.trust_remote_code)[0].to_dict()
        now = load_config_and_tokenizer(recipe.model.path, recipe.model.trust_remote_code)[0].to_dict()
    except UserError:
        return
    differ = [key for key in MODEL_SHAPE_KEYS if before.get(key) != now.get(key)]
    if differ:
        raise CheckpointError(
            f"model.path: {recipe.model.path} is another model than the run was trained from ({started_with.path}: "
            f"{', '.join(f'{key} {before.get(key)} vs {now.get(key)}' for key in differ)}); resume with "
            f"model.path={started_with.path}."
        )


def resumed_changes(run_directory: Path, recipe: Recipe, console: Console) -> dict[str, Any]:
    """The trace's changed_settings (none when the resume changes nothing): each setting `recipe` changes from
    the run's recipe.yaml, old -> new, printed in one line; the driver writes the changed recipe.yaml."""
    changes = changed_settings(load_recipe(run_directory / RECIPE_FILE), recipe)
    if not changes:
        return {}
    console.print(describe_changes(changes), markup=False, highlight=False, soft_wrap=keeps_one_line(console))
    return {"changed_settings": {key: list(values) for key, values in changes.items()}}
