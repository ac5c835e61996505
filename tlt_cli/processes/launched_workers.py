"""The driver's side of a hostfile run: every rank started by the DeepSpeed launcher, events over TCP.

With `workers.hostfile`, `tlt train` stays the driver (live display, trace, checkpoint notes) and
`LaunchedWorkers` replaces the processes it would spawn:
1. it opens the event channel (event_channel.py) on 127.0.0.1 when the hostfile has one host,
   else on the one address of this machine that routes to the hostfile's nodes (never every
   interface), and announces that address; connections it drops go to the launcher's log;
2. writes the recipe and its plan for the ranks under `<run_dir>/launch/` (launch_files.py); with
   one host the plan names a private folder where the ranks meet (no TCP store, distributed.py);
3. runs the DeepSpeed launcher (the command of hostfile.py) in its own session, its
   output in `<run_dir>/workers/launcher.log` (each rank logs to `workers/worker-<rank>.log`).
The driver loop reads events with `next_event`, asks `failure` when none comes (has the launcher
exited before every rank finished?), and calls `stop` however the run ends: after a clean finish
it lets the launcher exit on its own; otherwise it sends the launcher's session SIGTERM (DeepSpeed
passes it on to its ranks, which stop their SGLang servers) and SIGKILL to what is left after a
grace period, and closes the channel, which ends any rank still running anywhere. Last, it removes
the DeepSpeed /dev/shm segments of a one-node launch that no rank could unlink (shared_memory.py).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import queue
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from tlt_cli.config import Recipe
from tlt_cli.errors import UserError
from tlt_cli.memory_hygiene import worker_environment
from tlt_cli.process_status import process_running
from tlt_cli.processes.distributed import free_port, private_rendezvous_directory
from tlt_cli.processes.event_channel import EventListener
from tlt_cli.processes.hostfile import LOCAL_ADDRESS, deepspeed_launch_command, read_hostfile, runs_on_this_machine
from tlt_cli.processes.launch_files import LaunchPlan, body_name, write_launch_files
from tlt_cli.processes.messages import RunSpec, WorkerBody, WorkerFinished, WorkerProgress
from tlt_cli.shared_memory import remove_unheld, run_buffers

LAUNCHER_LOG = "launcher.log"
# seconds the launcher gets to exit after every rank finished, and after SIGTERM
EXIT_GRACE_SECONDS = 30.0
# seconds to wait for a rank's last events after the launcher exited
LAST_EVENTS_SECONDS = 5.0
SESSION_POLL_SECONDS = 0.1
# a port for the route probe: connecting a UDP socket sends nothing, it only asks for the route
PROBE_PORT = 9
# seconds to wait for the launcher to log the exit code of a rank that died (it looks at its ranks every second)
EXIT_CODE_SECONDS = 3.0
# how DeepSpeed's per-node launcher (deepspeed/launcher/launch.py) logs the first of its ranks to end with an error
LAUNCHER_EXIT_CODE = re.compile(r"exits with return code = (-?\d+)")


class LaunchedWorkers:
    """The ranks of one DeepSpeed launch, as the driver sees them."""

    def __init__(self, run_spec: RunSpec, body: WorkerBody):
        """body: what each rank runs (a module-level function; the plan names it, launched_rank.py imports it),
        handed `run_spec.for_rank` of its place."""
        recipe, run_directory = run_spec.recipe, run_spec.run_directory
        self.size = recipe.workers.count
        self.finished: set[int] = set()
        # rank -> pid of the ranks on this machine, from their progress events
        self.local_pids: dict[int, int] = {}
        local = runs_on_this_machine(recipe)
        authkey = secrets.token_bytes(32)
        self.log_path = run_directory / "workers" / LAUNCHER_LOG
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        host = LOCAL_ADDRESS if local else address_towards(recipe)
        self.channel = EventListener(host, authkey, on_rejected=self._log)
        self.rendezvous = private_rendezvous_directory() if local else None
        plan = LaunchPlan(
            driver_host=host,
            driver_port=self.channel.port,
            authkey=authkey.hex(),
            worker_body=body_name(body),
            rendezvous_directory=str(self.rendezvous.resolve()) if self.rendezvous is not None else None,
        )
        write_launch_files(run_spec, plan)
        master_port = free_port()
        # a one-node job's DeepSpeed segments in /dev/shm, removed in `stop` if the ranks could not (shared_memory.py)
        self.shared_buffers = run_buffers(LOCAL_ADDRESS, master_port, self.size) if local else []
        command = deepspeed_launch_command(recipe, run_directory, master_port)
        with self.log_path.open("a", encoding="utf-8") as log:
            self.log_start = log.tell()  # a resumed run's log holds earlier launches too
            self.launcher = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # its ranks on this machine inherit the kernel caches' bounds (memory_hygiene.py)
                env={**os.environ, **worker_environment()},
            )

    def _log(self, line: str) -> None:
        with self.log_path.open("a", encoding="utf-8") as log:
            log.write(f"{line}\n")

    def next_event(self, timeout: float) -> Any:
        """The next rank event, or None after `timeout` seconds without one."""
        try:
            event = self.channel.get(timeout)
        except queue.Empty:
            return None
        if isinstance(event, WorkerFinished):
            self.finished.add(event.worker)
        if isinstance(event, WorkerProgress) and event.host == socket.gethostname():
            self.local_pids[event.worker] = event.pid
        return event

    def ended_without_report(self, accounted: set[int]) -> str | None:
        """The first rank of this machine not in `accounted` (finished, or failed and said so) whose process has
        ended, named with the signal that ended it when its parent, the per-node launcher, logged one; None if there
        is none."""
        for rank, pid in sorted(self.local_pids.items()):
            if rank not in accounted and not process_running(pid):
                code = self._launcher_exit_code(EXIT_CODE_SECONDS)
                if code is not None and code < 0:  # a signal: its peers raise, then exit 1
                    return (
                        f"worker {rank} (pid {pid}) was killed by {_signal_name(-code)} (code {code}) without "
                        f"reporting an error (out of memory, or killed?); see {self.log_path}."
                    )
                return (
                    f"worker {rank} (pid {pid}) ended without reporting an error (killed, or out of memory?); the "
                    f"DeepSpeed launcher logs its exit code in {self.log_path}."
                )
        return None

    def _launcher_exit_code(self, seconds: float) -> int | None:
        """The exit code this launch's launcher logged for the first rank that ended with an error, waiting up to
        `seconds` for it; None if it logged none."""
        deadline = time.monotonic() + seconds
        while True:
            with contextlib.suppress(OSError), self.log_path.open(encoding="utf-8", errors="replace") as log:
                log.seek(self.log_start)
                found = LAUNCHER_EXIT_CODE.search(log.read())
                if found:
                    return int(found.group(1))
            if time.monotonic() > deadline:
                return None
            time.sleep(SESSION_POLL_SECONDS)

    def failure(self, finished: set[int]) -> str | None:
        """Why the run cannot go on (the launcher exited with ranks unfinished), or None while it can."""
        code = self.launcher.poll()
        if code is None:
            return None
        self.channel.wait_for_senders(LAST_EVENTS_SECONDS)
        if self.channel.pending():
            return None  # the ranks' last events are still to be read
        missing = ", ".join(str(rank) for rank in range(self.size) if rank not in finished)
        return (
            f"the DeepSpeed launcher exited with code {code} before rank(s) {missing} finished (killed, or a "
            f"start-up error?); see {self.log_path} and the rank logs beside it."
        )

    def stop(self) -> None:
        """End the launch: let it exit on its own if every rank finished, else terminate it; close the channel."""
        if len(self.finished) < self.size or not _wait(self.launcher, EXIT_GRACE_SECONDS):
            _signal_session(self.launcher, signal.SIGTERM)
            _signal_session(self.launcher, signal.SIGCONT)  # a stopped rank (a step deadline's) acts on it now
            # ranks stop their SGLang servers on SIGTERM: give the whole session the grace, not just the launcher
            if not _session_ended(self.launcher, EXIT_GRACE_SECONDS):
                _signal_session(self.launcher, signal.SIGKILL)
            self.launcher.wait()
        self.channel.close()
        remove_unheld(self.shared_buffers)
        if self.rendezvous is not None:
            shutil.rmtree(self.rendezvous, ignore_errors=True)


def address_towards(recipe: Recipe) -> str:
    """This machine's address on the route to the hostfile's nodes: the event channel listens there only.

    The first host that is not this machine decides (a cluster's nodes share one network); if every
    host is this machine, loopback. UserError if no host's name resolves here.
    """
    resolved = False
    for host in read_hostfile(Path(recipe.workers.hostfile)):
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((host.name, PROBE_PORT))
                address = probe.getsockname()[0]
        except OSError:
            continue
        resolved = True
        if not ipaddress.ip_address(address).is_loopback:
            return address
    if resolved:
        return LOCAL_ADDRESS
    raise UserError(
        f"workers.hostfile: none of the hosts in {recipe.workers.hostfile} can be reached from this machine "
        "(their names do not resolve here); the driver must reach the nodes it launches on."
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _wait(process: subprocess.Popen, seconds: float) -> bool:
    """Whether `process` exited within `seconds`."""
    try:
        process.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _session_ended(process: subprocess.Popen, seconds: float) -> bool:
    """Whether every process of the launcher's session (the launcher reaped) was gone within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        process.poll()
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(SESSION_POLL_SECONDS)
    return False


def _signal_session(process: subprocess.Popen, signum: int) -> None:
    """Signal the process group the launcher leads (it started its own session), if any member is left."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return
