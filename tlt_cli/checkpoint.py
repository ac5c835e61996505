"""Checkpoints of a run: written atomically and durably, found again (and checked) by `--resume` and export.

Layout under runs/<name>/checkpoints/:
  step_000010/        a complete checkpoint; state.json says `next_step: 10` and the size of every file
  latest              the name of the newest complete checkpoint
  .staging-step_N/    a checkpoint being written (never read; removed on the next attempt)
Workers write into the staging folder collectively, then rank 0 adds state.json, fsyncs every file
and folder, and renames it into place, so a kill or a power cut at any moment leaves either the old
or the new checkpoint, never half of one. `latest_checkpoint` checks the checkpoint `latest` names
(state.json readable, every file its recorded size); when it is damaged it falls back to the newest
complete checkpoint before it, with a warning naming what was wrong. A write the run directory's file
system refuses as full (torch.save says so only as a RuntimeError) is a `DiskFullError`, one sentence
naming the file system and its free bytes; the driver then removes the staging folder
(`remove_staging`), and `next_run_advice` says whether there is a checkpoint to `--resume`.

`load_checkpoint_file` is how every `.pt` file of a run directory is read: `torch.load` restricted to
tensors and plain data (`weights_only=True`) plus the few classes a caller names, so a copied or
shared run directory cannot run code on `--resume`. Before loading it checks every record of the file's zip
archive against the CRC-32 torch.save wrote for it (torch.load does not), so bytes zeroed or overwritten with the
size kept are a `CheckpointError` naming the file, never a silently different tensor; the check reads the file
once more (about 0.4 s per GB on the 2-core test machine).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tlt_cli.atomic_files import fsync_path, read_bounded, write_atomically
from tlt_cli.errors import UserError

STATE_FILE = "state.json"
LATEST_FILE = "latest"
# `latest` holds one checkpoint's name: a larger file (or a link to one) is not a `latest`
LATEST_LIMIT_BYTES = 256
# the run's drafter in a checkpoint, in the save_drafter format: whoever trains or keeps the drafter
# writes it there (a drafter-training plugin, TRL's rollout) and `tlt export-drafter` reads it
DRAFTER_DIRECTORY = "drafter"
# the sizes of the checkpoint's files, recorded in state.json at publish and checked before a resume
FILE_SIZES_KEY = "file_sizes"
# step_000010: the step number, at least six digits wide (ordered by number, so step_1000000 follows step_999999)
CHECKPOINT_NAME = re.compile(r"step_(\d{6,})")
# how a zip archive (torch.save's format since torch 1.6) begins: a local file header
ZIP_MAGIC = b"PK\x03\x04"
# the lines of torch.load's weights-only refusal that are advice, not the reason
TORCH_LOAD_ADVICE = ("Weights only load failed", "Check the documentation")
# errno values of a write refused for want of room: the file system is full, or the user's quota is
FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# a failed checkpoint write is blamed on a full disk when a probe write of this size next to it is refused as full
DISK_PROBE_BYTES = 1 << 20


class CheckpointError(UserError):
    """A run directory that cannot be resumed; the message says what is missing."""


class DiskFullError(CheckpointError):
    """A checkpoint the run directory's file system had no room for; the message names it and its free bytes."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder, its state.json, and a warning when `latest` named a damaged one."""

    directory: Path
    state: dict[str, Any]
    warning: str | None = None

    @property
    def next_step(self) -> int:
        return int(self.state["next_step"])

    @property
    def last_step(self) -> int:
        """The RL step it was written after, counted from 0 as the trace and the live table count (step_000003: 2)."""
        return self.next_step - 1


def checkpoint_name(next_step: int) -> str:
    return f"step_{next_step:06d}"


def checkpoint_number(folder: Path) -> int | None:
    """The step a checkpoint folder's name carries (step_000010 -> 10), or None for another name."""
    match = CHECKPOINT_NAME.fullmatch(folder.name)
    return int(match.group(1)) if match else None


