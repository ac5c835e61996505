"""The chaos suite, processes half: faults injected for real into `tlt train` and its event channel.

Each case injects its fault for real (a stranger on the event channel, SIGSTOP, SIGKILL, SIGTERM,
two runs at one folder) and checks what a user would: the command ends (every wait has a
generous bound, HANG_GUARD_SECONDS: a guard so a hang fails the test instead of CI, not a speed
claim), with the documented exit code and one line on the terminal, no traceback, no worker
process left, and every checkpoint and trace of the run still there and readable (the
checkpoint's files loaded as a resume would). The data half (corrupt files, wrong shapes, a full
disk, markup, export --force) is tests/test_faults_data.py.

Runs are tiny (one or two steps of 4 prompts x 2 samples, plain decoding) and ordered by the test
without sleeps where it matters: tests/fault_plugins.py holds a worker before its first step until
the test releases it, and `MarkRollouts` marks each rank's rollout start (with its pid).
"""

import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from recipe_overrides import DETERMINISTIC, TLT, small_run

from tlt_cli.checkpoint import latest_checkpoint, load_checkpoint_file, prepare_staging, publish
from tlt_cli.processes import event_channel
from tlt_cli.processes.distributed import BarrierTimeout, RolloutBarrier, WorkerAddress
from tlt_cli.processes.event_channel import DriverUnreachable, EventListener, connect_to_driver
from tlt_cli.processes.run_directory import resume_checkpoint
from tlt_cli.trace import read_trace

TESTS = Path(__file__).resolve().parent
# the bound on any one command or wait of this suite (a hang guard, not a speed assertion)
HANG_GUARD_SECONDS = 600
SECRET = b"secret of the run"


# ---------------------------------------------------------------- the event channel


def test_a_peer_that_closes_and_a_silent_peer_are_dropped_and_ranks_still_connect(monkeypatch):
    monkeypatch.setattr(event_channel, "HANDSHAKE_SECONDS", 2.0)
    dropped: list[str] = []
    listener = EventListener("127.0.0.1", SECRET, on_rejected=dropped.append)
    closer = socket.create_connection(("127.0.0.1", listener.port))
    closer.close()
    silent = socket.create_connection(("127.0.0.1", listener.port))
    try:
        # a rank arriving behind both is admitted at once (not after the silent peer's deadline)
        rank = connect_to_driver("127.0.0.1", listener.port, SECRET, deadline_seconds=30)
        rank.put("first report")
        assert listener.get(timeout=30) == "first report"
        wait_until(lambda: len(dropped) == 2, seconds=30)
        assert any("closed before the handshake" in line for line in dropped), dropped
        assert any("no handshake within 2 s" in line for line in dropped), dropped
        # the accept loop lives on: a stranger with the wrong secret is refused, another rank gets in
        with pytest.raises(DriverUnreachable, match="not a rank of this run"):
            connect_to_driver("127.0.0.1", listener.port, b"another secret", deadline_seconds=30)
        second = connect_to_driver("127.0.0.1", listener.port, SECRET, deadline_seconds=30)
        second.put("second report")
        assert listener.get(timeout=30) == "second report"
        rank.close()
        second.close()
    finally:
        silent.close()
        listener.close()


def test_a_rank_gives_up_on_a_silent_or_absent_driver_with_one_sentence(monkeypatch):
    monkeypatch.setattr(event_channel, "HANDSHAKE_SECONDS", 1.0)
    with socket.create_server(("127.0.0.1", 0)) as silent_driver:  # accepts (the kernel does), never answers
        port = silent_driver.getsockname()[1]
        with pytest.raises(DriverUnreachable, match=f"at 127.0.0.1:{port} within 3 s .no handshake within 1 s"):
            connect_to_driver("127.0.0.1", port, SECRET, deadline_seconds=3)
    # the port is closed now: nothing listens there
    with pytest.raises(DriverUnreachable, match=f"at 127.0.0.1:{port} within 3 s"):
        connect_to_driver("127.0.0.1", port, SECRET, deadline_seconds=3)


# ---------------------------------------------------------------- the rollout barrier


