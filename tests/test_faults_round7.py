"""Faults of round 7 (issue 65) that need real processes: `tlt bench update`'s measuring process exits with the
bench when the bench is killed, as `tlt train`'s workers do, and its process group listens on no interface but
loopback; DeepSpeed's op build runs under a lock tlt owns, so a rank waits for another's build naming its holder
within a bound, a build stopped with Ctrl-C removes torch's lock, the build's compilers (a real build, stopped as it
compiles) stop with the rank killed or stopped, and a second run on one cache reaches its step 0 once the first is
stopped during its build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import test_faults as faults
from process_checks import outlived
from recipe_overrides import small_run

from tlt_cli.processes.op_build import BUILD_TEMPORARY_PREFIX, OP_BUILD_LOCK, OpBuildTimeout, op_build_lock
from tlt_cli.trace import read_trace

# the bench's own way of starting a measurement (bench/update.py), in a process the test can kill
BENCH = """
from tlt_cli.bench.update import UpdateSettings, measure_in_fresh_process

measure_in_fresh_process("tiny-cpu", [], UpdateSettings())
"""


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return [int(child) for child in listing.read().split()]
    except OSError:
        return []


def test_the_measuring_process_exits_with_a_killed_bench(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent(BENCH))
    environment = {**os.environ, "TLT_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    bench = subprocess.Popen([sys.executable, str(script)], env=environment)
    deadline = time.monotonic() + 60
    while not children(bench.pid) and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    (measuring,) = children(bench.pid)
    bench.send_signal(signal.SIGKILL)
    bench.wait()
    # it may still import torch when the bench dies: it exits as its imports end and it first looks
    assert not outlived(measuring, 30), "the measuring process outlived the killed bench by 30 s"


# the measuring process's one-rank group joined as the bench joins it, held until the test has looked at its sockets
JOINED = """
import shutil, sys
from tlt_cli.bench.update_worker import join_one_rank
from tlt_cli.config import load_recipe
from tlt_cli.processes.distributed import private_rendezvous_directory
from tlt_cli.recipes import resolve_recipe_path

rendezvous = private_rendezvous_directory()
try:
    join_one_rank(load_recipe(resolve_recipe_path("tiny-cpu"), []), rendezvous)
    print("joined", flush=True)
    sys.stdin.readline()
finally:
    shutil.rmtree(rendezvous)
"""


def test_the_measuring_processs_group_listens_on_no_interface_but_loopback(tmp_path):
    """torch's TCPStore listened on every interface (`*:29733`); the group now meets in a file, as tlt train's do."""
    import psutil

    script = tmp_path / "joined.py"
    script.write_text(textwrap.dedent(JOINED))
    joined = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    try:
        said = ""
        while said != "joined" and joined.poll() is None:
            said = joined.stdout.readline().strip()
        assert said == "joined", f"the process group was not joined (exit {joined.poll()})"
        listening = [
            connection.laddr
            for connection in psutil.Process(joined.pid).net_connections(kind="tcp")
            if connection.status == psutil.CONN_LISTEN
        ]
        assert all(address.ip in ("127.0.0.1", "::1") for address in listening), listening
    finally:
        joined.communicate("\n", timeout=60)
    assert joined.returncode == 0


# a rank that holds tlt's build lock while it builds (the build faked: torch's baton held, and a long sleep)
BUILDER = """
import sys, time
from pathlib import Path
from torch.utils.file_baton import FileBaton
from tlt_cli.processes import op_build

def build():  # as torch's _jit_compile: its lock made, the build, its lock removed however the build ends
    Path(sys.argv[1], "deepspeed_shm_comm").mkdir(exist_ok=True)
    baton = FileBaton(sys.argv[1] + "/deepspeed_shm_comm/lock")
    assert baton.try_acquire(), "the lock a killed build left was not removed"
    try:
        print("building", flush=True)
        for _ in range(6000):  # short sleeps: a signal handled just before one long sleep would wait for its end
            time.sleep(0.1)
    finally:
        baton.release()

