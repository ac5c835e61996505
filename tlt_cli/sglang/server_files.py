"""What tlt's SGLang servers leave on the machine, recorded while they run and removed however they end.

SGLang 0.5.23 leaves files even after a clean stop: three Unix sockets and two empty files in its
temporary folder, a `/dev/shm/sglang_loads_<instance id>_<digest>.shm` (the scheduler's load snapshot)
and a `/dev/shm/sem.mp-*` (a multiprocessing semaphore). Neither /dev/shm name can be told from
outside (a random instance id, a random semaphore name), so tlt writes them down while the server runs:
- every server gets a temporary folder of its own (`make_server_folder`; its TMPDIR, so SGLang's
  sockets and files land in it), named `tlt-sglang-<index>-*` under the system temporary folder (a
  Unix socket's path is at most 107 bytes, so not under the run directory);
- in it, `tlt-server.json` names the tlt process that started the server and the server's leader
  (pid and start time), and the /dev/shm entries the server's processes hold (`record_shared_memory`,
  called while the server starts, once it is healthy and as it is stopped), found by inode, not by the
  name a process shows (tlt_cli/shared_memory.py `held_inodes` says why);
- `remove_server_files(folder)` removes the recorded entries that are still the same file (same
  inode) and that no live process holds, then the folder.
ServerGroup.stop (server.py) removes its own servers' files. After a kill (of the worker, or of
`tlt train`), `remove_abandoned_server_files` removes those of every server whose starter and whose
processes are all gone: every server start calls it first, and so does the driver once it has
stopped the servers of a worker that died (registry.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from tlt_cli.process_status import stat_fields
from tlt_cli.shared_memory import SHARED_MEMORY_DIRECTORY, held_inodes, shared_memory_entries

SERVER_FOLDER_PREFIX = "tlt-sglang-"
RECORD_FILE = "tlt-server.json"


def process_start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22), or None if it is gone.

    A pid with the same start is the same process: a pid Linux has given to another process since differs.
    """
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def live_group_members(process_group: int) -> list[int]:
    """Pids in `process_group` that are still running (zombies excluded), read from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        if fields is None:
            continue
        state, _parent, group = fields[:3]
        if int(group) == process_group and state != "Z":
            members.append(int(entry.name))
    return members


def make_server_folder(index: int) -> Path:
    """A new temporary folder for server `index` (0700), recorded as started by this process."""
    folder = Path(tempfile.mkdtemp(prefix=f"{SERVER_FOLDER_PREFIX}{index}-"))
    _write_record(folder, {"starter": _identity(os.getpid())})
    return folder


def record_leader(folder: Path, leader: int) -> None:
    """Note the server's leader (its process group) in its folder's record."""
    _write_record(folder, {**_read_record(folder), "leader": _identity(leader)})


def record_shared_memory(folder: Path, leader: int) -> None:
    """Add the /dev/shm entries the processes of `leader`'s group hold now to the folder's record."""
    record = _read_record(folder)
    held = held_inodes(live_group_members(leader))
    known = {tuple(entry["inode"]) for entry in record.get("shared_memory", [])}
    found = [
        {"path": str(path), "inode": list(inode)}
        for path, inode in shared_memory_entries().items()
        if inode in held and inode not in known
    ]
    if found:
        _write_record(folder, {**record, "shared_memory": [*record.get("shared_memory", []), *found]})


def remove_server_files(folder: Path) -> list[Path]:
    """Remove the folder's recorded /dev/shm entries (those still the same file that no live process holds) and
    the folder; the entries removed."""
    recorded = _read_record(folder).get("shared_memory", [])
    held = held_inodes() if recorded else set()
    removed = []
    for entry in recorded:
        path = Path(entry["path"])
        if path.parent != SHARED_MEMORY_DIRECTORY:
            continue
        try:
            status = path.lstat()
        except OSError:
            continue
        inode = (status.st_dev, status.st_ino)
        if inode == tuple(entry["inode"]) and inode not in held:
            path.unlink(missing_ok=True)
            removed.append(path)
    shutil.rmtree(folder, ignore_errors=True)
    return removed


def remove_abandoned_server_files(temporary_directory: Path | None = None) -> list[Path]:
    """Remove the files of every server of this user whose starter and whose processes are all gone (a killed
    run's); the server folders removed. A folder whose record cannot be read is left alone."""
    directory = Path(temporary_directory or tempfile.gettempdir())
    removed = []
    for folder in sorted(directory.glob(f"{SERVER_FOLDER_PREFIX}*")):
        try:
            if not folder.is_dir() or folder.is_symlink() or folder.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not _abandoned(_read_record(folder)):
            continue
        remove_server_files(folder)
        removed.append(folder)
    return removed


def _abandoned(record: dict) -> bool:
    """Whether `record` names a server whose starter is gone and whose process group has no live process."""
    starter, leader = record.get("starter"), record.get("leader")
    if not isinstance(starter, dict) or _is_running(starter):
        return False
    if leader is None:
        return True  # the starter died before it could spawn (or record) the server
    return isinstance(leader, dict) and isinstance(leader.get("pid"), int) and not live_group_members(leader["pid"])


def _identity(pid: int) -> dict:
    return {"pid": pid, "started": process_start_ticks(pid)}


def _is_running(identity: dict) -> bool:
    """Whether the process the identity names is still that process (a reused pid is another one)."""
    try:
        return identity["started"] is not None and process_start_ticks(identity["pid"]) == identity["started"]
    except (KeyError, TypeError):
        return False


def _read_record(folder: Path) -> dict:
    try:
        record = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(folder: Path, record: dict) -> None:
    """Written whole, then renamed into place: a reader never sees half a record."""
    staging = folder / f"{RECORD_FILE}.tmp"
    staging.write_text(json.dumps(record), encoding="utf-8")
    staging.replace(folder / RECORD_FILE)
