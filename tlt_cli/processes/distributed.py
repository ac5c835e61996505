"""Process-group plumbing for worker processes: DeepSpeed init on CPU or GPU, and the rollout barrier.

`init_worker_process` is the first thing a worker does: on CPU (`actor.devices: cpu`) its rank
joins a gloo group; on GPUs it joins an NCCL group on `cuda:<local rank>`, the convention of the
DeepSpeed launcher. The driver starts its workers inside `visible_gpus(actor.devices)` (the
DeepSpeed launcher does the same from its `--include`), so every rank sees exactly the actor's
GPUs and local rank r of a node uses the r-th of them. Before it joins, a rank builds DeepSpeed's CPU op under
tlt's build lock (op_build.py), so no rank waits for good on a build another run abandoned.
A rank whose DeepSpeed made a shared-memory all-reduce buffer (one node, under the launcher) unlinks
it once every rank has mapped it (shared_memory.py), so no way the run ends can leave it in /dev/shm;
where /dev/shm cannot be written, DeepSpeed makes none and all-reduces through the process group.
`RolloutBarrier` lets a worker that finished its rollout shard keep doing useful work (the idle
hook) while it waits for the others: it marks finished workers in a key-value store instead of
blocking in a collective, and gives up after a deadline, naming the workers it waited for.

Where the ranks meet: torch's TCPStore has no authentication and listens on every interface
whatever host it is given, so any peer that reaches the port could bump a barrier count or stall
it. A run on one node therefore opens no store port at all: its ranks meet in files
(`FileStore`) in a private folder (`rendezvous_directory`, mode 0700, on a local file system),
and gloo/NCCL bind their own sockets to the loopback interface. Ranks on several nodes must meet
over the network (TCP stores at the launcher's MASTER_ADDR): that keeps torch's unauthenticated
store, which is why a multi-node run belongs on a cluster network only its nodes reach.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed

from tlt_cli.memory_hygiene import worker_environment
from tlt_cli.process_status import process_running
from tlt_cli.processes.op_build import built_deepspeed_ops
from tlt_cli.shared_memory import deepspeed_buffers_if_writable, rank_buffer, release_own_buffer

POLL_SECONDS = 0.005
STORE_TIMEOUT = timedelta(minutes=30)
LOOPBACK_INTERFACE = "lo"
RENDEZVOUS_PREFIX = "tlt-rendezvous-"
PROCESS_GROUP_FILE = "process-group"
BARRIER_FILE = "rollout-barrier"
# the rollout barrier's deadline runs this much past workers.step_timeout_s: the driver, which sees
# every rank's progress, names the stuck rank first; the barrier is the backstop of a rank whose
# driver cannot judge (its events delayed), and must not race the driver to a vaguer message
BARRIER_GRACE_SECONDS = 30.0


class BarrierTimeout(RuntimeError):
    """Workers did not finish their rollout shard before the barrier's deadline; the message names them."""


@dataclass(frozen=True)
class WorkerAddress:
    """Where a worker's process group meets: rank of world_size at master_port (store on port + 1).

    local_rank is the rank's index on its own node (the DeepSpeed launcher's LOCAL_RANK, which
    picks its GPU); None when every rank runs on one node, where it equals rank.
    rendezvous_directory: every rank on one node: they meet in files there (a private folder made
    with `private_rendezvous_directory`, new for each start of the workers) and master_port is
    unused; None: they meet at master_address:master_port over TCP.
    """

    rank: int
    world_size: int
    master_port: int
    master_address: str = "127.0.0.1"
    local_rank: int | None = None
    rendezvous_directory: Path | None = None

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


def private_rendezvous_directory() -> Path:
    """A new, empty folder only this user can enter, where the ranks of one node meet (remove it when they end).

    In the system's temporary folder, not the run directory: a FileStore needs a local file
    system's locks (a run directory may be on a network mount), and a file left by a killed run
    would make the next rendezvous fail, so each start gets a folder of its own (mkdtemp: 0700).
    Its name carries the driver's pid: `remove_abandoned_rendezvous` finds the folders of killed drivers.
    """
    return Path(tempfile.mkdtemp(prefix=f"{RENDEZVOUS_PREFIX}{os.getpid()}-"))


