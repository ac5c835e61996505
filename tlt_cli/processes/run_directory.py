"""The run directory's life: made for a new run, locked while the run lives, removed if it fails at once.

`RunDirectory.create(recipe)` makes `<run.output_dir>/<run.name>/` (noting which folders of that
path this run made) and `RunDirectory.resume(path)` takes an existing one; both lock it
(`fcntl.flock` on `run.lock` inside it, held until `release` or the process's end, SIGKILL
included), so a second `tlt train` of the same run refuses in one sentence instead of sharing the
folder. A new run that fails before its first step is discarded: its own folder goes, and of the
parent folders it made only those still empty (rmdir), so a `runs/` that another run has put its
own run into since is never touched. `resume_checkpoint` picks where a `--resume` starts: the
newest complete checkpoint whose steps the trace all recorded (workers publish a checkpoint before
they report its step, and outlive a killed driver by up to half a second, so the newest checkpoint
can be a step ahead of the trace). A new run records what it is trained from in `model.json`
(tlt_cli/models/identity.py: config, shapes, a weights digest), which `trained_from` reads back for
`--resume`. Used by the driver (driver.py); `holds_run` is the test the whole-recipe check
(tlt_cli/preflight.py) shares.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import TextIO

from tlt_cli.atomic_files import read_valid_json
from tlt_cli.checkpoint import Checkpoint, CheckpointError, checked_state, latest_checkpoint, numbered_checkpoints
from tlt_cli.config import Recipe, recipe_to_yaml
from tlt_cli.errors import UserError
from tlt_cli.models.identity import model_identity
from tlt_cli.trace import lenient_record

RECIPE_FILE = "recipe.yaml"
# the identity of the model a run was trained from (tlt_cli/models/identity.py), written when the run starts
MODEL_FILE = "model.json"
TRACE_FILE = "trace.jsonl"
CHECKPOINTS = "checkpoints"
# the driver's log in the run directory: the traceback of whatever stopped the run
RUN_LOG = "run.log"
LOG_SUFFIX = ".log"
# held locked (and holding the holder's pid) while a tlt train uses the run directory
LOCK_FILE = "run.lock"
# attempts to make the run directory's folders while another run removes an empty parent of it
MAKE_ATTEMPTS = 3


class RunDirectoryError(UserError):
    """A run directory that cannot be used as asked (holds a run already, or another tlt train uses it)."""


def holds_run(run_directory: Path) -> bool:
    """Whether a folder holds a run already (its trace or checkpoints)."""
    return (run_directory / TRACE_FILE).exists() or (run_directory / CHECKPOINTS).exists()


def resume_checkpoint(run_directory: Path) -> tuple[Checkpoint, list[str]]:
    """Where `--resume` starts, and the warnings to show (one line each): a damaged `latest`, a checkpoint ahead
    of the trace.

    A checkpoint ahead of the trace (its last steps never recorded: the driver was killed first) is
    passed over for the newest complete one the trace covers, which the run then recomputes to the
    same weights (a resumed step draws the same samples); only when none is kept does the resume
    start at it, and those steps stay missing from the trace.
    """
    checkpoint = latest_checkpoint(run_directory)
    warnings = [checkpoint.warning] if checkpoint.warning else []
    recorded = recorded_steps(run_directory / TRACE_FILE)
    if checkpoint.next_step <= recorded:
        return checkpoint, warnings
    last = checkpoint.next_step - 1
    unrecorded = f"step {last}" if recorded == last else f"steps {recorded}..{last}"
    covered = _newest_checkpoint_until(run_directory / CHECKPOINTS, recorded)
    if covered is None:
        warnings.append(
            f"the trace has no record of {unrecorded} (tlt train was stopped before it wrote them) and no older "
            f"checkpoint is kept; resuming at step {checkpoint.next_step}, those steps stay missing from the trace."
        )
        return checkpoint, warnings
    warnings.append(
        f"checkpoint {checkpoint.directory.name} is ahead of the trace ({unrecorded} never recorded: tlt train was "
        f"stopped first); resuming from {covered.directory.name} so that the trace stays whole."
    )
    return covered, warnings


def recorded_steps(trace_path: Path) -> int:
    """The step after the trace's last step record (0 without one); a last line cut short by a kill is skipped."""
    if not trace_path.is_file():
        return 0
    recorded = 0
    with trace_path.open("rb") as lines:
        for line in lines:
            record = lenient_record(line)  # a damaged line is no record (truncate_trace drops it, with a warning)
            if record is not None and record["type"] == "step" and "step" in record:
                recorded = max(recorded, record["step"] + 1)
    return recorded