def test_the_rollout_barrier_gives_up_naming_the_worker_it_waited_for(tmp_path):
    """Rank 0 is done and waits (idle work polling `rollout_over`); rank 1 never comes: BarrierTimeout names it."""
    first = RolloutBarrier(WorkerAddress(0, 2, 0, rendezvous_directory=tmp_path), timeout_seconds=1.0)
    first.mark_done(3)
    polls = []

    def idle_work(rollout_over):
        while not rollout_over():
            polls.append(1)
            time.sleep(0.01)

    with pytest.raises(BarrierTimeout, match=r"worker\(s\) 1 did not finish the rollout of step 3 within 1 s"):
        first.wait(3, while_idle=idle_work)
    assert polls, "the idle work ran until the deadline"
    second = RolloutBarrier(WorkerAddress(1, 2, 0, rendezvous_directory=tmp_path), timeout_seconds=1.0)
    second.mark_done(3)
    first.wait(3)  # both done: no wait
    assert first.unfinished(4) == [0, 1]


# ---------------------------------------------------------------- one run: sockets, SIGTERM, SIGSTOP, SIGKILL


def test_a_single_node_run_listens_on_loopback_only_and_sigterm_stops_it_cleanly(small_model, tmp_path):
    run_directory = tmp_path / "term"
    driver, _ = start_in_rollout(small_model, tmp_path, "term")
    processes = run_processes(driver)
    listening = [address for process in processes for address in listening_addresses(process)]
    assert listening, "the run's gloo group should listen on loopback"
    assert all(ipaddress.ip_address(host).is_loopback for host, _ in listening), listening

    driver.send_signal(signal.SIGTERM)
    code, stdout, stderr = finish(driver, tmp_path)
    assert code == 143, stderr
    assert one_line(stdout, stderr) == (
        f"error: terminated; complete checkpoints are kept, continue with --resume {run_directory}."
    )
    assert_gone(processes)
    assert_intact(run_directory)


def test_a_stopped_worker_is_named_by_the_step_deadline_and_the_run_ends(small_model, tmp_path):
    # SIGSTOP mid-rollout of step 1: rank 1's rollout has just started
    stopped, line = end_by_signalling_rank_one(
        small_model, tmp_path, "stopped", signal.SIGSTOP, "workers.step_timeout_s=30"
    )
    assert line.startswith(f"error: worker 1 (pid {stopped}, stopped) has not finished step 1 within "), line
    assert "workers.step_timeout_s=30 s: it is in the rollout; worker(s) 0 wait for it" in line, line
    assert "complete checkpoints are kept" in line


@pytest.mark.slow
def test_sigkill_of_one_worker_ends_the_run_naming_it(small_model, tmp_path):
    _, line = end_by_signalling_rank_one(small_model, tmp_path, "killed-worker", signal.SIGKILL)
    assert line.startswith("error: worker 1 was killed by SIGKILL (code -9) without reporting an error"), line


@pytest.mark.slow
def test_sigkill_of_the_driver_alone_ends_its_workers_and_keeps_the_run(small_model, tmp_path):
    run_directory = tmp_path / "killed-driver"
    driver, _ = start_in_rollout(small_model, tmp_path, "killed-driver")
    processes = psutil.Process(driver.pid).children(recursive=True)
    driver.kill()  # the driver alone: its workers are not signalled
    driver.wait(timeout=HANG_GUARD_SECONDS)
    assert_gone(processes)
    assert_intact(run_directory)


# ---------------------------------------------------------------- the run directory


def test_two_runs_with_one_name_and_a_failing_run_beside_a_live_one(small_model, tmp_path):
    """C makes runs/ and holds before its first step; A starts in runs/ and holds; B, named as A, is refused;
    C fails and goes without taking runs/ (A's run is in it); A then finishes untouched."""
    runs = tmp_path / "runs"
    failing = start(held_run(small_model, runs, "c", tmp_path / "release-c", fail=True), tmp_path, "c")
    wait_until(lambda: Path(f"{tmp_path / 'release-c'}.held").exists(), seconds=HANG_GUARD_SECONDS, process=failing)
    live = start(held_run(small_model, runs, "a", tmp_path / "release-a"), tmp_path, "a")
    wait_until(lambda: Path(f"{tmp_path / 'release-a'}.held").exists(), seconds=HANG_GUARD_SECONDS, process=live)

    second = subprocess.run(
        held_run(small_model, runs, "a", tmp_path / "release-b"),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
        env=environment_with_test_plugins(),
    )
    assert second.returncode == 2, second.stderr
    assert one_line(second.stdout, second.stderr) == (
        f"error: run directory {runs / 'a'} is in use by another tlt train (pid {live.pid}); wait for it to end, "
        "or choose another name with run.name=<name>."
    )

    (tmp_path / "release-c").touch()
    code, stdout, stderr = finish(failing, tmp_path, "c")
    assert code == 1, stderr
    assert "failed before its first step, so its run directory is removed" in one_line(stdout, stderr)
    assert not (runs / "c").exists() and (runs / "a" / "recipe.yaml").is_file()

    (tmp_path / "release-a").touch()
    code, stdout, stderr = finish(live, tmp_path, "a")
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert_intact(runs / "a", steps=1)