def numbered_checkpoints(checkpoints: Path) -> list[Path]:
    """The folders named like checkpoints, oldest (lowest step) first."""
    named = [path for path in checkpoints.glob("step_*") if checkpoint_number(path) is not None]
    return sorted(named, key=checkpoint_number)


def staging_directory(checkpoints: Path, next_step: int) -> Path:
    return checkpoints / f".staging-{checkpoint_name(next_step)}"


def remove_staging(checkpoints: Path) -> None:
    """Remove the staging folders a failed save left (the driver, once every worker has stopped): they are never
    read, and after a full disk they keep it full."""
    for staging in checkpoints.glob(".staging-step_*"):
        shutil.rmtree(staging, ignore_errors=True)


def prepare_staging(checkpoints: Path, next_step: int) -> Path:
    """Rank 0, before the collective save: an empty staging folder (left-overs of a kill removed)."""
    staging = staging_directory(checkpoints, next_step)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def publish(checkpoints: Path, next_step: int, extra_state: dict[str, Any], keep: int) -> Path:
    """Rank 0, after the collective save: state.json, fsync, rename into place, point `latest`, prune.

    Durability costs one fsync per file of the checkpoint (the ranks' weights and optimizer shards
    were written through the page cache): 0.11 s for a 76 MB checkpoint (the tiny recipe's) on the
    2-core test machine, every `checkpoint.every` steps, not per step.
    """
    staging = staging_directory(checkpoints, next_step)
    file_sizes = {str(path.relative_to(staging)): path.stat().st_size for path in _files(staging)}
    state = {"next_step": next_step, **extra_state, FILE_SIZES_KEY: file_sizes}
    write_atomically(staging / STATE_FILE, json.dumps(state, indent=2))
    for path in [*_files(staging), *_folders(staging)]:
        fsync_path(path)
    final = checkpoints / checkpoint_name(next_step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    fsync_path(checkpoints)
    write_atomically(checkpoints / LATEST_FILE, final.name)
    _prune(checkpoints, keep)
    return final


def _files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def _folders(folder: Path) -> list[Path]:
    """Every folder under `folder`, deepest first, then `folder` itself."""
    inner = sorted((path for path in folder.rglob("*") if path.is_dir()), key=lambda path: -len(path.parts))
    return [*inner, folder]


def _prune(checkpoints: Path, keep: int) -> None:
    complete = [path for path in numbered_checkpoints(checkpoints) if (path / STATE_FILE).is_file()]
    for old in complete[:-keep]:
        shutil.rmtree(old)


def latest_checkpoint(run_directory: Path) -> Checkpoint:
    """The newest complete checkpoint of a run; CheckpointError (naming the file at fault) if there is none.

    The one `latest` names when it is intact, else the newest intact one before it, with a warning.
    """
    checkpoints = run_directory / "checkpoints"
    latest = checkpoints / LATEST_FILE
    if not latest.is_file():
        raise CheckpointError(
            f"{run_directory} has no checkpoint to resume from (no {latest}); start a new run instead."
        )
    name = _latest_name(latest)
    try:
        if not CHECKPOINT_NAME.fullmatch(name or ""):
            held = f"it holds {name[:40]!r}" if name is not None else "it is a link, or not a small file of one name"
            raise CheckpointError(f"{latest} does not name a checkpoint ({held}).")
        return Checkpoint(checkpoints / name, checked_state(checkpoints / name))
    except CheckpointError as damage:
        newest = checkpoint_number(checkpoints / name) if name else None
        for older in reversed(numbered_checkpoints(checkpoints)):
            if newest is None or checkpoint_number(older) < newest:
                try:
                    state = checked_state(older)
                except CheckpointError:
                    continue
                return Checkpoint(older, state, warning=f"{damage} Using the previous complete checkpoint {older}.")
        raise damage from None


def _latest_name(latest: Path) -> str | None:
    """The name `latest` holds; None when it is a symbolic link (tlt writes a file; a link's target is never shown)
    or not a regular file of at most LATEST_LIMIT_BYTES."""
    if latest.is_symlink():
        return None
    try:
        return read_bounded(latest, LATEST_LIMIT_BYTES).decode("utf-8", errors="replace").strip()
    except (OSError, ValueError):
        return None


def checked_state(directory: Path) -> dict[str, Any]:
    """A checkpoint's state.json, checked: a JSON object with next_step, and every file its recorded size."""
    state_path = directory / STATE_FILE
    if not state_path.is_file():
        raise CheckpointError(f"checkpoint {directory} is incomplete (no {STATE_FILE}).")
    try:
        state = json.loads(read_bounded(state_path))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, OSError, RecursionError) as error:
        reason = getattr(error, "msg", None) or ("not UTF-8" if isinstance(error, UnicodeDecodeError) else str(error))
        raise CheckpointError(f"checkpoint state {state_path} is not valid JSON ({reason}).") from None
    next_step = state.get("next_step") if isinstance(state, dict) else None
    if not isinstance(next_step, int) or isinstance(next_step, bool) or not 0 <= next_step < 2**63:
        raise CheckpointError(
            f"checkpoint state {state_path} has no 'next_step' (a step count); it was not written by tlt or is damaged."
        )
    file_sizes = state.get(FILE_SIZES_KEY) or {}
    if not isinstance(file_sizes, dict) or not all(
        isinstance(size, int)
        and not isinstance(size, bool)
        and Path(relative).parts
        and ".." not in Path(relative).parts
        and not Path(relative).is_absolute()
        for relative, size in file_sizes.items()
    ):
        raise CheckpointError(
            f"checkpoint state {state_path} has no '{FILE_SIZES_KEY}' (file name -> bytes); it was not written by tlt "
            "or is damaged."
        )
    for relative, size in file_sizes.items():
        path = directory / relative
        if not path.is_file() or path.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file {path} is missing or truncated (expected {size} bytes); the checkpoint is damaged."
            )
    return state


