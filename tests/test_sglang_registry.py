"""The driver's backstop: server process groups a worker recorded are stopped even if the worker died.

A real fake-server process (with a forked child in its group) is spawned in its own session, as
tlt's servers are, its group recorded, and the process that spawned it is then gone: only
`stop_recorded_servers` is left to stop it.
"""

from __future__ import annotations

import subprocess
import sys
import time

from sglang_fakes import API_KEY, FAKE_SERVER, free_port

from tlt_cli.process_status import process_running
from tlt_cli.sglang.registry import record_server_groups, recorded_server_groups, stop_recorded_servers
from tlt_cli.sglang.server import live_group_members


def spawn_orphan_server(log_path) -> int:
    """A fake server leading its own process group, with one child; its pid (= the group)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, str(FAKE_SERVER), "--port", str(free_port()), "--api-key", API_KEY, "--spawn-child"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 10
    while len(live_group_members(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(live_group_members(process.pid)) == 2, log_path.read_text()
    return process.pid


def test_recorded_groups_are_stopped_with_their_children_and_the_records_dropped(tmp_path):
    group = spawn_orphan_server(tmp_path / "server.log")
    record_server_groups(tmp_path, 1, [group])
    # a record of a server that already stopped (or never started) is harmless
    record_server_groups(tmp_path, 0, [2**22 + 7])
    assert sorted(recorded_server_groups(tmp_path)) == sorted([group, 2**22 + 7])
    assert stop_recorded_servers(tmp_path, timeout_s=5) == [group]
    assert live_group_members(group) == [] and not process_running(group)
    assert recorded_server_groups(tmp_path) == []


def test_nothing_recorded_is_nothing_to_stop(tmp_path):
    assert stop_recorded_servers(tmp_path, timeout_s=1) == []
