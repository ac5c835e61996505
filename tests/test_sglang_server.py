"""Server lifecycle with real processes: a fake SGLang server (tests/sglang_fake_server.py) is
started, health-checked, crashed, hung, interrupted and stopped; no process may outlive a stop."""

from __future__ import annotations

import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console
from sglang_fakes import FAKE_SERVER, fake_launch, free_port, wait_for_first_generation

from tlt_cli.process_status import process_running
from tlt_cli.processes import run_preparation
from tlt_cli.sglang.registry import stop_recorded_servers
from tlt_cli.sglang.server import ServerGroup, ServerStartError, live_group_members, log_tail
from tlt_cli.sglang.transport import get_status


def child_pid(log_path: Path) -> int:
    """The pid the fake server logged for its forked child."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        match = re.search(r"child pid (\d+)", log_path.read_text() if log_path.exists() else "")
        if match:
            return int(match.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no child pid in {log_path}")


def test_start_waits_for_health_and_stop_leaves_no_process(tmp_path):
    launch = fake_launch(0, tmp_path, "--spawn-child")
    group = ServerGroup([launch], startup_timeout_s=20, stop_timeout_s=5).start()
    server_pid = group.pids[0]
    grandchild = child_pid(launch.log_path)
    assert get_status(launch.endpoint, "/health", timeout_s=2) == 200
    assert process_running(server_pid) and process_running(grandchild)
    group.stop()
    assert not process_running(server_pid)
    assert not process_running(grandchild), "the server's own child outlived the stop"
    assert live_group_members(server_pid) == []
    assert get_status(launch.endpoint, "/health", timeout_s=1) is None


def test_slow_start_is_waited_for(tmp_path):
    launch = fake_launch(0, tmp_path, "--mode", "slow", "--startup-delay", "1.0")
    with ServerGroup([launch], startup_timeout_s=20, stop_timeout_s=5) as group:
        assert get_status(launch.endpoint, "/health", timeout_s=2) == 200
        pid = group.pids[0]
    assert not process_running(pid)


def test_health_timeout_names_the_server_and_shows_its_log(tmp_path):
    launch = fake_launch(0, tmp_path, "--mode", "hang")
    group = ServerGroup([launch], startup_timeout_s=1.5, stop_timeout_s=5)
    with pytest.raises(ServerStartError) as raised:
        group.start()
    message = str(raised.value)
    assert "did not answer /health within 2 s" in message
    assert "rollout.sglang.startup_timeout_s" in message
    assert "pid starting in mode hang" in message
    assert not process_running(group.pids[0])


def test_crash_during_startup_raises_with_log_tail_and_stops_the_others(tmp_path):
    healthy = fake_launch(0, tmp_path, "--spawn-child")
    crashing = fake_launch(1, tmp_path, "--mode", "crash")
    group = ServerGroup([healthy, crashing], startup_timeout_s=20, stop_timeout_s=5)
    with pytest.raises(ServerStartError) as raised:
        group.start()
    message = str(raised.value)
    assert message.startswith("SGLang server 1 exited with code 1 while starting")
    assert "CUDA out of memory (fake crash for the tests)" in message
    grandchild = child_pid(healthy.log_path)
    assert all(not process_running(pid) for pid in [*group.pids, grandchild])


def test_port_in_use_is_refused_before_anything_starts(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        group = ServerGroup([fake_launch(0, tmp_path, port=port)], startup_timeout_s=5, stop_timeout_s=5)
        with pytest.raises(
            ServerStartError, match=f"port {port} on 127.0.0.1 .* is in use; set rollout.sglang.port_base"
        ):
            group.start()
    assert group.pids == []


def test_the_api_key_is_on_no_command_line_and_logs_and_key_file_are_private(tmp_path):
    launch = fake_launch(0, tmp_path / "sglang")
    with ServerGroup([launch], startup_timeout_s=20, stop_timeout_s=5) as group:
        command_line = Path(f"/proc/{group.pids[0]}/cmdline").read_bytes().decode()
    key = launch.endpoint.api_key
    assert key not in command_line and "--config" in command_line  # what `ps` shows every local user
    header = launch.log_path.read_text().splitlines()[0]
    assert header.startswith("# tlt: starting SGLang server 0:") and key not in header
    assert "listening on 127.0.0.1" in log_tail(launch.log_path)
    key_file = Path(command_line.split("\0")[command_line.split("\0").index("--config") + 1])
    assert (tmp_path / "sglang").stat().st_mode & 0o777 == 0o700
    assert launch.log_path.stat().st_mode & 0o777 == 0o600 and key_file.stat().st_mode & 0o777 == 0o600


def test_a_stopped_server_leaves_no_file_in_shared_memory_or_the_temporary_folder(tmp_path):
    """The fake leaves what SGLang 0.5.23 leaves after a clean stop (/dev/shm entries, socket and empty files in its
    temporary folder); stop removes every one, and an entry a live process holds stays."""
    held = Path(f"/dev/shm/sem.mp-held-by-the-test-{tmp_path.name}")
    try:
        with held.open("wb"):  # made while the group runs and open: another process's, not the server's
            with ServerGroup([fake_launch(0, tmp_path, "--leave-files")], startup_timeout_s=20, stop_timeout_s=5):
                log = (tmp_path / "server-0.log").read_text()
                left = [Path(line.split(" left ", 1)[1]) for line in log.splitlines() if " left " in line]
                assert len(left) == 7 and all(path.exists() for path in left), left
                held.write_bytes(b"\0")
            assert not [path for path in left if path.exists()]
            assert not [path for path in left[2:] if path.parent.exists()], "the server's temporary folder stays"
            assert held.exists()
    finally:
        held.unlink(missing_ok=True)


def test_waiting_for_a_first_generation_that_never_comes_fails(tmp_path):
    """The wait the real-SGLang interrupt tests use must not carry on as if a rollout had begun."""
    run = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "server-0.log").write_text("GET /health 200\n")
        with pytest.raises(AssertionError, match="no POST /generate in .* within 0.5 s"):
            wait_for_first_generation(run, tmp_path / "server-0.log", 0.5)
    finally:
        run.kill()
        run.wait()


DRIVER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from tlt_cli.sglang.server import ServerGroup, ServerLaunch
    from tlt_cli.sglang.transport import ServerEndpoint
    port, log_dir, fake_arguments = int(sys.argv[1]), Path(sys.argv[2]), sys.argv[4:] or ["--spawn-child"]
    launch = ServerLaunch(
        endpoint=ServerEndpoint(0, f"http://127.0.0.1:{port}", "k"),
        command=(sys.executable, sys.argv[3], "--port", str(port), "--api-key", "k", *fake_arguments),
        environment=dict(os.environ), log_path=log_dir / "server-0.log", ports=(port,))
    with ServerGroup([launch], startup_timeout_s=20, stop_timeout_s=5) as group:
        print("ready", group.pids[0], flush=True)
        time.sleep(60)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_or_terminate_of_the_trainer_stops_its_servers(tmp_path, signum):
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(free_port()), str(tmp_path), str(FAKE_SERVER)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = driver.stdout.readline()
    assert line.startswith("ready"), driver.stderr.read()
    server_pid = int(line.split()[1])
    grandchild = child_pid(tmp_path / "server-0.log")
    driver.send_signal(signum)
    driver.wait(timeout=15)
    assert driver.returncode != 0
    assert not process_running(server_pid) and not process_running(grandchild)


def start_driver(log_dir: Path, temporary_folder: Path, *fake_arguments: str) -> tuple[subprocess.Popen, int]:
    """DRIVER (a process that starts a fake server and sleeps) with `fake_arguments` and its own TMPDIR; it and the
    server's pid once the server is healthy."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(free_port()), str(log_dir), str(FAKE_SERVER), *fake_arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(temporary_folder)},
    )
    line = driver.stdout.readline()
    assert line.startswith("ready"), driver.stderr.read()
    return driver, int(line.split()[1])


