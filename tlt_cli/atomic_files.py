"""Files written whole or not at all, JSON records read back or treated as absent, and lock files that are never links.

`write_atomically(path, text)` writes a new temporary file beside `path` (O_EXCL: never a file or a link
already there), fsyncs it, renames it over `path` and fsyncs the folder, so a kill or a power cut leaves
the old file or the new one, never an empty or half one; whatever fails (a full disk included), the
temporary file is removed. `read_bounded(path)` is the bytes of a regular file of at most RECORD_LIMIT_BYTES
(a FIFO, a device such as /dev/zero, a folder or a larger file is refused with ValueError, never read until
memory runs out or waited on). `read_valid_json(path, valid)` is the one guard of every record reader: the JSON
object a bounded regular file holds when `valid(record)` says yes, else None, whatever went wrong (missing,
unreadable, not JSON, another JSON value, or any exception `valid` raises on hostile values: an integer too
large for a float, an infinite axis): a reader that treats a damaged record as absent.
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
import stat
from collections.abc import Callable, Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk (a folder: the names in it)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, text: str | bytes) -> None:
    """Write `text` (UTF-8; or bytes as they are) to a new temporary sibling, fsync it, rename it over `path`, fsync
    the folder (module docstring)."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(text.encode("utf-8") if isinstance(text, str) else text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_path(path.parent)


def current_umask() -> int:
    """The process's umask (Linux names it in /proc/self/status; elsewhere it is set and restored at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def files_with_the_umasks_mode(folder: Path) -> None:
    """Give each regular file in `folder` the mode a plain `open` makes (0666 less the umask: 0644 under the usual
    022); a writer that went through a private temporary file (safetensors under transformers) left 0600."""
    mode = 0o666 & ~current_umask()
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


# the most bytes a record (a measurement, a checkpoint's state, a run's small files) is read to: a larger one is damage
RECORD_LIMIT_BYTES = 16 << 20


def read_bounded(path: Path, limit: int = RECORD_LIMIT_BYTES) -> bytes:
    """The bytes of `path`, a regular file (a link to one is followed) of at most `limit` bytes; OSError when it is
    missing or unreadable, ValueError when it is not a regular file (a FIFO: opened without waiting for a writer;
    a device; a folder) or is larger than `limit`."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{path} holds {info.st_size} bytes, more than {limit}")
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(descriptor, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(descriptor)
    data = b"".join(chunks)
    if len(data) > limit:  # grew while read
        raise ValueError(f"{path} holds more than {limit} bytes")
    return data


def not_a_file(path: Path) -> str:
    """Why `path`, given as a file, is not a regular file: "does not exist", "is a folder, not a file", or "is not a
    regular file (a device, a FIFO or a socket)" (/dev/null exists: saying it does not would mislead)."""
    if path.is_dir():
        return "is a folder, not a file"
    if path.exists():
        return "is not a regular file (a device, a FIFO or a socket)"
    return "does not exist"


def read_valid_json(
    path: Path, valid: Callable[[dict], bool] = lambda record: True, limit: int = RECORD_LIMIT_BYTES
) -> dict | None:
    """The JSON object in `path` when `valid(record)` holds; None when the file is missing or unreadable, not a
    bounded regular file, not JSON (or not UTF-8), another JSON value, or `valid` says no or raises anything."""
    try:
        value = json.loads(read_bounded(path, limit))
        return value if isinstance(value, dict) and valid(value) else None
    except Exception:  # noqa: BLE001 - any failure on hostile content is damage, never a traceback
        return None


def read_json_object(path: Path) -> dict | None:
    """The JSON object in `path` (read_valid_json with no further check)."""
    return read_valid_json(path)


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
