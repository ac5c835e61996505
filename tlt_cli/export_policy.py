"""`tlt export-policy`: the trained policy at a run's checkpoint as a Hugging Face folder `transformers` loads.

`export_policy(run_directory, output_dir, step)` reads the actor weights of a checkpoint (the run's latest,
or the one written after RL step `step`, counted from 0 as the trace counts: step 2 is checkpoints/step_000003),
loads them into the run recipe's model (`policy_at_checkpoint`, which `tlt export-drafter` uses for its target too)
and writes, with `save_pretrained`,
  config.json, generation_config.json   the model's config; float32, the dtype the actor trains in on CPU
  model.safetensors                     the weights
  tokenizer files                       the run's tokenizer, so the folder is complete on its own
  tlt_policy.json                       the run, checkpoint and RL step it came from, and the check below
into a temporary sibling folder, reloads that folder with `AutoModelForCausalLM.from_pretrained` and checks
its log-probs on held-out prompts of the run's task equal the checkpoint's exactly, and only then renames
it into place: a full disk or a failed check leaves no half-written output. An output folder that exists
and is not empty is refused, never replaced, and so are the current folder or one above it (`.`, `..`: the
export renames a new folder into OUT's place, which would pull the folder out from under the shell), a symbolic
link (the rename would not write through it) and a folder inside the run's checkpoints/ (a later checkpoint of the
run removes it). The staging folder, `.OUT.tmp-<pid>`, goes however the export ends but SIGKILL (`tlt
export-policy` turns SIGTERM into an interrupt); the next export into OUT removes one whose exporter is gone.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.atomic_files import files_with_the_umasks_mode
from tlt_cli.checkpoint import (
    DRAFTER_DIRECTORY,
    LATEST_FILE,
    Checkpoint,
    CheckpointError,
    checked_state,
    checkpoint_name,
    checkpoint_number,
    latest_checkpoint,
    load_checkpoint_file,
    numbered_checkpoints,
)
from tlt_cli.config import Recipe
from tlt_cli.drafter import library
from tlt_cli.drafter.model import CONFIG_FILE
from tlt_cli.errors import UserError, writing
from tlt_cli.process_status import process_running
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.training import setup
from tlt_cli.training.actor import ACTOR_WEIGHTS_FILE, CHECKPOINT_TAG

SUMMARY_FILE = "tlt_policy.json"
# held-out prompts of the run's task whose log-probs the reloaded folder must reproduce exactly
CHECK_PROMPTS = 4
WRITE_ADVICE = "nothing was exported: free some space or choose another output folder."


class PolicyExportError(UserError):
    """A policy that cannot be exported as asked; the message says what to fix."""


@dataclass(frozen=True)
class PolicyExport:
    """What `export_policy` wrote, for the terminal and tlt_policy.json."""

    output_dir: str
    run_directory: str
    checkpoint: str
    # the RL step the checkpoint was written after, counted from 0 as the trace counts (step_000003: 2)
    rl_step: int
    model: str
    dtype: str
    checked_prompts: int
    # one line each (a damaged latest checkpoint replaced by the previous one)
    warnings: list[str]
    # the library version holding the run's drafter for the exported policy (drafter/library.py); None: the
    # checkpoint had no drafter
    held_drafter: str | None = None


def export_policy(run_directory: Path, output_dir: Path, step: int | None = None) -> PolicyExport:
    """Export, check by reloading with transformers, then rename into place (see the module docstring)."""
    run_directory = Path(run_directory)
    _check_output(Path(output_dir), run_directory)
    # lexically absolute (`policy/..` is its parent), so the staging folder is OUT's sibling whatever OUT's spelling
    output_dir = Path(os.path.abspath(output_dir))
    checkpoint = run_checkpoint(run_directory, step)
    recipe = _run_recipe(run_directory)
    policy, tokenizer = _policy(recipe, checkpoint.directory)
    prompt_ids = held_out_prompt_ids(recipe, tokenizer, CHECK_PROMPTS)
    staging = output_dir.with_name(f"{_staging_prefix(output_dir)}{os.getpid()}")
    _remove_abandoned_staging(output_dir)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        with writing(output_dir, WRITE_ADVICE, PolicyExportError):
            staging.mkdir(parents=True)
            policy.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            files_with_the_umasks_mode(staging)
        _check_reload(policy, staging, prompt_ids, output_dir)
        held = _hold_drafter(recipe, checkpoint, staging)
        summary = PolicyExport(
            output_dir=str(output_dir),
            run_directory=str(run_directory),
            checkpoint=str(checkpoint.directory),
            rl_step=checkpoint.last_step,
            model=recipe.model.path,
            dtype=str(policy.dtype).removeprefix("torch."),
            checked_prompts=len(prompt_ids),
            warnings=[checkpoint.warning] if checkpoint.warning else [],
            held_drafter=str(held) if held is not None else None,
        )
        with writing(output_dir, WRITE_ADVICE, PolicyExportError):
            (staging / SUMMARY_FILE).write_text(json.dumps(asdict(summary), indent=2) + "\n")
            # rename(2) replaces an empty folder, so an empty OUT made in advance is filled atomically too
            os.replace(staging, output_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


def _hold_drafter(recipe: Recipe, checkpoint: Checkpoint, policy_folder: Path) -> Path | None:
    """Make the checkpoint's drafter the one tlt holds for the exported policy (keyed by its files, which the
    rename into place keeps), so a run on the exported folder starts with the drafter its run trained."""
    drafter_folder = checkpoint.directory / DRAFTER_DIRECTORY
    if not (drafter_folder / CONFIG_FILE).is_file():
        return None
    record = library.DrafterRecord(
        source=f"run {recipe.run.name}, step {checkpoint.last_step} (its exported policy)",
        model=recipe.model.path,
        temperature=recipe.rollout.temperature,
    )
    return library.publish(setup.model_cache(recipe), policy_folder, drafter_folder, record)


def _staging_prefix(output_dir: Path) -> str:
    """The name of OUT's staging folders up to the exporter's pid: `.OUT.tmp-`."""
    return f".{output_dir.name}.tmp-"


def _remove_abandoned_staging(output_dir: Path) -> None:
    """Remove OUT's staging folders whose exporter is no longer running (a killed export's whole model copy)."""
    prefix = _staging_prefix(output_dir)
    for folder in output_dir.parent.glob(f"{glob.escape(prefix)}*"):
        exporter = folder.name.removeprefix(prefix)
        if exporter.isdigit() and not process_running(int(exporter)):
            shutil.rmtree(folder, ignore_errors=True)


def _check_output(output_dir: Path, run_directory: Path) -> None:
    where, here = Path(os.path.abspath(output_dir)), Path.cwd()
    if where == here or where in here.parents:
        raise PolicyExportError(
            f"{output_dir} is the current folder or holds it; name a new folder to export into, such as policy/."
        )
    if output_dir.is_symlink():
        raise PolicyExportError(
            f"{output_dir} is a symbolic link; name a new folder to export into (the export never writes through one)."
        )
    if where.resolve().is_relative_to((run_directory / "checkpoints").resolve()):
        raise PolicyExportError(
            f"{output_dir} is inside the run's checkpoints/, which the run's later checkpoints replace; export "
            "elsewhere, such as policy/."
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise PolicyExportError(f"{output_dir} exists and is not a folder; choose another output folder.")
    if output_dir.is_dir() and any(output_dir.iterdir()):
        raise PolicyExportError(
            f"{output_dir} is not empty; choose a new output folder (export-policy never replaces files)."
        )


def run_checkpoint(run_directory: Path, step: int | None) -> Checkpoint:
    """The run's latest complete checkpoint, or the one written after RL step `step` (from 0: step_<step + 1>)."""
    checkpoints = run_directory / "checkpoints"
    if not run_directory.is_dir() or not checkpoints.is_dir():
        raise PolicyExportError(f"{run_directory} is not a run directory with checkpoints; pass runs/<run.name>.")
    try:
        if step is None:
            if not (checkpoints / LATEST_FILE).is_file():
                raise PolicyExportError(f"{run_directory} has no complete checkpoint to export yet.")
            return latest_checkpoint(run_directory)
        folder = checkpoints / checkpoint_name(step + 1)
        if not folder.is_dir():
            steps = ", ".join(str(checkpoint_number(path) - 1) for path in numbered_checkpoints(checkpoints))
            raise PolicyExportError(
                f"{run_directory} has no checkpoint written after step {step}; its checkpoints were written after "
                f"steps {steps or 'none'} (steps count from 0, as the trace and the live table count)."
            )
        return Checkpoint(folder, checked_state(folder))
    except CheckpointError as error:
        raise PolicyExportError(str(error)) from None


