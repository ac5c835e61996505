"""Which SGLang server process groups a run started, written where the driver can reach them.

Each worker owns and stops its own servers (tlt_cli/sglang/rollout.py), but a worker can die
before it does (SIGKILL, out of memory). So, once its servers are up, a worker records their
process groups with `record_server_groups(run_directory, worker, groups)` in
`<run_directory>/sglang-servers/worker-<rank>.json`, and the driver calls
`stop_recorded_servers(run_directory)` when the run ends, however it ends: every recorded group
that still has a live process gets SIGTERM, then SIGKILL after the timeout, and the records go;
then the files of every server whose starter and processes are gone are removed (server_files.py:
what SGLang leaves in the temporary folder and /dev/shm, which the dead worker could not remove).
A record names each group's leader by its pid and its start time (a server is started as the
leader of its own group), and a group is signalled only while that very process leads it: a pid
reused since, a record written by hand or copied with a run directory, or one that cannot be read
is never signalled (a record that cannot be read is dropped).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from tlt_cli.sglang.server_files import live_group_members, process_start_ticks, remove_abandoned_server_files

REGISTRY_DIRECTORY = "sglang-servers"
POLL_SECONDS = 0.05


def record_server_groups(run_directory: Path, worker: int, process_groups: list[int]) -> Path:
    """Write worker `worker`'s server process groups (written whole, then renamed into place)."""
    directory = run_directory / REGISTRY_DIRECTORY
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"worker-{worker}.json"
    staging = path.with_suffix(".json.tmp")
    started = {str(group): process_start_ticks(group) for group in process_groups}
    record = {"worker": worker, "process_groups": process_groups, "started": started}
    staging.write_text(json.dumps(record), encoding="utf-8")
    staging.replace(path)
    return path


def recorded_server_groups(run_directory: Path) -> list[int]:
    """Every process group recorded for the run (empty when none was); a record that cannot be read names none."""
    return list(_recorded_starts(run_directory))


def stop_recorded_servers(run_directory: Path, timeout_s: float) -> list[int]:
    """Stop the recorded groups that still run under the leader the worker started (SIGTERM, SIGKILL after
    timeout_s), drop the records, remove the files of servers nothing runs any more; the groups stopped."""
    running = [
        group
        for group, started in _recorded_starts(run_directory).items()
        if started is not None and process_start_ticks(group) == started and live_group_members(group)
    ]
    for group in running:
        _signal_group(group, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(live_group_members(group) for group in running):
        time.sleep(POLL_SECONDS)
    for group in running:
        _signal_group(group, signal.SIGKILL)
    for path in (run_directory / REGISTRY_DIRECTORY).glob("worker-*.json"):
        path.unlink(missing_ok=True)
    remove_abandoned_server_files()
    return running


def _recorded_starts(run_directory: Path) -> dict[int, int | None]:
    """Each recorded group and its leader's recorded start (None: not recorded, the record is of another format)."""
    starts: dict[int, int | None] = {}
    for path in sorted((run_directory / REGISTRY_DIRECTORY).glob("worker-*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            started = record.get("started", {})
            starts.update({int(group): started.get(str(group)) for group in record["process_groups"]})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # unreadable or of another shape: it names no process tlt can vouch for
    return starts


def _signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        return
