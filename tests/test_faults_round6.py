"""Faults, round 6 (issue 57): what a killed first run leaves never stops a later one.

A build lock of DeepSpeed's CPU op whose builder was killed is removed by the next run's clean-up with one line (a
lock a live builder holds stays); a worker whose driver died while the worker still imported exits; the
multiprocessing semaphores a killed driver left in /dev/shm are removed by the next run. Each through real
processes killed with SIGKILL. `tlt_rollout()` refuses a sidecar that names no drafter-training plugin and a seed
that is not run.seed's, in one sentence.
"""

from __future__ import annotations

import glob
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import test_faults as faults
from process_checks import outlived
from recipe_overrides import small_run
from rich.console import Console

from tlt_cli.processes import run_preparation
from tlt_cli.shared_memory import SHARED_MEMORY_DIRECTORY
from tlt_cli.trace import read_trace

# a builder as torch's extension builder takes its lock (torch/utils/cpp_extension.py `_jit_compile`), then builds
BUILDER = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("building", flush=True)
time.sleep(600)
"""


def start_builder(lock: Path) -> subprocess.Popen:
    lock.parent.mkdir(parents=True, exist_ok=True)
    builder = subprocess.Popen([sys.executable, "-c", BUILDER, str(lock)], stdout=subprocess.PIPE, text=True)
    assert builder.stdout.readline().strip() == "building"
    return builder


def cleared(cache: Path) -> str:
    output = io.StringIO()
    run_preparation.remove_what_killed_runs_left(Console(file=output, width=400), cache)
    return output.getvalue()


def test_a_killed_builders_lock_is_removed_with_one_line_and_a_live_builders_is_kept(tmp_path):
    """A live build is waited for by the workers, under tlt's build lock (tests/test_faults_round7.py)."""
    cache = tmp_path / "cache"
    killed_lock = cache / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    live_lock = cache / "torch_extensions" / "another_op" / "lock"
    killed, live = start_builder(killed_lock), start_builder(live_lock)
    try:
        killed.send_signal(signal.SIGKILL)  # kill -9 during the op build: the lock stays
        killed.wait()
        assert killed_lock.exists()
        output = cleared(cache).splitlines()
        assert not killed_lock.exists() and live_lock.exists()
    finally:
        live.kill()
        live.wait()
    assert output == [f"removed the build lock {killed_lock} a killed run left (its builder is gone)"]


def test_a_cache_without_built_ops_is_cleared_without_a_word(tmp_path):
    assert "build lock" not in cleared(tmp_path / "no-cache-yet")


# a driver that spawns a worker as tlt train does (multiprocessing's spawn), then is killed while the worker imports
DRIVER = """
import multiprocessing, sys, time
from tlt_cli.processes.worker_process import exit_with_parent

def worker(ready):
    time.sleep(float(sys.argv[1]))  # still importing torch and transformers when the driver dies
    exit_with_parent(None)
    print("watching", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    process = multiprocessing.get_context("spawn").Process(target=worker, args=(None,))
    process.start()
    print(process.pid, flush=True)
    time.sleep(600)
"""


def test_a_worker_whose_driver_died_while_it_imported_exits(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    driver = subprocess.Popen([sys.executable, str(script), "3"], stdout=subprocess.PIPE, text=True)
    worker = int(driver.stdout.readline())
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert not outlived(worker, 30), "the worker outlived its killed driver by 27 s after its imports"


def test_the_next_run_removes_the_semaphores_a_killed_driver_left_and_keeps_held_ones(tmp_path):
    left = SHARED_MEMORY_DIRECTORY / f"sem.mp-tlt-test-{uuid.uuid4().hex[:8]}"
    held = SHARED_MEMORY_DIRECTORY / f"sem.mp-tlt-test-{uuid.uuid4().hex[:8]}"
    left.write_bytes(b"\0" * 32)
    held.write_bytes(b"\0" * 32)
    try:
        with held.open("rb"):  # a live process holds it open: a running driver's queue
            output = cleared(tmp_path / "cache")
            assert held.exists()
        assert not left.exists()
        assert "shared-memory file(s) a killed run left in /dev/shm" in output
    finally:
        left.unlink(missing_ok=True)
        held.unlink(missing_ok=True)


def kill_processes_working_in(folder: Path) -> None:
    """SIGKILL every process of this user whose working folder is under `folder` (a killed build's compilers)."""
    for entry in Path("/proc").iterdir():
        try:
            working = Path(os.readlink(entry / "cwd"))
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and working.is_relative_to(folder.resolve()):
            os.kill(int(entry.name), signal.SIGKILL)


@pytest.mark.slow
def test_a_first_run_killed_in_its_op_build_leaves_a_cache_the_next_run_trains_on(small_model, tmp_path):
    """kill -9 of a first run (driver and workers) while DeepSpeed builds its CPU op on a cold cache; the next run
    on that cache removes the lock in one line and reaches its step 0 (it waited forever on the lock before)."""
    cache = tmp_path / "cold-cache"
    locks = str(cache / "torch_extensions" / "**" / "lock")
    environment = faults.environment_with_test_plugins()
    first = small_run(small_model, tmp_path, "first", 1, f"model.cache_dir={cache}")
    with open(tmp_path / "first.out", "w") as stdout, open(tmp_path / "first.err", "w") as stderr:
        driver = subprocess.Popen(first, stdout=stdout, stderr=stderr, env=environment, start_new_session=True)
    try:
        faults.wait_until(lambda: glob.glob(locks, recursive=True), faults.HANG_GUARD_SECONDS, process=driver)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and its workers
        driver.wait()
        kill_processes_working_in(cache)  # ninja's compilers run in process groups of their own
    assert glob.glob(locks, recursive=True), "the build ended before the kill: the test killed late"
    second = subprocess.run(
        small_run(small_model, tmp_path, "second", 1, f"model.cache_dir={cache}"),
        capture_output=True,
        text=True,
        env=environment,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "a killed run left (its builder is gone)" in second.stdout
    assert [
        record["step"] for record in read_trace(tmp_path / "second" / "trace.jsonl") if record["type"] == "step"
    ] == [0]


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        ({"sidecar": ["os:system"]}, "sidecar names ['os:system'], none of them a plugin that trains the drafter"),
        ({"sidecar": "drafter_sidecar"}, "sidecar is 'drafter_sidecar'; give True, False or a list of plugin names."),
        ({"seed": "x"}, "seed is 'x'; give an integer in 0..4294967295"),
        ({"seed": -1}, "seed is -1; give an integer in 0..4294967295"),
        ({"seed": True}, "seed is True; give an integer"),
    ],
)
def test_tlt_rollout_refuses_a_sidecar_that_is_no_drafter_plugin_and_a_bad_seed(arguments, said):
    pytest.importorskip("trl")
    from tlt_cli.errors import UserError
    from tlt_cli.integrations.trl import tlt_rollout

    with pytest.raises(UserError) as raised:
        tlt_rollout(drafter="random", **arguments)
    assert str(raised.value).startswith(said) and "\n" not in str(raised.value), raised.value
    assert tlt_rollout(drafter="random", sidecar=["drafter_sidecar"], seed=7) is not None


