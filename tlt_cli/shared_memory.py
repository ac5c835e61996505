"""What tlt's processes leave in /dev/shm: DeepSpeed's all-reduce buffers named, and what no live process holds removed.

When every rank of a job runs on one node (the DeepSpeed launcher sets LOCAL_SIZE == WORLD_SIZE),
DeepSpeed's CPU all-reduce (its shm.cpp) makes one 69 MB segment per rank, named
`deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`, maps every rank's, and never
unlinks any. Three things keep them from filling the machine's memory:
1. each rank unlinks its own segment as soon as every rank has mapped every segment
   (`release_own_buffer`, after the process group's first barrier: init_worker_process in
   distributed.py); the maps stay valid, and the memory goes when the last rank exits, however it exits;
2. the driver of a hostfile run removes its run's segments once the ranks are gone
   (`run_buffers`: the names follow from the launch's port and size; launched_workers.py);
3. every `tlt train` first removes this user's segments that no live process maps or holds open
   (`remove_abandoned_buffers`: left by a run killed before its ranks could unlink them).
A segment is unmapped only between DeepSpeed's shm_open and its mmap a few lines later, so one
that no live process maps belongs to a process that has exited. SGLang's servers leave entries of
their own, recorded and removed by tlt_cli/sglang/server_files.py.
Where /dev/shm cannot be written (read-only, absent: `unwritable_reason`), DeepSpeed would report
"shared_create ... failed" and wait forever for its own segment; `deepspeed_buffers_if_writable` hides
from it that the ranks share a node, so its all-reduce goes through the process group instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path

SHARED_MEMORY_DIRECTORY = Path("/dev/shm")
DEEPSPEED_BUFFER_PREFIX = "deepspeed_allreduce_buffer"
# Python's named semaphores (multiprocessing/synchronize.py: `mp-` and a random suffix; glibc adds `sem.`)
MULTIPROCESSING_SEMAPHORE_PATTERN = "sem.mp-*"


def deepspeed_buffer(master_address: str, master_port: int | str, rank: int | str) -> Path:
    """The segment DeepSpeed makes for `rank` of a one-node job meeting at master_address:master_port."""
    return SHARED_MEMORY_DIRECTORY / f"{DEEPSPEED_BUFFER_PREFIX}_{os.getuid()}_{master_address}_{master_port}_{rank}"


def rank_buffer(environment: Mapping[str, str]) -> Path | None:
    """This rank's segment, named from the launcher's variables; None when DeepSpeed makes none (the ranks span
    nodes, or no launcher set LOCAL_SIZE)."""
    if environment.get("LOCAL_SIZE") != environment.get("WORLD_SIZE"):
        return None
    return deepspeed_buffer(environment["MASTER_ADDR"], environment["MASTER_PORT"], environment["RANK"])


def run_buffers(master_address: str, master_port: int, world_size: int) -> list[Path]:
    """Every rank's segment of a one-node job."""
    return [deepspeed_buffer(master_address, master_port, rank) for rank in range(world_size)]


def release_own_buffer(environment: Mapping[str, str]) -> None:
    """Unlink this rank's segment; call only once every rank has mapped every segment (after a barrier)."""
    buffer = rank_buffer(environment)
    if buffer is not None:
        buffer.unlink(missing_ok=True)


def unwritable_reason(directory: Path = SHARED_MEMORY_DIRECTORY) -> str | None:
    """Why no file can be made in `directory` now, in the system's words ("Read-only file system"), or None when
    one can (Python's multiprocessing semaphores and DeepSpeed's buffers are files in /dev/shm)."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix="tlt-probe-", dir=directory)
    except OSError as error:
        return error.strerror or type(error).__name__
    os.close(descriptor)
    os.unlink(probe)
    return None


@contextlib.contextmanager
def deepspeed_buffers_if_writable(environment: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Around DeepSpeed's init_distributed: when /dev/shm cannot be written, LOCAL_SIZE (the launcher's word that
    every rank is on this node, which makes DeepSpeed map its buffers) is hidden, then put back."""
    local_size = environment.get("LOCAL_SIZE")
    hidden = local_size is not None and unwritable_reason() is not None
    if hidden:
        del environment["LOCAL_SIZE"]
    try:
        yield
    finally:
        if hidden:
            environment["LOCAL_SIZE"] = local_size


def remove_unheld(paths: list[Path], directory: Path = SHARED_MEMORY_DIRECTORY) -> list[Path]:
    """Remove those of `paths` (files in `directory`) that exist and that no live process maps or holds open
    (compared by inode, whatever name the process shows); the ones removed (one a read-only /dev/shm keeps is not).
    Each file's inode is taken before the processes are read, and one whose name points at another inode by the
    time it would be removed (made anew meanwhile: a new owner's) is kept."""
    found = {}
    for path in paths:
        with contextlib.suppress(OSError):  # gone already
            status = path.lstat()
            found[path] = (status.st_dev, status.st_ino)
    held = held_inodes(directory=directory) if found else set()
    removed = []
    for path, inode in found.items():
        try:
            status = path.lstat()
            if inode in held or (status.st_dev, status.st_ino) != inode:
                continue
            path.unlink()
        except OSError:  # gone already, or kept by a read-only /dev/shm
            continue
        removed.append(path)
    return removed


def remove_abandoned_buffers() -> list[Path]:
    """Remove this user's DeepSpeed segments and multiprocessing semaphores (`sem.mp-*`: the queue a killed
    driver shared with its workers) that no live process maps (a killed run's); the ones removed."""
    segments = SHARED_MEMORY_DIRECTORY.glob(f"{DEEPSPEED_BUFFER_PREFIX}_{os.getuid()}_*")
    return remove_unheld(sorted([*segments, *own_entries(MULTIPROCESSING_SEMAPHORE_PATTERN)]))


def own_entries(pattern: str) -> list[Path]:
    """The /dev/shm entries matching `pattern` that this user owns."""
    owned = []
    for path in SHARED_MEMORY_DIRECTORY.glob(pattern):
        with contextlib.suppress(OSError):
            if path.lstat().st_uid == os.getuid():
                owned.append(path)
    return owned


def shared_memory_entries() -> dict[Path, tuple[int, int]]:
    """Every /dev/shm entry with its (device, inode)."""
    entries = {}
    for path in SHARED_MEMORY_DIRECTORY.iterdir():
        try:
            status = path.lstat()
        except OSError:
            continue
        entries[path] = (status.st_dev, status.st_ino)
    return entries


def held_inodes(pids: list[int] | None = None, directory: Path = SHARED_MEMORY_DIRECTORY) -> set[tuple[int, int]]:
    """(device, inode) of every file under `directory` the processes `pids` (None: every live process) map or hold
    open, whatever name they show: glibc makes a POSIX semaphore under a staging name (`sem.` and six random
    characters), maps it, then links it to its own name (`sem.mp-*`) and unlinks the staging one, so
    /proc/<pid>/maps names a deleted file for an entry that exists under another name."""
    inodes = set()
    prefix = f"{directory.resolve()}/"
    for pid in _all_pids() if pids is None else pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
            descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:  # the process ended, or is not ours to read
            continue
        for line in maps:
            # address, permissions, offset, device (major:minor in hex), inode, path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix):
                major, minor = (int(part, 16) for part in fields[3].split(":"))
                inodes.add((os.makedev(major, minor), int(fields[4])))
        for descriptor in descriptors:
            try:
                if os.readlink(descriptor).startswith(prefix):
                    status = os.stat(descriptor)
                    inodes.add((status.st_dev, status.st_ino))
            except OSError:
                continue
    return inodes


def _all_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
