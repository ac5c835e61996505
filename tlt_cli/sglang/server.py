"""Start, watch and stop tlt's SGLang rollout servers, leaving no process behind.

`launch_sglang_servers(config, model_path, run_dir, plan, draft_model_path, seed)` starts one
`sglang.launch_server` per GPU (or per tp_size GPUs) on 127.0.0.1 with its own ports and a fresh
API key, writes each server's output to `<run_dir>/sglang/server-<i>.log`, and returns a started
`ServerGroup` once every server answers `/health`. A server that exits or stays unhealthy past
`startup_timeout_s` stops the whole group and raises `ServerStartError` with its log tail.
The key reaches the servers in `<run_dir>/sglang/api_key.yaml` (`--config`), never on a command
line; that folder is the user's alone (0700) and its files too (0600), since a server's log may
print its arguments, key included.

Every server runs in its own process group (a session), so `ServerGroup.stop` reaches the
scheduler and detokenizer processes SGLang forks: SIGTERM to the group, then SIGKILL after
`stop_timeout_s`. Stop runs on leaving the `with` block (Ctrl-C included), at interpreter exit
(atexit), on SIGTERM (turned into SystemExit while a group runs), and, on Linux, the server
leader gets SIGTERM if the thread that started it dies (PR_SET_PDEATHSIG): start servers from
the thread that lives for the whole run.

SGLang leaves files even after a clean stop (0.5.23: three socket files and two empty temporary
files, one `/dev/shm/sglang_loads_*.shm`, one `/dev/shm/sem.mp-*`). Each server therefore runs in a
temporary folder of its own (TMPDIR) whose record names the /dev/shm entries its processes hold
(tlt_cli/sglang/server_files.py); stop removes both. Files a killed run's servers left are removed
when the next group starts, or by the driver that outlives a killed worker (registry.py).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tlt_cli.sglang.adaptive import PlanMode, SGLangSpeculativePlan, write_adaptive_config
from tlt_cli.sglang.config import SGLangConfig
from tlt_cli.sglang.server_args import (
    SERVER_HOST,
    api_key_config,
    server_command,
    server_environment,
    server_placements,
    serves_on_cpu,
    speculative_flags,
)
from tlt_cli.sglang.server_files import (
    live_group_members,
    make_server_folder,
    record_leader,
    record_shared_memory,
    remove_abandoned_server_files,
    remove_server_files,
)
from tlt_cli.sglang.transport import ServerEndpoint, get_status

HEALTH_PATH = "/health"
HEALTH_POLL_S = 0.25
LOG_TAIL_LINES = 30
LOG_TAIL_BYTES = 64 * 1024
PR_SET_PDEATHSIG = 1
API_KEY_FILE = "api_key.yaml"
PRIVATE_FOLDER_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class ServerStartError(RuntimeError):
    """A rollout server could not be started; the message carries the tail of its log."""


@dataclass(frozen=True)
class ServerLaunch:
    """Everything needed to start one server process and reach it."""

    endpoint: ServerEndpoint
    command: tuple[str, ...]
    environment: dict[str, str]
    log_path: Path
    # ports the server binds; checked free before it starts
    ports: tuple[int, ...]


def private_folder(folder: Path) -> Path:
    """`folder`, created if needed, readable by this user alone (an existing one is narrowed to 0700)."""
    folder.mkdir(mode=PRIVATE_FOLDER_MODE, parents=True, exist_ok=True)
    folder.chmod(PRIVATE_FOLDER_MODE)
    return folder


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path` with mode 0600 from the start (never readable by others, not even briefly)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_FILE_MODE)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    path.chmod(PRIVATE_FILE_MODE)  # a file that existed keeps its mode through O_CREAT
    return path


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a server log ('' if it has none)."""
    if not log_path.is_file():
        return ""
    with open(log_path, "rb") as handle:
        handle.seek(max(0, log_path.stat().st_size - LOG_TAIL_BYTES))
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _shown_tail(launch: ServerLaunch) -> str:
    """The log tail for an error message, with the server's API key masked (SGLang logs its arguments)."""
    return log_tail(launch.log_path).replace(launch.endpoint.api_key, "<api-key>")


def _parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook that asks Linux to SIGTERM the child when the starting thread dies, or None."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    # resolved here, in the parent, so the child only makes the one call between fork and exec
    return functools.partial(prctl, PR_SET_PDEATHSIG, signal.SIGTERM)


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((SERVER_HOST, port))
        except OSError:
            return False
    return True


