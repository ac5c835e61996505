"""Process-group plumbing for worker processes: DeepSpeed init on CPU or GPU, and the rollout barrier.

`init_worker_process` is the first thing a worker does: on CPU (`actor.devices: cpu`) its rank
joins a gloo group; on GPUs it joins an NCCL group on `cuda:<local rank>`, the convention of the
DeepSpeed launcher. The driver starts its workers inside `visible_gpus(actor.devices)` (the
DeepSpeed launcher does the same from its `--include`), so every rank sees exactly the actor's
GPUs and local rank r of a node uses the r-th of them.
`RolloutBarrier` lets a worker that finished its rollout shard keep doing useful work (the idle
hook) while it waits for the others: it counts finished workers in a key-value store instead of
blocking in a collective.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed

POLL_SECONDS = 0.005
STORE_TIMEOUT = timedelta(minutes=30)


@dataclass(frozen=True)
class WorkerAddress:
    """Where a worker's process group meets: rank of world_size at master_port (store on port + 1).

    local_rank is the rank's index on its own node (the DeepSpeed launcher's LOCAL_RANK, which
    picks its GPU); None when every rank runs on one node, where it equals rank.
    """

    rank: int
    world_size: int
    master_port: int
    master_address: str = "127.0.0.1"
    local_rank: int | None = None

    @property
    def rank_on_node(self) -> int:
        """This rank's index on its node: LOCAL_RANK under the launcher, the rank itself otherwise."""
        return self.rank if self.local_rank is None else self.local_rank


def free_port() -> int:
    """A TCP port that is free now on loopback (with the next one, for the store)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
        with socket.socket() as second:
            try:
                second.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue
    raise RuntimeError("could not find two adjacent free TCP ports on 127.0.0.1.")


def import_deepspeed() -> ModuleType:
    """DeepSpeed, with its CPU accelerator chosen when there is no GPU (it reads DS_ACCELERATOR at import)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


@contextlib.contextmanager
def visible_gpus(gpus: Sequence[int]) -> Iterator[None]:
    """While open, processes started from here see only `gpus` (CUDA_VISIBLE_DEVICES); no-op for none."""
    if not gpus:
        yield
        return
    previous = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in gpus)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = previous


def init_worker_process(
    address: WorkerAddress, threads: int, extensions_dir: Path, on_gpus: bool = False
) -> torch.device:
    """Set the environment DeepSpeed reads, join the process group (gloo on CPU, NCCL on GPUs); the rank's device."""
    os.environ.update(
        RANK=str(address.rank),
        LOCAL_RANK=str(address.rank_on_node),
        WORLD_SIZE=str(address.world_size),
        MASTER_ADDR=address.master_address,
        MASTER_PORT=str(address.master_port),
        TORCH_EXTENSIONS_DIR=str(extensions_dir),
        # DeepSpeed picks its accelerator from this at import: a CPU actor stays on CPU on a GPU machine too
        DS_ACCELERATOR="cuda" if on_gpus else "cpu",
    )
    torch.set_num_threads(threads)
    device = torch.device("cuda", address.rank_on_node) if on_gpus else torch.device("cpu")
    if on_gpus:
        torch.cuda.set_device(device)
    import_deepspeed().init_distributed(dist_backend="nccl" if on_gpus else "gloo")
    return device


class RolloutBarrier:
    """Counts workers whose rollout shard is done, per step, without blocking the finished ones."""

    def __init__(self, address: WorkerAddress):
        self.world_size = address.world_size
        self.store = torch.distributed.TCPStore(
            address.master_address,
            address.master_port + 1,
            address.world_size,
            is_master=address.rank == 0,
            timeout=STORE_TIMEOUT,
        )

    def mark_done(self, step: int) -> None:
        self.store.add(f"rollout_done/{step}", 1)

    def all_done(self, step: int) -> bool:
        return self.store.add(f"rollout_done/{step}", 0) >= self.world_size

    def wait(self, step: int, while_idle: Callable[[Callable[[], bool]], None] | None = None) -> None:
        """Return once every worker is done with `step`'s rollout.

        while_idle, if given, is called repeatedly with a `rollout_over()` function it must poll
        between short units of work; it should return as soon as that function says True.
        """
        while not self.all_done(step):
            if while_idle is not None:
                while_idle(lambda: self.all_done(step))
            time.sleep(POLL_SECONDS)
