"""The driver's step deadline: which worker has spent more than `workers.step_timeout_s` in one step.

A live but hung worker (stopped, deadlocked, stuck in I/O) never fails, so nothing else ends the
run: its peers wait for it at the rollout barrier and the driver waits for their reports.
Every rank sends a `WorkerProgress` as it enters each part of a step (tlt_cli/training/worker_loop.py); the
driver (driver.py) feeds them and the step reports to `StepDeadline` and asks `overrun()` while
it waits. The clock of a rank starts with its first progress of a step and stops with its
report of that step, so start-up (model loading, SGLang servers) never counts. Of the ranks past
the deadline, those that are working are named, not those waiting for them: the one line says
which rank is stuck, its process (and the state Linux reports for it, on this machine) and what
it was doing. Ranks that send no progress (TRL runs) are not watched. Only time the driver was
watching counts: it calls `watch()` once per wait for an event (at most EVENT_POLL_SECONDS), and a
longer gap (the driver itself paused: Ctrl-Z then fg, a scheduler's suspend, a debugger) moves
every clock on by the gap, so a pause of the driver never blames the workers that ran on.
"""

from __future__ import annotations

import socket
import time

from tlt_cli.process_status import stat_fields
from tlt_cli.processes.messages import WorkerProgress, WorkerStepReport

# the state letter of /proc/<pid>/stat, in words
PROCESS_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "waiting on I/O",
    "T": "stopped",
    "t": "stopped by a debugger",
    "Z": "a zombie",
}


class StepDeadline:
    """Each rank's current step, when it began and what the rank last said it does."""

    def __init__(self, timeout_seconds: float):
        """timeout_seconds: workers.step_timeout_s (0: no deadline, `overrun` is always None)."""
        self.timeout_seconds = timeout_seconds
        self.current: dict[int, tuple[WorkerProgress, float]] = {}
        self.last_watch = time.monotonic()

    def watch(self, longest_wait_seconds: float) -> None:
        """The driver is about to look at its events again; the time since its last look beyond
        `longest_wait_seconds` (its own pause) does not count against any rank."""
        now = time.monotonic()
        paused = now - self.last_watch - longest_wait_seconds
        self.last_watch = now
        if paused > 0:
            self.current = {worker: (event, started + paused) for worker, (event, started) in self.current.items()}

    def progress(self, event: WorkerProgress) -> None:
        """A rank entered a part of a step: its clock starts if the step is new to it."""
        previous = self.current.get(event.worker)
        started = previous[1] if previous is not None and previous[0].step == event.step else time.monotonic()
        self.current[event.worker] = (event, started)

    def reported(self, report: WorkerStepReport) -> None:
        """A rank finished its step: its clock stops until its next step begins."""
        self.current.pop(report.worker, None)

    def overrun(self) -> str | None:
        """One line naming the rank(s) past the deadline (working ones before waiting ones), or None."""
        if self.timeout_seconds <= 0:
            return None
        now = time.monotonic()
        late = [event for event, started in self.current.values() if now - started > self.timeout_seconds]
        if not late:
            return None
        working = [event for event in late if not event.waiting]
        stuck = sorted(working or late, key=lambda event: event.worker)
        waiting = sorted(event.worker for event in late if event.waiting and working)
        named = "; ".join(
            f"worker {event.worker} ({_process(event)}) has not finished step {event.step} within "
            f"workers.step_timeout_s={self.timeout_seconds:g} s: it is {event.activity}"
            for event in stuck
        )
        others = f"; worker(s) {', '.join(map(str, waiting))} wait for it" if waiting else ""
        return f"{named}{others}."


def _process(event: WorkerProgress) -> str:
    """`pid 123, stopped` (the state only for a process of this machine), `pid 123 on node-b` elsewhere."""
    if event.host != socket.gethostname():
        return f"pid {event.pid} on {event.host}"
    state = _process_state(event.pid)
    return f"pid {event.pid}, {state}" if state else f"pid {event.pid}"


def _process_state(pid: int) -> str | None:
    """What Linux says the process is doing (from /proc), or None where that cannot be read."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return PROCESS_STATES.get(fields[0], fields[0])