def _newest_checkpoint_until(checkpoints: Path, next_step: int) -> Checkpoint | None:
    """The newest complete checkpoint with next_step at most `next_step`, or None."""
    for folder in reversed(numbered_checkpoints(checkpoints)):
        try:
            state = checked_state(folder)
        except CheckpointError:
            continue
        if int(state["next_step"]) <= next_step:
            return Checkpoint(folder, state)
    return None


def trained_from(run_directory: Path) -> dict | None:
    """The identity of the model the run was trained from, as recorded at its start; None for a run that recorded
    none (started by an older tlt) or whose record is unreadable."""
    return read_valid_json(run_directory / MODEL_FILE)


class RunDirectory:
    """A run directory this process holds locked: `path`, and the folders of its path it made (outermost first)."""

    def __init__(self, path: Path, created: list[Path], lock: TextIO):
        self.path, self.created, self.lock = path, created, lock

    @classmethod
    def create(cls, recipe: Recipe) -> RunDirectory:
        """runs/<name>/ for a new run, with its recipe.yaml; refuses one that holds a run or that another run uses."""
        path = Path(recipe.run.output_dir).expanduser() / recipe.run.name
        identity = model_identity(recipe.model.path, recipe.model.trust_remote_code)
        created = _make_folders(path)
        directory = cls(path, created, _lock(path))
        if holds_run(path):
            directory.release()
            raise RunDirectoryError(
                f"run directory {path} already holds a run; resume it with --resume {path} "
                f"or choose another name with run.name=<name>."
            )
        (path / RECIPE_FILE).write_text(recipe_to_yaml(recipe), encoding="utf-8")
        (path / MODEL_FILE).write_text(json.dumps(identity, indent=1), encoding="utf-8")
        return directory

    @classmethod
    def resume(cls, path: Path) -> RunDirectory:
        """The existing run directory `path`, locked for the resumed run."""
        return cls(path, [], _lock(path))

    @property
    def made_by_this_run(self) -> bool:
        """Whether this run made the folder (only then may a failure remove it)."""
        return self.path in self.created

    def release(self) -> None:
        """End this process's hold (another tlt train may use the folder from now on)."""
        self.lock.close()

    def discard(self, keep_log: bool) -> None:
        """Remove what this run made (a failure before its first step): only folders it made, parents only if empty.

        With keep_log, everything in the run directory but its *.log files goes, and the folders stay.
        A run directory that existed before the run (e.g. an empty folder) is left as it is.
        """
        if not self.made_by_this_run:
            return
        if keep_log:
            _remove_all_but_logs(self.path)
            return
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in reversed(self.created[:-1]):
            try:
                parent.rmdir()  # only while empty: another run may have put its run directory there meanwhile
            except OSError:
                return


def _make_folders(path: Path) -> list[Path]:
    """Make `path` and its missing parents, one at a time; those this call made, outermost first.

    A folder another process makes meanwhile is not this run's (it will not remove it); a parent
    another failing run removes meanwhile is made again.
    """
    for _ in range(MAKE_ATTEMPTS):
        missing = []
        folder = path
        while not folder.exists() and folder != folder.parent:
            missing.append(folder)
            folder = folder.parent
        created = []
        try:
            for folder in reversed(missing):
                try:
                    folder.mkdir()
                except FileExistsError:
                    continue
                created.append(folder)
            return created
        except FileNotFoundError:
            continue
    raise RunDirectoryError(f"the run directory {path} could not be created: its parent folders keep disappearing.")


def _lock(path: Path) -> TextIO:
    """The run directory's lock file, locked by this process; RunDirectoryError naming the holder if another has it."""
    try:
        lock = (path / LOCK_FILE).open("a+", encoding="utf-8")
    except OSError as error:  # a read-only file system, a folder without write permission
        raise RunDirectoryError(
            f"run directory {path} cannot be written ({error.strerror or error}), and a run writes its checkpoints "
            "and trace there; copy it to a writable place and --resume the copy."
        ) from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        raise RunDirectoryError(
            f"run directory {path} is in use by another tlt train{f' (pid {holder})' if holder else ''}; "
            "wait for it to end, or choose another name with run.name=<name>."
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def _remove_all_but_logs(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), key=lambda path: len(path.parts), reverse=True):
        if path.is_file() and path.suffix != LOG_SUFFIX:
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()
