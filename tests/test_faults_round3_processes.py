"""The chaos suite, round 3 (issue 36), process faults: a killed hostfile run's shared memory, blame when several
workers fail, Ctrl-C in the first drafter warm-up, a read-only /dev/shm.

As in tests/test_faults.py, each fault is injected for real into the real CLI (`python -m tlt_cli` in a
subprocess): SIGKILL of a hostfile run's driver, SIGKILL of a worker mid-checkpoint, SIGINT during the
warm-up, a run whose /dev/shm is a read-only tmpfs (in a mount namespace of its own: as root, else skipped).
Each case checks what a user would see and what the machine keeps afterwards.
"""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_faults as faults
from recipe_overrides import small_run
from test_hostfile_launch import processes_of

from tlt_cli.processes.hostfile import LOCAL_ADDRESS
from tlt_cli.shared_memory import deepspeed_buffer, run_buffers

# a port no launch of this test uses: the name of a segment "left by a killed run" the test plants
PLANTED_PORT = 1


# ---------------------------------------------------------------- shared memory of a killed hostfile run


def launcher_master_port(run_directory: Path) -> int:
    """The --master_port of the DeepSpeed launcher running `run_directory` (the port names the run's segments)."""
    for process in processes_of(run_directory):
        command = process.info["cmdline"]
        if "--master_port" in command:
            return int(command[command.index("--master_port") + 1])
    raise AssertionError(f"no DeepSpeed launcher runs {run_directory}")