def written_launch_files(tmp_path: Path, before_writing=lambda launch: None) -> Path:
    """write_launch_files of a one-node run into tmp_path/run (after `before_writing(launch folder)`); the folder."""
    from recipe_overrides import RECIPE

    from tlt_cli.config import Precision, SpeculativeSection, load_recipe
    from tlt_cli.processes.launch_files import LaunchPlan, write_launch_files
    from tlt_cli.processes.messages import RunSpec
    from tlt_cli.rollout.decode_plan import DecodePlan
    from tlt_cli.training.setup import speculative_plan
    from tlt_cli.tuning.run_plan import RunPlan, UpdatePrecision

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    launch = tmp_path / "run" / "launch"
    launch.mkdir(parents=True)
    before_writing(launch)
    plan = RunPlan(
        UpdatePrecision(Precision.fp32, "the recipe's"), DecodePlan("float32"), speculative_plan(SpeculativeSection())
    )
    recipe = load_recipe(RECIPE, [f"workers.hostfile={hostfile}"])
    run_spec = RunSpec(recipe=recipe, run_directory=tmp_path / "run", model_cache=tmp_path / "cache", plan=plan)
    return write_launch_files(run_spec, LaunchPlan("127.0.0.1", 29501, "00ff", "module:body"))


def test_launch_files_replace_links_planted_at_their_names_never_writing_through(tmp_path):
    targets = {name: tmp_path / f"a-users-{name}" for name in ("recipe.yaml", "hostfile")}

    def plant_links(launch: Path) -> None:
        for name, target in targets.items():
            target.write_text("a user's file\n")
            (launch / name).symlink_to(target)

    launch = written_launch_files(tmp_path, plant_links)
    for name, target in targets.items():
        assert target.read_text() == "a user's file\n" and not (launch / name).is_symlink(), name
    assert (launch / "hostfile").read_text() == "localhost slots=2\n"


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda written: "{not json", "is damaged or was written by another tlt version (format 1 expected)"),
        (lambda written: {**written, "version": 0}, "is damaged or was written by another tlt version"),
        (lambda written: {key: value for key, value in written.items() if key != "version"}, "another tlt version"),
        (lambda written: {**written, "run": {**written["run"], "start_step": "false"}}, "run.start_step is 'false'"),
        (lambda written: {**written, "run": {**written["run"], "start_step": True}}, "run.start_step is True"),
        (lambda written: {**written, "plan": {**written["plan"], "rendezvous_directory": 5}}, "rendezvous_directory"),
        (lambda written: {**written, "plan": {"driver_host": "x"}}, "'plan' does not hold exactly the fields"),
        (lambda written: {**written, "run": {**written["run"], "plan": {"update": 1}}}, "its run plan does not read"),
    ],
)
def test_a_damaged_or_other_version_driver_json_is_one_sentence_naming_it(tmp_path, damage, said):
    from tlt_cli.processes.launch_files import LaunchFileError, read_launch_files

    path = written_launch_files(tmp_path) / "driver.json"
    damaged = damage(json.loads(path.read_text()))
    path.write_text(damaged if isinstance(damaged, str) else json.dumps(damaged))
    with pytest.raises(LaunchFileError) as raised:
        read_launch_files(tmp_path / "run")
    message = str(raised.value)
    assert message.startswith(f"{path} is damaged") and said in message and "\n" not in message, message
