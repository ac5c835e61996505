"""The wait between data-parallel processes at the end of a rollout, made usable.

Under a wrapped trainer each process generates its own shard, then meets the others in the
trainer's next collective and waits there, idle, for the slowest. `wait_for_other_processes`
moves that wait into tlt's hands: it starts a non-blocking all-reduce on the default process
group (any backend: gloo on CPU, NCCL on GPUs), and until every process has joined it calls
`while_idle(rollout_over)` (the drafter sidecar's `on_worker_idle`), which runs short units of
work and returns as soon as `rollout_over()` says the others are done. Every process must call it
once per rollout, as it must any collective. Called by tlt_cli/integrations/trl.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed

# between polls while nothing is left to do in the wait
POLL_SECONDS = 0.002

IdleWork = Callable[[Callable[[], bool]], None]


def process_count() -> int:
    """Processes in the default group (1 when there is none)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1
    return torch.distributed.get_world_size()


def wait_for_other_processes(device: torch.device, while_idle: IdleWork | None = None) -> None:
    """Return once every process of the default group has called this; do idle work meanwhile."""
    if process_count() == 1:
        return
    arrived = torch.ones(1, device=device)
    # completes only when every process has contributed its 1: that is, has finished its shard
    work = torch.distributed.all_reduce(arrived, async_op=True)
    while not work.is_completed():
        if while_idle is not None:
            while_idle(work.is_completed)
        time.sleep(POLL_SECONDS)
    work.wait()
