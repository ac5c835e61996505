"""Helpers of the tests against the real SGLang 0.5.23 (marker `real_sglang`): where its side environment is,
the skip when it is missing, a server on SGLang's CPU platform started through tlt's own launcher, and a watch
of what a server's processes hold in /dev/shm (to check that nothing of it is left once they are gone).

The side environment is built by scripts/build_sglang_cpu_env.py; the tests find its interpreter in
$TLT_SGLANG_CPU_PYTHON, else at the script's default path ($TLT_CACHE_DIR/sglang-cpu-env, read when this
module is imported, before the tests point TLT_CACHE_DIR at their own cache).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from sglang_fakes import free_port_range

from tlt_cli.config import SGLangConfig
from tlt_cli.sglang.adaptive import PlanMode, SGLangSpeculativePlan
from tlt_cli.sglang.server import ServerGroup, launch_sglang_servers
from tlt_cli.sglang.server_args import CPU_SERVER_ARGS
from tlt_cli.shared_memory import held_inodes, shared_memory_entries

SIDE_PYTHON = Path(
    os.environ.get(
        "TLT_SGLANG_CPU_PYTHON",
        Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt")) / "sglang-cpu-env" / "bin" / "python",
    )
)
# seconds between two looks at what the watched processes hold in /dev/shm
SAMPLE_SECONDS = 0.5
SHIPPED_TINY_MODEL = Path(__file__).resolve().parent.parent / "tlt_cli" / "models" / "tiny_arith"
# a KV pool of a few thousand tokens: SGLang on CPU otherwise sizes it from the machine's whole memory
CPU_TEST_ARGS = (*CPU_SERVER_ARGS, "--max-total-tokens", "4096", "--log-level", "info")

requires_real_sglang = pytest.mark.skipif(
    not SIDE_PYTHON.exists(),
    reason=f"no SGLang CPU environment at {SIDE_PYTHON}: build it with scripts/build_sglang_cpu_env.py "
    "(or set TLT_SGLANG_CPU_PYTHON)",
)


def real_sglang_overrides(port_base: int) -> list[str]:
    """`tlt train` overrides that run the SGLang backend on one real CPU server of the side environment."""
    extra = ",".join(f'"{argument}"' for argument in CPU_TEST_ARGS)
    return [
        "rollout.backend=sglang",
        "rollout.sglang.gpus=[0]",
        "rollout.sglang.colocated=false",
        "rollout.sglang.dtype=float32",
        f"rollout.sglang.python={SIDE_PYTHON}",
        f"rollout.sglang.port_base={port_base}",
        "rollout.sglang.startup_timeout_s=300",
        "rollout.sglang.stop_timeout_s=10",
        f"rollout.sglang.extra_args=[{extra}]",
    ]


def copy_tiny_model(destination: Path) -> Path:
    """The shipped tiny Qwen2 (8 layers, hidden 256, vocabulary 66, tokenizer included) in a folder of its own."""
    shutil.copytree(SHIPPED_TINY_MODEL, destination)
    return destination


def start_cpu_server(model_dir: Path, run_dir: Path, skip_tokenizer_init: bool = False) -> ServerGroup:
    """One real SGLang server on CPU for `model_dir`, started (and later stopped) by tlt's launcher."""
    config = SGLangConfig(
        gpus=(0,),
        port_base=free_port_range(2),
        startup_timeout_s=300.0,
        stop_timeout_s=10.0,
        dtype="float32",
        python=str(SIDE_PYTHON),
        skip_tokenizer_init=skip_tokenizer_init,
        max_running_requests=16,
        extra_args=CPU_TEST_ARGS,
    )
    plan = SGLangSpeculativePlan(mode=PlanMode.off, launch=None, slots=(), differences=())
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return launch_sglang_servers(config, str(model_dir), run_dir, plan, None, seed=0)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous


class RunWatch:
    """The processes of a run and the /dev/shm entries they hold, looked at every SAMPLE_SECONDS from `with` to its
    end; afterwards `survivors()` lists those processes still running and `left_shared_memory()` those entries still
    there as the same file (same inode).

    A run's processes are `roots()` and every descendant of one, remembered once seen (by pid and start time, so a
    reused pid is not taken for them). Descendants, because SGLang's scheduler and detokenizer carry neither the
    server's port on their command line nor a mark in their environment that /proc shows: they set their process
    title (setproctitle), which overwrites the environment /proc/<pid>/environ reads.

        with RunWatch(lambda: [psutil.Process(leader)]) as watch:
            ...  # the server runs, then stops
        assert not watch.survivors() and sglang_shared_memory(watch.seen_names()) and not watch.left_shared_memory()
    """

    def __init__(self, roots: Callable[[], list[psutil.Process]]):
        self.roots = roots
        self.processes: dict[tuple[int, float], psutil.Process] = {}
        # each process's name as last seen (a process that has exited has none to read; SGLang's children take
        # theirs, sglang::scheduler and sglang::detokenizer, a moment after they start)
        self.names: dict[tuple[int, float], str] = {}
        self.shared_memory: dict[tuple[int, int], Path] = {}
        self._over = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="run-watch", daemon=True)

    def __enter__(self) -> RunWatch:
        self._sampler.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._over.set()
        self._sampler.join()

    def look(self) -> None:
        """Note the run's processes now, and the /dev/shm entries they hold."""
        for root in self._roots():
            try:
                for process in [root, *root.children(recursive=True)]:
                    self._remember(process)
            except psutil.Error:
                continue
        held = held_inodes([process.pid for process in self.processes.values() if process.is_running()])
        for path, inode in shared_memory_entries().items():
            if inode in held:
                self.shared_memory[inode] = path

    def _remember(self, process: psutil.Process) -> None:
        try:
            key = (process.pid, process.create_time())
            self.names[key] = process.name()
            self.processes.setdefault(key, process)
        except psutil.Error:  # gone meanwhile
            return

    def _roots(self) -> list[psutil.Process]:
        try:
            return self.roots()
        except psutil.Error:  # the root is gone
            return []

    def _sample(self) -> None:
        while True:
            self.look()
            if self._over.wait(SAMPLE_SECONDS):
                return

    def survivors(self, grace_seconds: float = 10.0) -> list[str]:
        """'pid name' of each process of the run still running once those on their way out had `grace_seconds`."""
        running = [process for process in self.processes.values() if process.is_running()]
        _, alive = psutil.wait_procs(running, timeout=grace_seconds)
        described = []
        for process in alive:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    described.append(f"{process.pid} {process.name()}")
            except psutil.Error:
                continue
        return described

    def process_names(self) -> list[str]:
        return sorted(set(self.names.values()))

    def seen_names(self) -> list[str]:
        return sorted(path.name for path in self.shared_memory.values())

    def left_shared_memory(self) -> list[Path]:
        now = shared_memory_entries()
        return sorted(path for inode, path in self.shared_memory.items() if now.get(path) == inode)


def sglang_shared_memory(names: list[str]) -> bool:
    """Whether `names` hold what every SGLang 0.5.23 server makes: its load snapshot and a semaphore (a watch that
    sees neither could not tell a leak)."""
    return any(name.startswith("sglang_loads_") for name in names) and any(name.startswith("sem.mp-") for name in names)


def sglang_processes(names: list[str]) -> bool:
    """Whether `names` hold SGLang's scheduler and detokenizer (a watch that saw neither could not tell a survivor).
    Linux keeps 15 characters of a process name: `sglang::schedul`, unless psutil read the whole title."""
    return all(any(name.startswith(prefix) for name in names) for prefix in ("sglang::schedul", "sglang::detoken"))
