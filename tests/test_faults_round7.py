"""Faults of round 7 (issue 65) that need real processes: `tlt bench update`'s measuring process exits with the
bench when the bench is killed, as `tlt train`'s workers do."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from tlt_cli.process_status import process_running

# the bench's own way of starting a measurement (bench/update.py), in a process the test can kill
BENCH = """
from tlt_cli.bench.update import UpdateSettings, measure_in_fresh_process

measure_in_fresh_process("tiny-cpu", [], UpdateSettings())
"""


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def test_the_measuring_process_exits_with_a_killed_bench(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent(BENCH))
    environment = {**os.environ, "TLT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    bench = subprocess.Popen([sys.executable, str(script)], env=environment)
    deadline = time.monotonic() + 60
    while not children(bench.pid) and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    (measuring,) = children(bench.pid)
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    # it may still import torch when the bench dies: it exits as its imports end and it first looks
    deadline = time.monotonic() + 30
    while process_running(measuring) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = process_running(measuring)
    if alive:
        os.kill(measuring, signal.SIGKILL)
    assert not alive, "the measuring process outlived the killed bench by 30 s"