class ServerGroup:
    """Running rollout servers; use as a context manager or call `start()` and `stop()`."""

    def __init__(
        self,
        launches: Sequence[ServerLaunch],
        startup_timeout_s: float,
        stop_timeout_s: float,
        on_spawned: Callable[[list[int]], None] | None = None,
    ):
        self.launches = list(launches)
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        # told the servers' process groups once all are spawned, before the (long) wait for health
        self.on_spawned = on_spawned
        self.processes: list[subprocess.Popen] = []
        # each server's TMPDIR, whose record names what it holds in /dev/shm (server_files.py)
        self.temporary_folders: list[Path] = []
        self._previous_sigterm = None
        self._stopped = threading.Event()

    @property
    def endpoints(self) -> list[ServerEndpoint]:
        return [launch.endpoint for launch in self.launches]

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def __enter__(self) -> ServerGroup:
        return self.start() if not self.processes else self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> ServerGroup:
        """Spawn every server, then wait until all are healthy; stop all and raise on any failure."""
        self._check_ports_free()
        atexit.register(self.stop)
        self._install_sigterm_handler()
        remove_abandoned_server_files()
        try:
            for launch in self.launches:
                self.processes.append(self._spawn(launch))
            if self.on_spawned is not None:
                self.on_spawned(self.pids)
            self._wait_healthy()
            self._record_shared_memory()
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports_free(self) -> None:
        for launch in self.launches:
            for port in launch.ports:
                if not _port_is_free(port):
                    raise ServerStartError(
                        f"port {port} on {SERVER_HOST} (SGLang server {launch.endpoint.index}) is in use; "
                        "set rollout.sglang.port_base to a free range."
                    )

    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)

    def _spawn(self, launch: ServerLaunch) -> subprocess.Popen:
        private_folder(launch.log_path.parent)
        self.temporary_folders.append(make_server_folder(launch.endpoint.index))
        shown = " ".join(launch.command)
        with os.fdopen(
            os.open(launch.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, PRIVATE_FILE_MODE), "ab"
        ) as log:
            log.write(f"# tlt: starting SGLang server {launch.endpoint.index}: {shown}\n".encode())
            log.flush()
            process = subprocess.Popen(
                launch.command,
                env={**launch.environment, "TMPDIR": str(self.temporary_folders[-1])},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_parent_death_signal(),
            )
        record_leader(self.temporary_folders[-1], process.pid)
        return process

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = dict(zip(range(len(self.launches)), self.processes))
        while pending:
            for index, process in list(pending.items()):
                launch = self.launches[index]
                if process.poll() is not None:
                    raise ServerStartError(
                        f"SGLang server {index} exited with code {process.returncode} while starting; "
                        f"last lines of {launch.log_path}:\n{_shown_tail(launch)}"
                    )
                if get_status(launch.endpoint, HEALTH_PATH, timeout_s=2.0) == 200:
                    del pending[index]
            if pending and time.monotonic() > deadline:
                index = min(pending)
                raise ServerStartError(
                    f"SGLang server {index} did not answer {HEALTH_PATH} within {self.startup_timeout_s:.0f} s "
                    f"(rollout.sglang.startup_timeout_s); last lines of {self.launches[index].log_path}:\n"
                    f"{_shown_tail(self.launches[index])}"
                )
            if pending:
                # a worker killed while its servers start leaves what they held so far on record
                self._record_shared_memory()
                time.sleep(HEALTH_POLL_S)

    def _record_shared_memory(self) -> None:
        for folder, process in zip(self.temporary_folders, self.processes):
            record_shared_memory(folder, process.pid)

    def stop(self) -> None:
        """SIGTERM every server's process group, SIGKILL what remains after stop_timeout_s. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._record_shared_memory()
        groups = [process.pid for process in self.processes]
        for group in groups:
            self._signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and any(live_group_members(group) for group in groups):
            for process in self.processes:
                process.poll()
            time.sleep(0.05)
        for group in groups:
            self._signal_group(group, signal.SIGKILL)
        for process in self.processes:
            process.wait()
        self._remove_left_files()
        atexit.unregister(self.stop)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)

    def _remove_left_files(self) -> None:
        """Each server's temporary folder and the /dev/shm entries its record names (server_files.py)."""
        for folder in self.temporary_folders:
            remove_server_files(folder)

    @staticmethod
    def _signal_group(group: int, signum: int) -> None:
        try:
            os.killpg(group, signum)
        except ProcessLookupError:
            return


def launch_sglang_servers(
    config: SGLangConfig,
    model_path: str,
    run_dir: str | Path,
    plan: SGLangSpeculativePlan,
    draft_model_path: str | None,
    seed: int,
    on_spawned: Callable[[list[int]], None] | None = None,
) -> ServerGroup:
    """Start every server of `config` for `plan` and return the group once all are healthy.

    on_spawned, if given, gets the servers' process groups (= leader pids) as soon as all are spawned.
    """
    log_dir = private_folder(Path(run_dir) / "sglang")
    adaptive_path = (
        write_adaptive_config(plan, log_dir / "adaptive_speculative.json") if plan.mode is PlanMode.adaptive else None
    )
    flags = speculative_flags(plan, draft_model_path, adaptive_path)
    # hex: a URL-safe token may start with "-", which the server's argument parser reads as a flag
    api_key = secrets.token_hex(24)
    api_key_file = write_private(log_dir / API_KEY_FILE, api_key_config(api_key))
    launches = []
    for placement in server_placements(config):
        launches.append(
            ServerLaunch(
                endpoint=ServerEndpoint(index=placement.index, url=placement.url, api_key=api_key),
                command=tuple(server_command(config, placement, model_path, api_key_file, flags, seed)),
                environment=server_environment(placement, os.environ, serves_on_cpu(config.extra_args)),
                log_path=log_dir / f"server-{placement.index}.log",
                ports=(placement.port, placement.nccl_port),
            )
        )
    group = ServerGroup(launches, config.startup_timeout_s, config.stop_timeout_s, on_spawned)
    return group.start()
