"""Workers on the driver's own machine: one spawned process per rank, events on a multiprocessing queue.

The default of `tlt train` (no `workers.hostfile`). `LocalWorkers` starts the worker body it is
given (the trainer's, chosen by tlt_cli/trainers.py) in `workers.count` processes (with
only the actor's GPUs visible, and tlt_cli/memory_hygiene.py's bounds on the kernel caches) and offers
the driver loop (driver.py) the same three calls as a DeepSpeed launch (launched_workers.py):
`next_event`, `failure` when none comes (a worker died without reporting) and `stop`.
The workers meet in a private folder of their own (distributed.py `private_rendezvous_directory`):
no rank opens a TCP store, and gloo binds to loopback.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
from collections.abc import Sequence
from typing import Any

from tlt_cli.memory_hygiene import worker_memory_settings
from tlt_cli.processes.distributed import WorkerAddress, private_rendezvous_directory, visible_gpus
from tlt_cli.processes.messages import RunSpec, WorkerBody

# seconds a terminated worker gets to exit before it is killed
STOP_SECONDS = 10


class LocalWorkers:
    """workers.count processes of this machine, rank r the r-th."""

    def __init__(self, run_spec: RunSpec, world_size: int, gpus: Sequence[int], body: WorkerBody):
        """body: each process's body (a module-level function, so a spawned process can import it), handed
        `run_spec.for_rank` of its rank."""
        context = multiprocessing.get_context("spawn")
        self.size = world_size
        self.events = context.Queue()
        self.rendezvous = private_rendezvous_directory()
        self.processes = [
            context.Process(
                target=body,
                args=(run_spec.for_rank(self._address(rank)), self.events),
                name=f"tlt-worker-{rank}",
            )
            for rank in range(world_size)
        ]
        # the kernel caches' bounds are read when torch first uses them: in the environment the workers start with
        with visible_gpus(gpus), worker_memory_settings():
            for process in self.processes:
                process.start()

    def _address(self, rank: int) -> WorkerAddress:
        """Rank `rank` of this machine's workers, meeting in the private rendezvous folder (no port)."""
        return WorkerAddress(rank, self.size, master_port=0, rendezvous_directory=self.rendezvous)

    def next_event(self, timeout: float) -> Any:
        """The next worker event, or None after `timeout` seconds without one."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def failure(self, finished: set[int]) -> str | None:
        """A worker that is gone without finishing, or None while all are alive or done."""
        return self.ended_without_report(finished)

    def ended_without_report(self, accounted: set[int]) -> str | None:
        """The first worker not in `accounted` (finished, or failed and said so) whose process has ended, named with
        how it ended (the signal that killed it); None if there is none."""
        finished = accounted
        for rank, process in enumerate(self.processes):
            if rank not in finished and not process.is_alive():
                return f"worker {rank} {_how_it_ended(process.exitcode)}"
        return None

    def stop(self) -> None:
        """Terminate the workers still alive (a stopped one is continued so it can), kill those that linger."""
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                _continue(process.pid)
        for process in self.processes:
            process.join(timeout=STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(self.rendezvous, ignore_errors=True)


def _how_it_ended(exit_code: int) -> str:
    """How a worker that reported nothing ended, from its exit code (negative: the signal that killed it)."""
    if exit_code < 0:
        name = signal.Signals(-exit_code).name
        return f"was killed by {name} (code {exit_code}) without reporting an error (out of memory, or killed?)."
    return f"exited with code {exit_code} without reporting an error (killed, or out of memory?)."


def _continue(pid: int) -> None:
    """SIGCONT: a SIGSTOPped worker (often the one a step deadline named) acts on its SIGTERM now."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