op_build.build_shared_memory_op = build
op_build.built_deepspeed_ops(Path(sys.argv[1]), lambda said: None)
"""


def start_builder(extensions: Path) -> subprocess.Popen:
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(extensions)], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    return builder


def test_a_rank_waits_for_the_build_another_holds_naming_its_pid_then_takes_the_lock_when_the_holder_dies(tmp_path):
    extensions = tmp_path / "torch_extensions"
    builder = start_builder(extensions)
    said = []
    try:
        with pytest.raises(OpBuildTimeout) as raised:
            with op_build_lock(extensions, said.append, seconds=1.0):
                pass
        assert said == [f"waiting for the DeepSpeed op build held by pid {builder.pid} (at most 1 s)"]
        assert str(raised.value) == (
            f"the DeepSpeed op build in {extensions} is still held by pid {builder.pid} after 1 s; let that build "
            "end (or stop the run that builds), then run again."
        )
        threading.Timer(1.0, builder.kill).start()  # kill -9: the kernel releases the flock
        with op_build_lock(extensions, said.append, seconds=60.0):
            assert (extensions / OP_BUILD_LOCK).read_text() == str(os.getpid())
    finally:
        builder.kill()
        builder.wait()


def test_a_build_stopped_by_ctrl_c_then_the_drivers_sigterm_removes_torchs_lock(tmp_path):
    """Ctrl-C reaches the whole foreground group and the driver then terminates its workers: the builder's torch
    clean-up still removes its lock. A lock a killed build left is removed by the next holder before it builds."""
    extensions = tmp_path / "torch_extensions"
    left = extensions / "deepspeed_shm_comm" / "lock"
    left.parent.mkdir(parents=True)
    left.write_text("")  # a killed build's: no process holds it open
    builder = start_builder(extensions)
    builder.send_signal(signal.SIGINT)
    builder.send_signal(signal.SIGTERM)
    assert builder.wait(timeout=30) != 0
    assert not left.exists(), "the interrupted build left torch's lock, on which every later build waits for good"


# a rank that builds DeepSpeed's op for real into an empty extensions folder (argv[1])
BUILDING_RANK = """
import sys
from pathlib import Path
from tlt_cli.processes.op_build import built_deepspeed_ops

built_deepspeed_ops(Path(sys.argv[1]), lambda said: print(said, flush=True))
"""
# the processes that show a build is compiling (ninja, and gcc's compiler proper)
COMPILERS = ("ninja", "cc1plus")


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
def test_the_builds_compilers_stop_with_the_rank_that_builds(tmp_path, stop):
    """Ninja and its compilers ran on for about 2 minutes after the rank that built was killed, while the next run
    removed the lock and rebuilt into the same folder: none is left 5 s after the rank is killed or stopped."""
    import psutil

    extensions, temporary = tmp_path / "torch_extensions", tmp_path / "tmp"
    temporary.mkdir()
    environment = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "DS_ACCELERATOR": "cpu"}
    environment["TMPDIR"] = str(temporary)
    rank = subprocess.Popen([sys.executable, "-c", BUILDING_RANK, str(extensions)], env=environment)
    try:
        deadline = time.monotonic() + faults.HANG_GUARD_SECONDS
        compilers = []
        while not compilers and rank.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            descendants = psutil.Process(rank.pid).children(recursive=True)
            compilers = [process for process in descendants if _name(process) in COMPILERS]
        assert compilers, "the build started no compiler"
        building = [process.pid for process in descendants]  # the build's child, ninja, the compilers' shells
        rank.send_signal(stop)
        rank.wait(timeout=60)
    finally:
        rank.kill()
        rank.wait()
    survivors = [pid for pid in building if outlived(pid, 5)]
    assert not survivors, f"the build's processes {survivors} outlived the rank stopped by {stop.name} by 5 s"
    assert not (extensions / "deepspeed_shm_comm" / "lock").exists(), "the stopped build left torch's lock"
    # the compilers' temporary files were the build's own (gcc left an empty /tmp/cc*.s when killed mid-file)
    assert not list(extensions.glob(f"{BUILD_TEMPORARY_PREFIX}*")) and not list(temporary.iterdir())


def _name(process) -> str:
    try:
        return process.name()
    except Exception:  # noqa: BLE001 - a process gone between the listing and the look
        return ""


@pytest.mark.slow
def test_a_second_run_on_one_cache_reaches_step_0_once_the_first_is_stopped_with_ctrl_c_in_its_build(
    small_model, tmp_path
):
    """Two `tlt train` on one empty cache: the second's workers wait for the first's op build, saying whose; the
    first is stopped with Ctrl-C during it; the second then builds and reaches its step 0 (it waited for good)."""
    cache = tmp_path / "cold-cache"
    baton = cache / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    environment = faults.environment_with_test_plugins()
    runs = {}
    for name in ("first", "second"):
        with open(tmp_path / f"{name}.out", "w") as stdout, open(tmp_path / f"{name}.err", "w") as stderr:
            command = small_run(small_model, tmp_path, name, 1, f"model.cache_dir={cache}")
            runs[name] = subprocess.Popen(
                command, stdout=stdout, stderr=stderr, env=environment, start_new_session=True
            )
        if name == "first":
            faults.wait_until(baton.exists, faults.HANG_GUARD_SECONDS, process=runs["first"])
    try:
        waiting = "waiting for the DeepSpeed op build held by pid"
        faults.wait_until(lambda: waiting in (tmp_path / "second.out").read_text(), 120, process=runs["second"])
        os.killpg(runs["first"].pid, signal.SIGINT)  # Ctrl-C: the terminal signals the run's whole group
        assert runs["first"].wait(timeout=60) == 130
        assert runs["second"].wait(timeout=faults.HANG_GUARD_SECONDS) == 0, (tmp_path / "second.err").read_text()
    finally:
        for run in runs.values():
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    assert not baton.exists()
    trace = read_trace(tmp_path / "second" / "trace.jsonl")
    assert [record["step"] for record in trace if record["type"] == "step"] == [0]
