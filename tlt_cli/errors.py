"""The base of every error a user can cause and fix: a bad recipe, a missing file, a model that does not load.

Its message is one sentence naming the key or file to fix. The CLI prints it and exits with code 2
wherever it is raised: in the command itself, in the checks before a run, or in a worker process
(the worker marks its failure as the user's, the driver re-raises it; tlt_cli/processes/driver.py).
`writing(path, advice)` turns a write the disk refuses (full, read-only, no permission) into one;
`nearest_existing(path)` is where the checks before a write look (the part of a path that exists);
`did_you_mean(word, choices)` is the hint a refusal of a mistyped key or name starts with.
"""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterable, Iterator
from pathlib import Path


class UserError(ValueError):
    """A problem the user can fix; the message is one sentence naming the key or file."""


class TrainingDiverged(RuntimeError):
    """The policy's logits or loss stopped being finite: training diverged. The worker's message names the step and
    the likely cause; the driver then advises no --resume (tlt_cli/processes/driver.py)."""


@contextlib.contextmanager
def writing(path: Path, advice: str, error_type: type[UserError] = UserError) -> Iterator[None]:
    """Around a write to `path`: an OSError becomes `error_type` naming the path and the reason, then `advice`."""
    try:
        yield
    except OSError as error:
        raise error_type(f"cannot write {path} ({error.strerror or type(error).__name__}); {advice}") from None


def nearest_existing(path: Path) -> Path:
    """`path` itself, or its closest ancestor that exists (a folder or a file): what decides whether it can be made."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    return existing


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """ "did you mean 'train.steps'? " for the choice closest to a mistyped `word` (difflib), or "" for none close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean '{close[0]}'? " if close else ""
