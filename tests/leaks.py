"""What a test leaves behind: processes, /dev/shm segments, listening sockets, files in the system temporary folder.

tests/conftest.py's `no_leaks` fixture uses this around every fault test (tests/test_faults*.py) and
hostfile test: before the test, `LeakWatch.start` tags the environment with a mark of the test's own
(every process the test starts inherits it, however deep and wherever it is reparented), points the
system temporary folder (TMPDIR, `tempfile`) at an empty folder of the test's own, notes the test
process's listening sockets, and, while the test runs, notes every /dev/shm entry that the test's
processes map or hold open (sampled every SAMPLE_SECONDS: other test sessions on the machine make
and leave /dev/shm entries too, so only what the test's own processes held counts); after it,
`LeakWatch.leaks` lists
- every live process carrying the mark (after a grace for processes on their way out),
- every /dev/shm entry the test's processes held that still exists and no live process holds,
- every socket the test process listens on that it did not before,
- every file left in the test's temporary folder,
and `clean_up` removes them, so one leaking test does not spoil the next.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tlt_cli.shared_memory import held_inodes, shared_memory_entries

MARK_VARIABLE = "TLT_TEST_LEAK_MARK"
# seconds a tagged process still alive after the test gets to exit before it counts as left behind
EXIT_GRACE_SECONDS = 10.0
# seconds between two looks at what the test's processes hold in /dev/shm
SAMPLE_SECONDS = 0.5


@dataclass
class LeakWatch:
    """One test's watch: its mark, its temporary folder and what was there before it."""

    mark: str = field(default_factory=lambda: uuid.uuid4().hex)
    temporary_folder: Path | None = None
    sockets_before: set[tuple] = field(default_factory=set)
    # (device, inode) of the /dev/shm entries the test's processes were seen to map or hold open, whatever name
    # they showed (a semaphore shows its staging name, deleted, for the one it keeps)
    shared_memory_held: set[tuple[int, int]] = field(default_factory=set)
    sampling_over: threading.Event = field(default_factory=threading.Event)
    sampler: threading.Thread | None = None

    def start(self, temporary_folder: Path, monkeypatch) -> None:
        """Tag the environment, redirect the system temporary folder, note /dev/shm and the listening sockets."""
        self.temporary_folder = temporary_folder
        temporary_folder.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(MARK_VARIABLE, self.mark)
        monkeypatch.setenv("TMPDIR", str(temporary_folder))
        monkeypatch.setattr(tempfile, "tempdir", str(temporary_folder))
        self.sockets_before = listening_sockets()
        self.sampler = threading.Thread(target=self._sample_shared_memory, name="leak-watch", daemon=True)
        self.sampler.start()

    def _sample_shared_memory(self) -> None:
        while True:
            pids = [os.getpid(), *(process.pid for process in self._tagged_processes())]
            self.shared_memory_held.update(held_inodes(pids))
            if self.sampling_over.wait(SAMPLE_SECONDS):
                return

    def leaks(self) -> list[str]:
        """One line per thing the test left behind."""
        self.sampling_over.set()
        self.sampler.join()
        return [
            *(f"process {process.pid} ({' '.join(process.cmdline())[:200]})" for process in self.left_processes()),
            *(f"shared memory {path}" for path in self.left_shared_memory()),
            *(f"listening socket {address}" for address in sorted(listening_sockets() - self.sockets_before)),
            *(f"file {path}" for path in sorted(self.temporary_folder.iterdir())),
        ]

    def left_processes(self) -> list[psutil.Process]:
        """Live processes carrying this test's mark, once those on their way out have had EXIT_GRACE_SECONDS."""
        _, alive = psutil.wait_procs(self._tagged_processes(), timeout=EXIT_GRACE_SECONDS)
        return alive

    def _tagged_processes(self) -> list[psutil.Process]:
        return tagged_processes(self.mark)

    def left_shared_memory(self) -> list[Path]:
        """/dev/shm entries the test's processes held that still exist and that no live process maps or holds open."""
        existing = {path: inode for path, inode in shared_memory_entries().items() if inode in self.shared_memory_held}
        if not existing:
            return []
        held = held_inodes()
        return sorted(path for path, inode in existing.items() if inode not in held)

    def clean_up(self) -> None:
        """Kill the tagged processes, remove the unheld /dev/shm entries and empty the temporary folder."""
        for process in self._tagged_processes():
            process.kill()
        for path in self.left_shared_memory():
            path.unlink(missing_ok=True)
        for path in self.temporary_folder.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def tagged_processes(mark: str) -> list[psutil.Process]:
    """Live processes (zombies excluded) but this one whose environment has MARK_VARIABLE=mark: everything started
    under the mark, however deep and wherever it was reparented. A process that rewrites its title (setproctitle,
    as SGLang's scheduler and detokenizer do) hides its environment from /proc and is not found: the fault tests
    start none; the real-SGLang tests follow every descendant instead (tests/sglang_real.py RunWatch)."""
    found = []
    for process in psutil.process_iter():
        if process.pid == os.getpid():
            continue
        try:
            if process.environ().get(MARK_VARIABLE) == mark and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def listening_sockets() -> set[tuple]:
    """(family, address) of every socket the test process listens on (TCP, and Unix sockets with a name)."""
    listening = set()
    for connection in psutil.Process().net_connections(kind="all"):
        if connection.status == psutil.CONN_LISTEN or (connection.family.name == "AF_UNIX" and connection.laddr):
            listening.add((connection.family.name, connection.laddr))
    return listening
