"""What every worker process does first: die with `tlt train`, and write its output to its own log file.

Shared by the native GRPO worker (tlt_cli/training/worker_loop.py), the TRL process
(tlt_cli/integrations/trl_run.py) and `tlt bench update`'s measuring process (tlt_cli/bench/update_worker.py).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import threading
import time
from pathlib import Path


def exit_with_parent(rendezvous_directory: Path | None, parent: int | None = None) -> None:
    """A worker must not outlive `tlt train` (e.g. after SIGKILL of the driver); the first to notice removes the
    folder where the ranks met (the driver that would have is gone). The parent is the process that spawned this
    one (multiprocessing records its pid at the spawn; `parent` where the spawner passed its own pid along), so a
    worker whose driver died while it still imported (it is then init's child already) exits at once instead of
    watching init."""
    parent = driver_pid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        if rendezvous_directory is not None:
            shutil.rmtree(rendezvous_directory, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def driver_pid() -> int:
    """The pid of the process that started this one: multiprocessing's record of the spawning process, else (a
    rank the DeepSpeed launcher started) the current parent."""
    spawner = multiprocessing.parent_process()
    return spawner.pid if spawner is not None else os.getppid()


def redirect_output(log_path: Path) -> None:
    """Send this process's stdout/stderr (library chatter, warnings) to its log file, not the user's terminal."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("a", encoding="utf-8")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