def _run_recipe(run_directory: Path) -> Recipe:
    try:
        return load_checked_recipe(run_directory / "recipe.yaml")
    except UserError as error:
        raise PolicyExportError(str(error)) from None


def _policy(recipe: Recipe, checkpoint_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        return policy_at_checkpoint(recipe, checkpoint_dir)
    except CheckpointError as error:
        raise PolicyExportError(str(error)) from None


def policy_at_checkpoint(
    recipe: Recipe, checkpoint_dir: Path, advice: str = "export from the run directory that wrote it"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The recipe's model with the actor weights of `checkpoint_dir` (ZeRO 0-2 keep them whole), in eval mode, and
    its tokenizer; CheckpointError names the file (and ends with `advice`) when the weights are missing or belong
    to another model."""
    policy, tokenizer = setup.policy_and_tokenizer(recipe)
    weights_path = checkpoint_dir / CHECKPOINT_TAG / ACTOR_WEIGHTS_FILE
    if not weights_path.is_file():
        raise CheckpointError(f"checkpoint {checkpoint_dir} has no actor weights ({weights_path}); it is incomplete.")
    saved = load_checkpoint_file(weights_path, map_location="cpu")
    state = saved.get("module") if isinstance(saved, dict) else None
    try:
        if not isinstance(state, dict):
            raise RuntimeError("no module state")
        policy.load_state_dict(state, strict=True)
    except RuntimeError:
        raise CheckpointError(
            f"actor weights in {weights_path} do not fit {recipe.model.path} (another model, or a ZeRO-3 "
            f"checkpoint whose module state is partitioned); {advice}."
        ) from None
    return policy.eval(), tokenizer


def held_out_prompt_ids(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, count: int) -> list[list[int]]:
    """Token ids of `count` problems of the recipe's task after every problem the run drew."""
    task = setup.task(recipe)
    first_index = recipe.train.steps * recipe.train.prompts_per_step
    return [encode_prompt(tokenizer, task.problem(index).prompt) for index in range(first_index, first_index + count)]


def token_log_probs(model: PreTrainedModel, prompt_ids: list[int]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for every token of one prompt after the first: [len(prompt_ids) - 1]."""
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[0, 1:, None])[:, 0]


def _check_reload(policy: PreTrainedModel, folder: Path, prompt_ids: list[list[int]], output_dir: Path) -> None:
    """Reload `folder` as a user would (float32, as saved) and require the checkpoint's log-probs bit for bit."""
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=policy.dtype).eval()
    for prompt in prompt_ids:
        if not torch.equal(token_log_probs(reloaded, prompt), token_log_probs(policy, prompt)):
            raise PolicyExportError(
                f"the exported policy reloaded with transformers does not reproduce the checkpoint's log-probs; "
                f"nothing was written to {output_dir}."
            )