def test_sigkill_of_a_hostfile_runs_driver_leaves_no_deepspeed_segment_after_the_next_train(small_model, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run_directory = tmp_path / "killed"
    markers = tmp_path / "markers"
    driver = faults.start(
        small_run(small_model, tmp_path, "killed", 50, f"workers.hostfile={hostfile}", *faults.mark_rollouts(markers)),
        tmp_path,
    )
    faults.wait_until(lambda: (markers / "rollout-1-1").exists(), faults.HANG_GUARD_SECONDS, process=driver)
    killed_run_buffers = run_buffers(LOCAL_ADDRESS, launcher_master_port(run_directory), 2)
    ranks = processes_of(run_directory)
    driver.kill()
    driver.wait(timeout=faults.HANG_GUARD_SECONDS)
    faults.assert_gone(ranks)

    # beside it: a segment of another killed run (mapped by no one) and one a live process maps (a running job's)
    abandoned = deepspeed_buffer(LOCAL_ADDRESS, PLANTED_PORT, 0)
    live = deepspeed_buffer(LOCAL_ADDRESS, PLANTED_PORT, 1)
    abandoned.write_bytes(b"\0" * mmap.PAGESIZE)
    live.write_bytes(b"\0" * mmap.PAGESIZE)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import mmap, sys; f = open({str(live)!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0); print('mapped', "
            "flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "mapped"
        next_run = subprocess.run(
            small_run(small_model, tmp_path, "next", 1, "workers.count=1", "train.prompts_per_step=2"),
            capture_output=True,
            text=True,
            timeout=faults.HANG_GUARD_SECONDS,
        )
        assert next_run.returncode == 0, next_run.stderr[-3000:]
        assert not [buffer for buffer in [*killed_run_buffers, abandoned] if buffer.exists()]
        assert live.exists(), "a segment a live process maps belongs to a running job"
    finally:
        holder.communicate("", timeout=faults.HANG_GUARD_SECONDS)
        for buffer in (abandoned, live):
            buffer.unlink(missing_ok=True)


# ---------------------------------------------------------------- blame


def run_killed_in_checkpoint(small_model: Path, tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    """A 2-step run of `name` (a checkpoint every step) whose rank 1 is SIGKILLed in its first checkpoint."""
    return subprocess.run(
        small_run(
            small_model,
            tmp_path,
            name,
            2,
            "checkpoint.every=1",
            *extra,
            "plugins.enabled=[fault_plugins:KillInCheckpoint]",
        ),
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
        env=faults.environment_with_test_plugins(),
    )


def test_sigkill_of_worker_one_mid_checkpoint_names_it_not_its_peer(small_model, tmp_path):
    """Worker 1 is killed writing the first checkpoint; worker 0 then fails in the checkpoint's barrier (gloo:
    connection reset by peer). The cause is worker 1, named with its signal; worker 0's error only in the log."""
    result = run_killed_in_checkpoint(small_model, tmp_path, "killed-in-checkpoint")
    assert result.returncode == 1, result.stderr[-3000:]
    line = faults.one_line(result.stdout, result.stderr)
    assert line.startswith("error: worker 1 was killed by SIGKILL (code -9) without reporting an error"), line
    assert "worker 0" not in line, line
    log = (tmp_path / "killed-in-checkpoint" / "run.log").read_text()
    assert "then worker 0 failed:" in log, log[-3000:]


def test_sigkill_of_rank_one_of_a_hostfile_run_mid_checkpoint_names_it_not_its_peer(small_model, tmp_path):
    """As above, under the DeepSpeed launcher: the driver is not the ranks' parent, so it names rank 1 by the pid
    its progress reports carried, and its signal by the exit code the launcher (its parent) logged."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    result = run_killed_in_checkpoint(
        small_model, tmp_path, "launched-killed-in-checkpoint", f"workers.hostfile={hostfile}"
    )
    assert result.returncode == 1, result.stderr[-3000:]
    line = faults.one_line(result.stdout, result.stderr)
    assert line.startswith("error: worker 1 (pid "), line
    assert "was killed by SIGKILL (code -9) without reporting an error" in line and "worker 0" not in line, line


# ---------------------------------------------------------------- Ctrl-C in the first drafter warm-up


def test_ctrl_c_in_the_first_drafter_warm_up_says_there_is_nothing_to_resume(small_model, tmp_path):
    """A cold cache makes `tlt train` warm the drafter up before it makes the run directory: Ctrl-C there must not
    advise a --resume of a folder that does not exist."""
    run_directory = tmp_path / "warming"
    command = small_run(small_model, tmp_path, "warming", 2, "speculative.mode=adaptive", "drafter.init=warmup")
    environment = {**faults.environment_with_test_plugins(), "TLT_CACHE_DIR": str(tmp_path / "cold-cache")}
    with open(tmp_path / "driver.out", "w") as stdout, open(tmp_path / "driver.err", "w") as stderr:
        driver = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment)
    faults.wait_until(
        lambda: "preparing the drafter" in (tmp_path / "driver.out").read_text(),
        faults.HANG_GUARD_SECONDS,
        process=driver,
    )
    driver.send_signal(signal.SIGINT)
    code, stdout, stderr = faults.finish(driver, tmp_path)
    assert code == 130, stderr[-3000:]
    assert "drafter warmed up" not in stdout, "the warm-up ended before the interrupt: the test pressed Ctrl-C late"
    assert faults.one_line(stdout, stderr) == (
        f"error: interrupted; the run had not started ({run_directory} was not made), so there is nothing to "
        "resume: run it again."
    )
    assert not run_directory.exists()


# ---------------------------------------------------------------- a read-only /dev/shm

# mounts an empty read-only tmpfs on /dev/shm in a mount namespace of its own (never the machine's), then runs "$@"
READ_ONLY_SHARED_MEMORY = 'mount -t tmpfs -o ro tmpfs /dev/shm && exec "$@"'


def with_read_only_shared_memory(command: list[str]) -> list[str]:
    """`command` where /dev/shm cannot be written, as on a hardened host or a container with a read-only /dev/shm."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_SHARED_MEMORY, "sh", *command]


@pytest.fixture(scope="module")
def read_only_shared_memory():
    """Skip unless this machine lets the tests make a mount namespace (root, unshare) whose /dev/shm is read-only."""
    probe = subprocess.run(
        with_read_only_shared_memory(["sh", "-c", "! touch /dev/shm/tlt-write-probe"]), capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace with a read-only /dev/shm here: {probe.stderr.decode().strip()}")


def test_the_segments_a_read_only_dev_shm_keeps_are_passed_over(read_only_shared_memory, tmp_path):
    """`tlt train` first frees the segments killed runs left; on a /dev/shm remounted read-only since, it cannot
    and must go on (the unlink's OSError was a traceback)."""
    segment = deepspeed_buffer(LOCAL_ADDRESS, PLANTED_PORT, 0).name
    plant_then_remount = (
        f'mount -t tmpfs tmpfs /dev/shm && touch /dev/shm/{segment} && mount -o remount,ro /dev/shm && exec "$@"'
    )
    remove = "from tlt_cli.shared_memory import remove_abandoned_buffers; print(remove_abandoned_buffers())"
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", plant_then_remount, "sh"]
    result = subprocess.run([*command, sys.executable, "-c", remove], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "[]\n", "")


def test_a_read_only_dev_shm_is_one_sentence_before_spawned_workers_start(
    read_only_shared_memory, small_model, tmp_path
):
    """Spawned workers' event queue needs semaphores, which live in /dev/shm: refused before the run directory
    is made (it was a traceback from multiprocessing, and the run directory stayed)."""
    result = subprocess.run(
        with_read_only_shared_memory(small_run(small_model, tmp_path, "read-only-shm", 1)),
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert faults.one_line(result.stdout, result.stderr) == (
        "error: /dev/shm cannot be written on this machine (Read-only file system) and the worker processes tlt "
        "train spawns share their locks there; mount a writable tmpfs there (in a container: docker run "
        "--shm-size=1g), or launch the workers with workers.hostfile (a file reading 'localhost slots=N'), then "
        "run again."
    )
    assert not (tmp_path / "read-only-shm").exists()


def test_a_hostfile_run_trains_where_dev_shm_is_read_only(read_only_shared_memory, small_model, tmp_path):
    """The DeepSpeed launcher's ranks need no /dev/shm: DeepSpeed makes no all-reduce buffer there and reduces
    through gloo (it printed "shared_create ... failed" and waited forever for its own segment)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    result = subprocess.run(
        with_read_only_shared_memory(
            small_run(small_model, tmp_path, "read-only-shm", 1, f"workers.hostfile={hostfile}")
        ),
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 1 steps" in result.stdout, result.stdout[-3000:]
    rank_log = (tmp_path / "read-only-shm" / "workers" / "worker-0.log").read_text()
    assert "shared_create" not in rank_log, rank_log[-3000:]


# ---------------------------------------------------------------- the leak check of the fault tests itself

LEAKING_TESTS = """
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

KEPT = []
HOLD_AND_DIE = (
    "import mmap, os, time; f = open({{path!r}}, 'w+b'); f.write(bytes(4096)); f.flush(); "
    "m = mmap.mmap(f.fileno(), 0); time.sleep(3); os._exit(9)"
)
LINK_AND_DIE = (
    "import mmap, os, time; f = open({{stage!r}}, 'w+b'); f.write(bytes(4096)); f.flush(); "
    "m = mmap.mmap(f.fileno(), 0); f.close(); os.link({{stage!r}}, {{path!r}}); os.unlink({{stage!r}}); "
    "time.sleep(3); os._exit(9)"
)


def test_leaves_a_process():
    subprocess.Popen(["sleep", "300"])


def test_leaves_shared_memory():
    # a process maps a segment and dies without unlinking it, as a killed rank does
    subprocess.run(
        [sys.executable, "-c", HOLD_AND_DIE.format(path="/dev/shm/tlt-leak-probe-{mark}")], check=False, timeout=60
    )


def test_leaves_shared_memory_under_another_name():
    # as glibc makes a POSIX semaphore: map a staging file, link it to its own name, unlink the staging name;
    # the process then shows only the deleted staging name, and dies leaving the linked one
    script = LINK_AND_DIE.format(stage="/dev/shm/tlt-leak-stage-{mark}", path="/dev/shm/tlt-leak-linked-{mark}")
    subprocess.run([sys.executable, "-c", script], check=False, timeout=60)


def test_leaves_a_listening_socket():
    KEPT.append(socket.create_server(("127.0.0.1", 0)))


def test_leaves_a_temporary_file():
    tempfile.NamedTemporaryFile(delete=False).close()


def test_leaves_nothing():
    with tempfile.NamedTemporaryFile():
        subprocess.run(["true"], check=True)
"""


def test_the_leak_check_fails_each_kind_of_leak_and_passes_a_clean_test(tmp_path):
    probe = tmp_path / "test_faults_leak_probe.py"
    probe.write_text(LEAKING_TESTS.format(mark=os.getpid()))
    session = faults.inner_pytest_session(probe, tmp_path)
    output = session.stdout
    assert session.returncode == 1, output[-3000:]
    # a test whose teardown fails counts as passed and errored: only the clean one passes without an error
    assert "6 passed, 5 errors" in output and "of test_leaves_nothing" not in output, output[-3000:]
    for test, leak in [
        ("test_leaves_a_process", "process "),
        ("test_leaves_shared_memory", f"shared memory /dev/shm/tlt-leak-probe-{os.getpid()}"),
        ("test_leaves_shared_memory_under_another_name", f"shared memory /dev/shm/tlt-leak-linked-{os.getpid()}"),
        ("test_leaves_a_listening_socket", "listening socket ('AF_INET', "),
        ("test_leaves_a_temporary_file", "file "),
    ]:
        assert f"ERROR at teardown of {test}" in output, output[-3000:]
        report = output.split(f"ERROR at teardown of {test}", 1)[1]
        assert f"the test left behind:\n{leak}" in report, report[:1000]
    assert not Path(f"/dev/shm/tlt-leak-probe-{os.getpid()}").exists()
    assert not Path(f"/dev/shm/tlt-leak-linked-{os.getpid()}").exists()
