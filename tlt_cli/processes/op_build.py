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

The compiling itself (torch runs ninja, ninja its compilers, each in a process group of its own) happens in a child
process, `python -m tlt_cli.processes.op_build` (`build_in_own_group`), that is a subreaper (PR_SET_CHILD_SUBREAPER:
the compilers of a killed ninja become its children, not init's). It gets SIGTERM when the rank that builds dies
however it dies (PR_SET_PDEATHSIG), as when the rank is stopped; then, once torch's clean-up has killed ninja and
removed its lock, it kills every process left under it and reaps them. So no compiler outlives the build's rank
(they ran on for about 2 minutes after a killed driver, while the next run rebuilt into the same folder). An op
compiled already is loaded in the rank itself (a second; no child).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
# what the build's child process calls: DeepSpeed's shared-memory op build, as its process-group set-up calls it
SHARED_MEMORY_BUILD = "deepspeed.comm.torch:build_shm_op"
# the build's own temporary folder in TORCH_EXTENSIONS_DIR, the compilers' TMPDIR
BUILD_TEMPORARY_PREFIX = "tlt-op-build-tmp-"
# Linux's prctl options: the signal a process gets when the thread that started it ends; orphans of its descendants
# reparented to it
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
# how long a stopped build's processes have to end on SIGTERM (compilers removing their temporary files) before SIGKILL
STOP_GRACE_SECONDS = 2.0
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
    (deepspeed/comm/torch.py `build_shm_op`; nothing where the accelerator has none): compiled once per cache, in a
    process group of its own (`build_in_own_group`); loaded here when compiled already."""
    if not op_built(Path(os.environ["TORCH_EXTENSIONS_DIR"])):
        build_in_own_group(SHARED_MEMORY_BUILD)
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def build_in_own_group(build: str) -> None:
    """Call `build` ("module:function") in a child process (`main`) of a process group of its own (a Ctrl-C reaches it
    only through this rank), and wait for it; stopped here (KeyboardInterrupt), the child is told with SIGTERM and
    waited for: it stops every process under it. The compilers' temporary files go to a folder of the build's own
    (its TMPDIR, in TORCH_EXTENSIONS_DIR), removed when the build ends however it ends, by the child or here."""
    extensions_directory = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    extensions_directory.mkdir(parents=True, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=BUILD_TEMPORARY_PREFIX, dir=extensions_directory)
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "tlt_cli.processes.op_build", build, str(os.getpid()), temporary],
            env={**os.environ, "TMPDIR": temporary},
            start_new_session=True,
            preexec_fn=_parent_death_signal(),
        )
        try:
            returned = child.wait()
        except BaseException:
            child.terminate()
            child.wait()
            raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    if returned != 0:
        raise RuntimeError(f"DeepSpeed's op build ({build}) failed with exit status {returned}; its output is above.")


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to send the child SIGTERM when the thread that started it ends (None elsewhere),
    its prctl resolved here so the child makes one call between fork and exec."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def main() -> None:
    """The build's child: argv is the build ("module:function"), the pid of the rank that started it and the build's
    temporary folder (its TMPDIR, removed as it ends). A subreaper;
    stopped (SIGTERM, SIGINT), or finding that rank gone, it lets torch's clean-up kill ninja and remove its lock,
    then stops every process left under it (the compilers) and exits 130."""
    build, starter, temporary = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)
    try:
        with interrupted_once():
            if os.getppid() != starter:  # the rank died before the death signal was asked for
                raise KeyboardInterrupt
            module, _, function = build.partition(":")
            getattr(importlib.import_module(module), function)()
    except KeyboardInterrupt:
        stop_descendants()
        sys.exit(130)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)  # what a compiler stopped mid-file left there


def stop_descendants() -> None:
    """Stop every process under this one and reap them, until none is left: SIGTERM first (a compiler's driver then
    removes its temporary files), SIGKILL to those still there after STOP_GRACE_SECONDS. As a subreaper, the orphans
    of a killed process under it become its own children, which it reaps."""
    told: set[int] = set()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    while descendants := _descendants(os.getpid()):
        overdue = time.monotonic() > deadline
        for pid in descendants:
            if overdue or pid not in told:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if overdue else signal.SIGTERM)
                told.add(pid)
        if not _reaped_children():
            return
        time.sleep(BUILD_POLL_SECONDS / 10)


def _reaped_children() -> bool:
    """Reap this process's exited children; False when it has none left."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        return False
    return True


def _descendants(pid: int) -> list[int]:
    """The processes under `pid` (children of any of its threads, theirs, and so on), from /proc."""
    children = []
    for children_file in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in children_file.read_text().split()]
    return children + [grandchild for child in children for grandchild in _descendants(child)]


if __name__ == "__main__":
    main()


def remove_abandoned_build_locks(extensions_directory: Path) -> list[Path]:
    """Remove the torch build locks (`<op>/lock`) in TORCH_EXTENSIONS_DIR that no live process holds open (a
    killed build's, on which every later build would wait forever); the ones removed."""
    return remove_unheld(build_locks(extensions_directory), extensions_directory)


def build_locks(extensions_directory: Path) -> list[Path]:
    """The torch build locks (`<op>/lock`) in TORCH_EXTENSIONS_DIR, held or not (none when it does not exist)."""
    if not extensions_directory.is_dir():
        return []
    return sorted(extensions_directory.glob(f"**/{BUILD_LOCK_NAME}"))