def unloadable_checkpoint(directory: Path, error: BaseException) -> str:
    """One sentence for a checkpoint that passed its size check and still does not load (a tampered or emptied
    shard, another model's shapes): what failed, and advice that does not repeat the failure (the folder removed,
    `--resume` falls back to the checkpoint before it, latest_checkpoint)."""
    detail = load_failure_reason(error) if str(error) else type(error).__name__
    return (
        f"checkpoint {directory} cannot be loaded ({type(error).__name__}: {detail}): it is damaged or holds another "
        f"model; remove {directory} and --resume falls back to the checkpoint before it, or start a new run."
    )


def load_checkpoint_file(path: Path, allowed_classes: Iterable[type] = (), map_location: Any = None) -> Any:
    """`torch.load` of a run-directory file, restricted to tensors, plain data and `allowed_classes`.

    Trade-off: `weights_only=True` refuses any object the caller did not name, so a class added to
    a saved state later must be named here too (a resume then says which global was refused); in
    exchange a copied or shared run directory can never run code. CheckpointError names the file, also when a
    record's bytes differ from its recorded CRC-32 (`damaged_record`).
    """
    import torch

    damage = damaged_record(path)
    if damage is not None:
        raise CheckpointError(f"checkpoint file {path} is damaged ({damage}); its bytes changed after it was written.")
    try:
        # torch warns that a plain pickle's protocol is not its default: noise beside the refusal
        with torch.serialization.safe_globals(list(allowed_classes)), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete.") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as error:
        raise CheckpointError(
            f"checkpoint file {path} cannot be loaded safely ({load_failure_reason(error)}): it is damaged or was not "
            "written by tlt, and tlt loads only tensors and plain data from a run directory."
        ) from None


def damaged_record(path: Path) -> str | None:
    """What is wrong with a zip-format `.pt` file whose records do not match their CRC-32 or whose archive is broken;
    None when every record matches, or when the file is no zip archive (torch.load then says what it is)."""
    try:
        with path.open("rb") as handle:
            if handle.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
                return None
            with zipfile.ZipFile(handle) as archive:
                failed = archive.testzip()
    except FileNotFoundError:
        return None
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as error:
        return f"its zip archive is broken: {_first_sentence(str(error)) or type(error).__name__}"
    return f"record {failed} does not match its CRC-32" if failed is not None else None