# ---------------------------------------------------------------- resume after a kill at a random moment


def test_a_resume_starts_from_the_newest_checkpoint_the_trace_covers(tmp_path):
    """Workers publish a checkpoint before reporting its step: a driver killed in between leaves one ahead of the
    trace (what the random-kill test below met: a trace of steps 0, 2, 3)."""
    checkpoints = tmp_path / "checkpoints"
    for next_step in (1, 2):
        (prepare_staging(checkpoints, next_step) / "weights.pt").write_bytes(b"weights")
        publish(checkpoints, next_step, {}, keep=2)
    step_zero = json.dumps({"type": "step", "step": 0})
    (tmp_path / "trace.jsonl").write_text(f'{{"type": "run"}}\n{step_zero}\n{{"type": "step", "st')  # cut by the kill
    checkpoint, warnings = resume_checkpoint(tmp_path)
    assert checkpoint.directory == checkpoints / "step_000001"
    assert warnings == [
        "checkpoint step_000002 is ahead of the trace (step 1 never recorded: tlt train was stopped first); "
        "resuming from step_000001 so that the trace stays whole."
    ]
    shutil.rmtree(checkpoints / "step_000001")  # none older kept: resume at the newest, and say what the trace lacks
    checkpoint, warnings = resume_checkpoint(tmp_path)
    assert checkpoint.directory == checkpoints / "step_000002" and "no record of step 1" in warnings[0]


