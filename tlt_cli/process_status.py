"""What Linux says of a process of this machine, read from /proc/<pid>/stat.

`stat_fields(pid)` is the stat line's fields after the parenthesised command (which may itself hold spaces and
parentheses): state, ppid, process group, ..., start time (index 19, clock ticks since boot); None once the
process is gone or cannot be read. `process_running(pid)`: it exists and is not a zombie.
"""

from __future__ import annotations

from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command, state first; None if the process cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    return stat.rpartition(")")[2].split()


def process_running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, not yet reaped, has)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
