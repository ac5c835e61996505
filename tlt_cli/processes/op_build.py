"""DeepSpeed's CPU op build under a lock tlt owns, so no run waits for good on a build another run abandoned.

torch's extension builder (torch/utils/cpp_extension.py `_jit_compile`) marks a build with a file, `<op>/lock`
(torch/utils/file_baton.py), that every other process waits on with no limit until it is gone; a builder killed
mid-build (kill -9, or the driver's SIGTERM after a Ctrl-C) leaves it. So every rank (init_worker_process in
distributed.py, `tlt bench update`'s measuring process) builds DeepSpeed's op first, with `built_deepspeed_ops`:
while it holds an `fcntl.flock` on `torch_extensions/tlt-op-build.lock`, which the kernel releases when its holder
dies however it dies. The next holder removes a torch lock no live process holds open, then builds (or finds the
build done, in a second), and DeepSpeed's own build in its process-group set-up finds it done. A rank that waits
for the lock says once whose build it waits for, and then that it builds (`tell`), and gives up after `seconds`
with one sentence. While
it builds, the first SIGINT or SIGTERM raises KeyboardInterrupt and later ones are ignored, so torch's clean-up
removes its lock before the process ends. The driver, before any worker starts, removes torch locks a killed run
left (`remove_abandoned_build_locks`, with a line each).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tlt_cli.errors import UserError
from tlt_cli.shared_memory import remove_unheld

# where workers build DeepSpeed's CPU ops, under the model cache (TORCH_EXTENSIONS_DIR: distributed.py)
EXTENSIONS_FOLDER = "torch_extensions"
# the op DeepSpeed's CPU process group builds (deepspeed/ops/op_builder/cpu/comm.py ShareMemCommBuilder.NAME): torch
# writes it as `<TORCH_EXTENSIONS_DIR>/<name>/<name>.so`
SHARED_MEMORY_OP = "deepspeed_shm_comm"
# the file torch's extension builder holds in an op's build folder while it builds
BUILD_LOCK_NAME = "lock"
# the file tlt's builders flock in TORCH_EXTENSIONS_DIR while they build; it holds the holder's pid
OP_BUILD_LOCK = "tlt-op-build.lock"
# the longest a rank waits for another process's build (it takes about 2 minutes on 2 loaded cores)
BUILD_WAIT_SECONDS = 1800.0
BUILD_POLL_SECONDS = 0.5


class OpBuildTimeout(UserError):
    """Another process held the op build lock for longer than a rank waits for it."""


def built_deepspeed_ops(
    extensions_directory: Path, tell: Callable[[str], None], seconds: float = BUILD_WAIT_SECONDS
) -> None:
    """DeepSpeed's CPU op built in `extensions_directory` (TORCH_EXTENSIONS_DIR, set before), under tlt's build
    lock: a lock another process holds is waited for at most `seconds`; `tell` hears of the wait, then the build."""
    with op_build_lock(extensions_directory, tell, seconds):
        if not op_built(extensions_directory):
            tell("building DeepSpeed's CPU op (minutes, once per cache)")
        remove_abandoned_build_locks(extensions_directory)  # none can be live: every builder holds tlt's lock
        with interrupted_once():
            build_shared_memory_op()


def op_built(extensions_directory: Path) -> bool:
    """Whether DeepSpeed's CPU op is compiled in `extensions_directory` (its .so there: torch then loads it in a
    second, and nothing says it builds)."""
    return (extensions_directory / SHARED_MEMORY_OP / f"{SHARED_MEMORY_OP}.so").is_file()


@contextlib.contextmanager
def op_build_lock(extensions_directory: Path, on_wait: Callable[[str], None], seconds: float) -> Iterator[None]:
    """Hold the flock on `extensions_directory`/OP_BUILD_LOCK (made if missing, never through a symbolic link) for
    the block, its file holding this pid; OpBuildTimeout naming the holder when another holds it for `seconds`."""
    extensions_directory.mkdir(parents=True, exist_ok=True)
    path = extensions_directory / OP_BUILD_LOCK
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        wait_for_lock(descriptor, path, on_wait, seconds)
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(descriptor)  # the flock goes with it


def wait_for_lock(descriptor: int, path: Path, on_wait: Callable[[str], None], seconds: float) -> None:
    """Take the flock on `descriptor` (the lock file `path`), waiting for its holder at most `seconds`."""
    deadline = time.monotonic() + seconds
    announced = False
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = lock_holder(descriptor)
        if time.monotonic() >= deadline:
            raise OpBuildTimeout(
                f"the DeepSpeed op build in {path.parent} is still held by {holder} after {seconds:g} s; let that "
                "build end (or stop the run that builds), then run again."
            )
        if not announced:
            on_wait(f"waiting for the DeepSpeed op build held by {holder} (at most {seconds:g} s)")
            announced = True
        time.sleep(BUILD_POLL_SECONDS)


def lock_holder(descriptor: int) -> str:
    """`pid 123`, the holder the lock file names, or `another process` while it names none yet."""
    written = os.pread(descriptor, 32, 0).decode(errors="replace").strip()
    return f"pid {written}" if written.isdigit() else "another process"


@contextlib.contextmanager
def interrupted_once() -> Iterator[None]:
    """For the block, the first SIGINT or SIGTERM raises KeyboardInterrupt and the later ones are ignored, so the
    clean-up the exception runs (torch's removal of its build lock) is not cut short; the old handlers after."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}

    def interrupt(number: int, frame: object) -> None:
        for each in previous:
            signal.signal(each, signal.SIG_IGN)
        raise KeyboardInterrupt(f"stopped by {signal.Signals(number).name} while building DeepSpeed's op")

    for number in previous:
        signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def build_shared_memory_op() -> None:
    """DeepSpeed's shared-memory all-reduce op, built as its process-group set-up builds it first
    (deepspeed/comm/torch.py `build_shm_op`; nothing where the accelerator has none): compiled once per cache."""
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def remove_abandoned_build_locks(extensions_directory: Path) -> list[Path]:
    """Remove the torch build locks (`<op>/lock`) in TORCH_EXTENSIONS_DIR that no live process holds open (a
    killed build's, on which every later build would wait forever); the ones removed."""
    return remove_unheld(build_locks(extensions_directory), extensions_directory)


def build_locks(extensions_directory: Path) -> list[Path]:
    """The torch build locks (`<op>/lock`) in TORCH_EXTENSIONS_DIR, held or not (none when it does not exist)."""
    if not extensions_directory.is_dir():
        return []
    return sorted(extensions_directory.glob(f"**/{BUILD_LOCK_NAME}"))