@pytest.mark.slow
def test_the_driver_killed_at_a_random_moment_resumes_to_the_same_metrics(small_model, tmp_path):
    steps = 4
    reference = subprocess.run(
        small_run(small_model, tmp_path, "reference", steps, "checkpoint.every=1"),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]

    run_directory = tmp_path / "killed"
    driver = start(small_run(small_model, tmp_path, "killed", steps, "checkpoint.every=1"), tmp_path)
    wait_until(lambda: (run_directory / "checkpoints" / "latest").exists(), HANG_GUARD_SECONDS, process=driver)
    time.sleep(random.Random().uniform(0.0, 4.0))
    workers = psutil.Process(driver.pid).children(recursive=True) if driver.poll() is None else []
    driver.kill()
    driver.wait(timeout=HANG_GUARD_SECONDS)
    assert_gone(workers)

    resumed = subprocess.run(
        [*TLT, "train", "--resume", str(run_directory)], capture_output=True, text=True, timeout=HANG_GUARD_SECONDS
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = [record for record in read_trace(tmp_path / "reference" / "trace.jsonl") if record["type"] == "step"]
    actual = [record for record in read_trace(run_directory / "trace.jsonl") if record["type"] == "step"]
    assert [record["step"] for record in actual] == list(range(steps))
    for want, got in zip(expected, actual):
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (want["step"], key)


# ---------------------------------------------------------------- helpers


def mark_rollouts(directory: Path) -> list[str]:
    """Overrides that enable MarkRollouts, writing <directory>/rollout-<rank>-<step> (the rank's pid) at each start."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        "plugins.enabled=[fault_plugins:MarkRollouts]",
        f"plugins.options.fault_plugins:MarkRollouts.directory={directory}",
    ]


def start_in_rollout(model: Path, folder: Path, name: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """A 20-step run `name` (a checkpoint every step, `extra` overrides) started by `start` and waited for until
    rank 1's rollout of step 1 has begun: its driver and rank 1's pid."""
    markers = folder / "markers"
    driver = start(small_run(model, folder, name, 20, "checkpoint.every=1", *extra, *mark_rollouts(markers)), folder)
    wait_until(lambda: (markers / "rollout-1-1").exists(), seconds=HANG_GUARD_SECONDS, process=driver)
    return driver, int((markers / "rollout-1-1").read_text())


def end_by_signalling_rank_one(
    model: Path, folder: Path, name: str, signal_number: int, *extra: str
) -> tuple[int, str]:
    """`start_in_rollout`, then `signal_number` to rank 1: the run must end with code 1, leave no process and keep
    its files intact. Rank 1's pid and the one line on the terminal."""
    driver, rank_one = start_in_rollout(model, folder, name, *extra)
    processes = run_processes(driver)
    os.kill(rank_one, signal_number)
    code, stdout, stderr = finish(driver, folder)
    assert code == 1, stderr
    line = one_line(stdout, stderr)
    assert_gone(processes)
    assert_intact(folder / name)
    return rank_one, line


def run_processes(driver: subprocess.Popen) -> list[psutil.Process]:
    """The run's processes: its driver first, then every process under it."""
    return [psutil.Process(driver.pid), *psutil.Process(driver.pid).children(recursive=True)]


def held_run(model: Path, runs: Path, name: str, release: Path, fail: bool = False) -> list[str]:
    """One step of one worker into runs/name, held before its first step until `release` exists (then fails if told)."""
    return small_run(
        model,
        runs,
        name,
        1,
        "workers.count=1",
        "train.prompts_per_step=2",
        "plugins.enabled=[fault_plugins:HoldUntilReleased]",
        f"plugins.options.fault_plugins:HoldUntilReleased.release={release}",
        f"plugins.options.fault_plugins:HoldUntilReleased.fail={str(fail).lower()}",
    )


def environment_with_test_plugins() -> dict[str, str]:
    """This environment with the tests' folder (their plugins) first on PYTHONPATH, the caller's entries after it."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}


def inner_pytest_session(test_file: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """A pytest session of its own over `test_file`, with the tests' conftest (its session fixtures and leak
    checks), run in `tmp_path`: what a test of those fixtures inspects."""
    command = ["-m", "pytest", "-q", "-p", "conftest", "-c", os.devnull, f"--basetemp={tmp_path / 'basetemp'}"]
    return subprocess.run(
        [sys.executable, *command, str(test_file)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_SECONDS,
        env=environment_with_test_plugins(),
        cwd=tmp_path,
    )


def start(command: list[str], folder: Path, name: str = "driver") -> subprocess.Popen:
    """`tlt train` in the background, its terminal output in <folder>/<name>.out and .err (read by `finish`)."""
    with open(folder / f"{name}.out", "w") as stdout, open(folder / f"{name}.err", "w") as stderr:
        return subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment_with_test_plugins())


def finish(process: subprocess.Popen, folder: Path, name: str = "driver") -> tuple[int, str, str]:
    """Wait (bounded) for a process `start` began: its exit code, stdout and stderr."""
    try:
        code = process.wait(timeout=HANG_GUARD_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return code, (folder / f"{name}.out").read_text(), (folder / f"{name}.err").read_text()


def wait_until(condition, seconds: float, process: subprocess.Popen | None = None) -> None:
    """Poll `condition` until it holds; fail after `seconds`, or at once if `process` ended first."""
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            pytest.fail(f"the run ended (code {process.returncode}) before the moment the test waits for")
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds} s in vain")
        time.sleep(0.1)


def one_line(stdout: str, stderr: str) -> str:
    """The one line on stderr (no traceback anywhere on the terminal)."""
    assert "Traceback" not in stdout + stderr, stdout[-3000:] + stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def listening_addresses(process: psutil.Process) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket `process` listens on."""
    try:
        connections = process.net_connections(kind="inet")
    except psutil.NoSuchProcess:
        return []
    return [tuple(connection.laddr) for connection in connections if connection.status == psutil.CONN_LISTEN]


def assert_gone(processes: list[psutil.Process]) -> None:
    """Every process of the run has exited (bounded wait)."""
    _, alive = psutil.wait_procs(processes, timeout=60)
    assert not alive, [process.pid for process in alive]


def assert_intact(run_directory: Path, steps: int | None = None) -> None:
    """The run's trace reads, and its latest checkpoint is complete and every file of it loads (weights-only)."""
    records = read_trace(run_directory / "trace.jsonl")
    recorded = [record["step"] for record in records if record["type"] == "step"]
    assert recorded == list(range(len(recorded))) and recorded, recorded
    if steps is not None:
        assert len(recorded) == steps
    checkpoint = latest_checkpoint(run_directory)
    assert checkpoint.warning is None and 1 <= checkpoint.next_step <= len(recorded)
    state = json.loads((checkpoint.directory / "state.json").read_text())
    assert state["next_step"] == checkpoint.next_step
    from tlt_cli.training.actor import deepspeed_checkpoint_classes

    loaded = [load_checkpoint_file(path, deepspeed_checkpoint_classes()) for path in checkpoint.directory.rglob("*.pt")]
    assert loaded