def remove_abandoned_rendezvous() -> list[Path]:
    """Remove the rendezvous folders in the system's temporary folder whose driver is no longer running (a killed
    run's); the ones removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{RENDEZVOUS_PREFIX}*-*"):
        driver = folder.name.removeprefix(RENDEZVOUS_PREFIX).split("-", 1)[0]
        if driver.isdigit() and not process_running(int(driver)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def choose_deepspeed_accelerator() -> None:
    """DS_ACCELERATOR set to cpu where there is no GPU (unless set already), before anything imports DeepSpeed:
    transformers and accelerate import it at their own import, and it warns "Setting accelerator to CPU" when it
    has to guess."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def import_deepspeed() -> ModuleType:
    """DeepSpeed, with its CPU accelerator chosen when there is no GPU (it reads DS_ACCELERATOR at import)."""
    choose_deepspeed_accelerator()
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
    address: WorkerAddress,
    threads: int,
    extensions_dir: Path,
    on_gpus: bool = False,
    tell: Callable[[str], None] = print,
) -> torch.device:
    """Set the environment DeepSpeed reads, build its CPU op under tlt's build lock (op_build.py: `tell` hears whose
    build it waits for, then that it builds), join the process group (gloo on CPU, NCCL on GPUs); the rank's device."""
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
    # the kernel caches' bounds, read at torch's first bfloat16 product: a rank the DeepSpeed launcher started on
    # another node did not inherit them from tlt (memory_hygiene.py)
    os.environ.update(worker_environment())
    torch.set_num_threads(threads)
    device = torch.device("cuda", address.rank_on_node) if on_gpus else torch.device("cpu")
    if on_gpus:
        torch.cuda.set_device(device)
    built_deepspeed_ops(extensions_dir, tell)
    backend = "nccl" if on_gpus else "gloo"
    rendezvous = {} if address.rendezvous_directory is None else one_node_rendezvous(address)
    with deepspeed_buffers_if_writable():  # a read-only /dev/shm: no buffers, the process group all-reduces
        import_deepspeed().init_distributed(dist_backend=backend, **rendezvous)
    own_buffer = rank_buffer(os.environ)
    if own_buffer is not None and own_buffer.exists():
        torch.distributed.barrier()  # every rank has mapped every rank's segment once all are past their init
        release_own_buffer(os.environ)
    return device


def one_node_rendezvous(address: WorkerAddress) -> dict[str, Any]:
    """init_process_group's arguments for ranks meeting in address.rendezvous_directory (a file, no port).

    Also keeps gloo's and NCCL's own sockets on the loopback interface (a value the user set wins).
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    return dict(
        init_method=f"file://{address.rendezvous_directory / PROCESS_GROUP_FILE}",
        rank=address.rank,
        world_size=address.world_size,
    )


def barrier_timeout(step_timeout_seconds: float) -> float:
    """How long a finished rank waits at the rollout barrier for the others (0: no limit, as the step's)."""
    return step_timeout_seconds + BARRIER_GRACE_SECONDS if step_timeout_seconds > 0 else 0.0


class RolloutBarrier:
    """Marks, per step, the workers whose rollout shard is done, without blocking the finished ones.

    timeout_seconds: how long `wait` waits for the others before it raises BarrierTimeout (0: no
    limit). Each rank sets its own key, so a waiting rank knows which ranks it waits for.
    """

    def __init__(self, address: WorkerAddress, timeout_seconds: float = 0.0):
        self.rank, self.world_size = address.rank, address.world_size
        self.timeout_seconds = timeout_seconds
        self.store = _barrier_store(address)

    def mark_done(self, step: int) -> None:
        self.store.set(_done_key(step, self.rank), "1")

    def all_done(self, step: int) -> bool:
        return self.store.check([_done_key(step, rank) for rank in range(self.world_size)])

    def unfinished(self, step: int) -> list[int]:
        """The ranks that have not marked `step` done."""
        return [rank for rank in range(self.world_size) if not self.store.check([_done_key(step, rank)])]

    def wait(self, step: int, while_idle: Callable[[Callable[[], bool]], None] | None = None) -> None:
        """Return once every worker is done with `step`'s rollout; BarrierTimeout after timeout_seconds.

        while_idle, if given, is called repeatedly with a `rollout_over()` function it must poll
        between short units of work; it should return as soon as that function says True (it
        also says True once the deadline has passed).
        """
        deadline = time.monotonic() + self.timeout_seconds if self.timeout_seconds > 0 else math.inf

        def over() -> bool:
            return self.all_done(step) or time.monotonic() > deadline

        while not self.all_done(step):
            if time.monotonic() > deadline:
                waited_for = ", ".join(str(rank) for rank in self.unfinished(step))
                raise BarrierTimeout(
                    f"worker(s) {waited_for} did not finish the rollout of step {step} within "
                    f"{self.timeout_seconds:g} s of the others."
                )
            if while_idle is not None:
                while_idle(over)
            time.sleep(POLL_SECONDS)


def _done_key(step: int, rank: int) -> str:
    return f"rollout_done/{step}/{rank}"


def _barrier_store(address: WorkerAddress) -> torch.distributed.Store:
    """A file in the rendezvous folder on one node; else a TCP store at master_port + 1 (rank 0 serves it)."""
    if address.rendezvous_directory is not None:
        return torch.distributed.FileStore(str(address.rendezvous_directory / BARRIER_FILE), address.world_size)
    return torch.distributed.TCPStore(
        address.master_address,
        address.master_port + 1,
        address.world_size,
        is_master=address.rank == 0,
        timeout=STORE_TIMEOUT,
    )
