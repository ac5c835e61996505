"""Checks on processes a test started or expects gone, shared by the fault tests (test_faults_round6.py, round 7).

`outlived(pid, seconds)` waits until the process `pid` ends or `seconds` pass, SIGKILLs it if it still runs (so a
failing test leaves nothing behind), and says whether it was still running.
"""

from __future__ import annotations

import os
import signal
import time

from tlt_cli.process_status import process_running


def outlived(pid: int, seconds: float) -> bool:
    """Whether `pid` still ran after `seconds` (then it is killed)."""
    deadline = time.monotonic() + seconds
    while process_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = process_running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    return alive
