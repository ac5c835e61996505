"""Files written whole or not at all, JSON records read back or treated as absent, and lock files that are never links.

`write_atomically(path, text)` writes a new temporary file beside `path` (O_EXCL: never a file or a link
already there), fsyncs it, renames it over `path` and fsyncs the folder, so a kill or a power cut leaves
the old file or the new one, never an empty or half one; whatever fails (a full disk included), the
temporary file is removed. `read_json_object(path)` is the JSON object a file holds, or None when it is
missing, unreadable, not JSON or another JSON value: a reader that treats a damaged record as absent.
`exclusive_lock(path)` holds an flock on a lock file opened without following a symbolic link (one planted
at its predictable name is refused, never truncated or written through). Used by checkpoints
(tlt_cli/checkpoint.py), the trace, calibration reports and the per-machine measurement caches
(tlt_cli/tuning/cache.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk (a folder: the names in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to a new temporary sibling, fsync it, rename it over `path`, fsync the folder (module docstring)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_path(path.parent)


def read_json_object(path: Path) -> dict | None:
    """The JSON object in `path`; None when the file is missing or unreadable, is not JSON (or not UTF-8), or holds
    another JSON value."""
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` for the block (made if missing, never truncated); OSError (ELOOP) when
    `path` is a symbolic link, which is never followed."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)  # released when the descriptor closes
        yield
    finally:
        os.close(descriptor)