def left_files(log_path: Path) -> list[Path]:
    """The paths the fake server logged as left (tests/sglang_fake_server.py --leave-files)."""
    return [Path(line.split(" left ", 1)[1]) for line in log_path.read_text().splitlines() if " left " in line]


def kill_and_wait(driver: subprocess.Popen, server_pid: int) -> None:
    """SIGKILL the driver; its server then gets SIGTERM from Linux (parent-death signal) and exits."""
    driver.kill()
    driver.wait(timeout=15)
    deadline = time.monotonic() + 15
    while process_running(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_running(server_pid)


@pytest.fixture
def short_temporary_folder(monkeypatch):
    """A system temporary folder of the test's own with a short path (Unix sockets are made in it)."""
    folder = Path(tempfile.mkdtemp(prefix="tlt-test-"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_files_a_killed_run_left_are_removed_by_the_next_start_and_a_running_server_keeps_its_own(
    tmp_path, short_temporary_folder
):
    """SIGKILL of the process that started a server (a worker, `tlt train`) skips its stop: the server dies by its
    parent-death signal and its files stay, until the next group's start removes them; a running server of another
    process keeps its files."""
    killed, killed_server = start_driver(tmp_path / "killed", short_temporary_folder, "--leave-files")
    running, running_server = start_driver(tmp_path / "running", short_temporary_folder, "--leave-files")
    try:
        abandoned = left_files(tmp_path / "killed" / "server-0.log")
        kept = left_files(tmp_path / "running" / "server-0.log")
        assert len(abandoned) == len(kept) == 7 and all(path.exists() for path in abandoned + kept)
        kill_and_wait(killed, killed_server)
        assert all(path.exists() for path in abandoned), "nothing removes a killed run's files but the next start"
        with ServerGroup([fake_launch(0, tmp_path / "next")], startup_timeout_s=20, stop_timeout_s=5):
            assert not [path for path in abandoned if path.exists()]
            assert not abandoned[2].parent.exists(), "the killed server's temporary folder stays"
            assert all(path.exists() for path in kept)
        kill_and_wait(running, running_server)
        # the sweep of a driver whose worker was killed (it runs after stopping the servers the worker recorded)
        assert stop_recorded_servers(tmp_path, timeout_s=1) == []
        assert not [path for path in kept if path.exists()], "the driver's sweep leaves a killed worker's server files"
    finally:
        running.kill()
        running.wait()
    assert list(short_temporary_folder.iterdir()) == []


def test_a_tlt_train_of_any_backend_removes_the_server_files_a_killed_run_left(tmp_path, short_temporary_folder):
    """What `tlt train` clears first, whatever its rollout backend (an embedded run starts no server to sweep)."""
    killed, killed_server = start_driver(tmp_path / "killed", short_temporary_folder, "--leave-files")
    abandoned = left_files(tmp_path / "killed" / "server-0.log")
    kill_and_wait(killed, killed_server)
    assert all(path.exists() for path in abandoned)
    output = io.StringIO()
    run_preparation.remove_what_killed_runs_left(Console(file=output, width=200), tmp_path / "cache")
    assert not [path for path in abandoned if path.exists()]
    assert "removed the files of 1 SGLang server(s) a killed run left" in output.getvalue()
    assert list(short_temporary_folder.iterdir()) == []