def load_failure_reason(error: Exception) -> str:
    """The line of a torch.load error that says what was wrong (the refused global, the bad record),
    without torch's advice around it (which suggests turning the weights-only check off)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for number, line in enumerate(lines):
        _, marker, detail = line.partition("WeightsUnpickler error:")
        if marker:
            return _first_sentence(detail.strip() or (lines[number + 1 :] or [""])[0])
    for line in lines:
        if not line.startswith(TORCH_LOAD_ADVICE) and "weights_only" not in line:
            return _first_sentence(line)
    return type(error).__name__


def _first_sentence(line: str) -> str:
    return line.split(". ")[0].rstrip(".")[:200]


def save_collectively(
    checkpoints: Path,
    next_step: int,
    rank: int,
    barrier: Callable[[], None],
    save_parts: Callable[[Path], None],
    extra_state: dict[str, Any],
    keep: int,
) -> Path:
    """Run on every worker: stage, let each rank write its parts, then rank 0 publishes.

    A write the file system refuses for want of room is a DiskFullError (torch.save's RuntimeError
    included); any other OSError (read-only, no permission) a CheckpointError naming the folder.
    """
    staging = staging_directory(checkpoints, next_step)
    final = checkpoints / checkpoint_name(next_step)
    if rank == 0:
        with _checkpoint_write(staging, final.name):
            prepare_staging(checkpoints, next_step)
    barrier()
    with _checkpoint_write(staging, final.name):
        save_parts(staging)
    barrier()
    if rank == 0:
        with _checkpoint_write(final, final.name):
            publish(checkpoints, next_step, extra_state, keep)
    barrier()
    return final


@contextlib.contextmanager
def _checkpoint_write(path: Path, name: str) -> Iterator[None]:
    """Around a write of checkpoint `name` to `path`: a full disk is a DiskFullError, another OSError a
    CheckpointError, each ending with what to do next."""
    checkpoints = path.parent
    run_directory = checkpoints.parent
    try:
        yield
    except (OSError, RuntimeError) as error:
        if disk_is_full(error, checkpoints):
            raise DiskFullError(
                f"the file system of run directory {run_directory} is full ({_free_bytes(run_directory)}), so "
                f"checkpoint {name} could not be written and its partial files are removed; free some space; "
                f"{next_run_advice(run_directory)}."
            ) from error  # the run's log keeps the write's own traceback
        if not isinstance(error, OSError):
            raise
        raise CheckpointError(
            f"cannot write {path} ({error.strerror or type(error).__name__}); make it writable; "
            f"{next_run_advice(run_directory)}."
        ) from None


def disk_is_full(error: BaseException, folder: Path) -> bool:
    """Whether `error`, raised by a write under `folder`, means its file system is full.

    An OSError says so by its errno (its own or a cause's); torch.save's RuntimeError ("unexpected
    pos ...") carries none, so a probe write of DISK_PROBE_BYTES in `folder` decides: refused for
    want of room, the disk is full (the failed write's partial files still hold it), else the error
    is another one and stays as it is.
    """
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError) and cause.errno in FULL_DISK_ERRNOS:
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    probe = folder / f".disk-probe-{os.getpid()}"
    try:
        with probe.open("wb") as handle:
            handle.write(bytes(DISK_PROBE_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as refusal:
        return refusal.errno in FULL_DISK_ERRNOS
    finally:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
    return False


def _free_bytes(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free:,} bytes free"
    except OSError:
        return "free space unknown"


def next_run_advice(run_directory: Path) -> str:
    """What to do once a failed run's cause is fixed: `--resume` when it kept a complete checkpoint, else start
    again (a folder that holds a run's trace or checkpoints folder cannot be a new run's)."""
    try:
        latest_checkpoint(run_directory)
    except (CheckpointError, OSError):
        return (
            f"no checkpoint was completed, so start the run again with another run.name or after removing "
            f"{run_directory}"
        )
    return f"complete checkpoints are kept, continue with --resume {run_directory}"
