"""Checkpoints of a run: written atomically, found again by `--resume`.

Layout under runs/<name>/checkpoints/:
  step_000010/        a complete checkpoint; state.json says `next_step: 10`
  latest              the name of the newest complete checkpoint
  .staging-step_N/    a checkpoint being written (never read; removed on the next attempt)
Workers write into the staging folder collectively, then rank 0 adds state.json and renames it
into place, so a kill at any moment leaves either the old or the new checkpoint, never half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tlt_cli.errors import UserError

STATE_FILE = "state.json"
LATEST_FILE = "latest"


class CheckpointError(UserError):
    """A run directory that cannot be resumed; the message says what is missing."""


def checkpoint_name(next_step: int) -> str:
    return f"step_{next_step:06d}"


def staging_directory(checkpoints: Path, next_step: int) -> Path:
    return checkpoints / f".staging-{checkpoint_name(next_step)}"


def write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


def prepare_staging(checkpoints: Path, next_step: int) -> Path:
    """Rank 0, before the collective save: an empty staging folder (left-overs of a kill removed)."""
    staging = staging_directory(checkpoints, next_step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(checkpoints: Path, next_step: int, extra_state: dict[str, Any], keep: int) -> Path:
    """Rank 0, after the collective save: state.json, rename into place, point `latest`, prune."""
    staging = staging_directory(checkpoints, next_step)
    write_atomically(staging / STATE_FILE, json.dumps({"next_step": next_step, **extra_state}, indent=2))
    final = checkpoints / checkpoint_name(next_step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    write_atomically(checkpoints / LATEST_FILE, final.name)
    _prune(checkpoints, keep)
    return final


def _prune(checkpoints: Path, keep: int) -> None:
    complete = sorted(path for path in checkpoints.glob("step_*") if (path / STATE_FILE).is_file())
    for old in complete[:-keep]:
        shutil.rmtree(old)


def latest_checkpoint(run_directory: Path) -> tuple[Path, dict[str, Any]]:
    """The newest complete checkpoint of a run and its state; CheckpointError if there is none."""
    checkpoints = run_directory / "checkpoints"
    latest = checkpoints / LATEST_FILE
    if not latest.is_file():
        raise CheckpointError(
            f"{run_directory} has no checkpoint to resume from (no {latest}); start a new run instead."
        )
    directory = checkpoints / latest.read_text(encoding="utf-8").strip()
    state_path = directory / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint {directory} named by {latest} is incomplete (no {STATE_FILE}).")
    return directory, json.loads(state_path.read_text(encoding="utf-8"))


def save_collectively(
    checkpoints: Path,
    next_step: int,
    rank: int,
    barrier: Callable[[], None],
    save_parts: Callable[[Path], None],
    extra_state: dict[str, Any],
    keep: int,
) -> Path:
    """Run on every worker: stage, let each rank write its parts, then rank 0 publishes."""
    staging = staging_directory(checkpoints, next_step)
    if rank == 0:
        prepare_staging(checkpoints, next_step)
    barrier()
    save_parts(staging)
    barrier()
    final = checkpoints / checkpoint_name(next_step)
    if rank == 0:
        publish(checkpoints, next_step, extra_state, keep)
    barrier()
    return final
