"""Workers on the driver's own machine: one spawned process per rank, events on a multiprocessing queue.

The default of `tlt train` (no `workers.hostfile`). `LocalWorkers` starts `worker_main` in
`workers.count` processes (with only the actor's GPUs visible) and offers the driver loop
(driver.py) the same three calls as a DeepSpeed launch (launched_workers.py):
`next_event`, `failure` when none comes (a worker died without reporting) and `stop`.
"""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable, Sequence
from typing import Any

from tlt_cli.processes.distributed import WorkerAddress, free_port, visible_gpus
from tlt_cli.worker import WorkerSpec, worker_main

# seconds a terminated worker gets to exit before it is killed
STOP_SECONDS = 10


class LocalWorkers:
    """workers.count processes of this machine, rank r the r-th."""

    def __init__(
        self,
        spec_base: dict[str, Any],
        world_size: int,
        gpus: Sequence[int],
        target: Callable[[WorkerSpec, Any], None] = worker_main,
    ):
        """target: each process's body (worker_main; a TRL run's tlt_cli/integrations/trl_run.py:trl_worker_main)."""
        context = multiprocessing.get_context("spawn")
        self.size = world_size
        self.events = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(
                target=target,
                args=(WorkerSpec(address=WorkerAddress(rank, world_size, port), **spec_base), self.events),
                name=f"tlt-worker-{rank}",
            )
            for rank in range(world_size)
        ]
        with visible_gpus(gpus):
            for process in self.processes:
                process.start()

    def next_event(self, timeout: float) -> Any:
        """The next worker event, or None after `timeout` seconds without one."""
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            return None

    def failure(self, finished: set[int]) -> str | None:
        """A worker that is gone without finishing, or None while all are alive or done."""
        for rank, process in enumerate(self.processes):
            if rank not in finished and not process.is_alive():
                return (
                    f"worker {rank} exited with code {process.exitcode} without reporting an error "
                    "(killed, or out of memory?)."
                )
        return None

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(timeout=STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
