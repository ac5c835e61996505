"""`tlt train` with `workers.hostfile` on CPU: the ranks run under the real DeepSpeed launcher.

A one-host hostfile (`localhost slots=2`) with `actor.devices: cpu` takes DeepSpeed's local launch
path, the same driver, event channel and rank entry point as several nodes, without ssh. Checked:
a 2-step run (trace records of both ranks, checkpoint, exit 0) and its resume (slow); a rank that
raises and ranks that die silently (one line, exit 1, no process left, within a timeout); Ctrl-C
(exit 130); stand-in SGLang servers owned by the launched ranks (slow); hostfile mistakes (one
line naming the key, exit 2); the event channel on its own; the driver's RunSpec, read back whole
from the launch files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from recipe_overrides import RECIPE, TLT, small_run
from sglang_fakes import free_port_range, write_stand_in_sglang
from typer.testing import CliRunner

from tlt_cli.cli import LOADING_LINE, app
from tlt_cli.config import Precision, SpeculativeMode, SpeculativeSection, load_recipe
from tlt_cli.processes.distributed import WorkerAddress
from tlt_cli.processes.event_channel import EventListener, connect_to_driver
from tlt_cli.processes.hostfile import deepspeed_launch_command
from tlt_cli.processes.launch_files import LaunchPlan, read_launch_files, write_launch_files
from tlt_cli.processes.messages import RunSpec
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.sglang.server import live_group_members
from tlt_cli.shared_memory import DEEPSPEED_BUFFER_PREFIX, SHARED_MEMORY_DIRECTORY, rank_buffer
from tlt_cli.training.setup import speculative_plan
from tlt_cli.tuning.run_plan import RunPlan, UpdatePrecision

TESTS = Path(__file__).resolve().parent
# no test waits longer than this for tlt train to end
RUN_TIMEOUT_SECONDS = 240
runner = CliRunner()


@pytest.fixture()
def hostfile(tmp_path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# this machine, two CPU ranks\nlocalhost slots=2\n")
    return path


def hostfile_run(model: Path, hostfile: Path, output: Path, name: str, steps: int, *extra: str) -> list[str]:
    return small_run(model, output, name, steps, f"workers.hostfile={hostfile}", *extra)


def records(run_directory: Path, kind: str) -> list[dict]:
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def processes_of(run_directory: Path) -> list[psutil.Process]:
    """Live processes (launcher, per-node launcher, ranks) whose command line names the run directory."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        command = " ".join(process.info["cmdline"] or [])
        if str(run_directory) in command and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(process)
    return found


def test_one_host_launches_locally_without_ssh(hostfile, tmp_path):
    recipe = load_recipe(RECIPE, [f"workers.hostfile={hostfile}"])
    assert deepspeed_launch_command(recipe, tmp_path / "run", 29500) == [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--master_port",
        "29500",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--no_local_rank",
        "--module",
        "tlt_cli.processes.launched_rank",
        str(tmp_path / "run"),
    ]


def test_a_launched_rank_reads_back_the_run_spec_the_driver_wrote(hostfile, tmp_path):
    """launch_files.py carries the driver's RunSpec to a rank whole, its run plan included (an adaptive rule table's
    unbounded ranges too); its recipe names the launch's hostfile copy."""
    folder = tmp_path.resolve()
    run_plan = RunPlan(
        UpdatePrecision(Precision.bf16, "auto: measured on this machine", {"fp32": 0.5, "bf16": 0.25}),
        DecodePlan("bfloat16", precision={"dtype": "bfloat16", "reason": "measured"}, log_lines=("rollout dtype",)),
        speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive)),
    )
    run_spec = RunSpec(
        recipe=load_recipe(RECIPE, [f"workers.hostfile={hostfile}"]),
        run_directory=folder / "run",
        model_cache=folder / "cache",
        resume_from=folder / "run" / "checkpoints" / "step-2",
        start_step=2,
        plan=run_plan,
    )
    plan = LaunchPlan("127.0.0.1", 29501, "00ff", "tlt_cli.training.worker_loop:worker_main", str(folder / "meet"))
    launch = write_launch_files(run_spec, plan)

    read_spec, read_plan = read_launch_files(run_spec.run_directory)
    assert read_plan == plan
    assert read_spec.recipe.workers.hostfile == str(launch / "hostfile")
    assert dataclasses.replace(read_spec, recipe=run_spec.recipe) == run_spec
    address = WorkerAddress(1, 2, master_port=29500)
    worker_spec = read_spec.for_rank(address)
    assert worker_spec.address == address
    shared = [field.name for field in dataclasses.fields(RunSpec)]
    assert [getattr(worker_spec, name) for name in shared] == [getattr(read_spec, name) for name in shared]


HOSTFILE_MISTAKES = {
    "missing": (None, [], "workers.hostfile: {hostfile} does not exist"),
    "malformed line": ("localhost slots=2\nnode-b 4\n", [], "line 2 must read '<host> slots=<n>'"),
    "zero slots": ("localhost slots=0\n", [], "line 1 must read '<host> slots=<n>' with n >= 1"),
    "slots do not give workers.count": ("localhost slots=3\n", [], "workers.count must be 3 (the slots of {hostfile}"),
    "uneven cpu slots": ("node-a slots=1\nnode-b slots=3\n", ["workers.count=4"], "gives hosts different slots"),
    "gpu missing on a node": (
        "node-a slots=2\nnode-b slots=1\n",
        ["actor.devices=[0,1]", "workers.count=4"],
        "gives node-b slots=1, but actor.devices uses GPU 1",
    ),
}


@pytest.mark.parametrize("name", list(HOSTFILE_MISTAKES))
def test_hostfile_mistakes_are_one_line_naming_the_key_and_exit_2(name, tmp_path):
    content, overrides, expected = HOSTFILE_MISTAKES[name]
    hostfile = tmp_path / "hostfile"
    if content is not None:
        hostfile.write_text(content)
    result = runner.invoke(
        app, ["train", str(RECIPE), f"workers.hostfile={hostfile}", f"run.output_dir={tmp_path}", *overrides]
    )
    assert result.exit_code == 2, result.output
    refusal = result.output.replace(LOADING_LINE + "\n", "")  # `tlt train`'s line before its heavy imports
    assert "Traceback" not in result.output and len(refusal.strip().splitlines()) == 1, result.output
    assert "workers" in result.output and expected.format(hostfile=hostfile) in result.output.replace("\n", "")


def deepspeed_shared_buffers() -> set[Path]:
    return set(SHARED_MEMORY_DIRECTORY.glob(f"{DEEPSPEED_BUFFER_PREFIX}_*"))


def test_two_steps_with_the_deepspeed_launcher(small_model, hostfile, tmp_path):
    run_directory = tmp_path / "launched"
    buffers_before = deepspeed_shared_buffers()
    result = subprocess.run(
        hostfile_run(small_model, hostfile, tmp_path, "launched", 2),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run summary" in result.stdout and "step 1" in result.stdout
    assert [step["step"] for step in records(run_directory, "step")] == [0, 1]
    requests = records(run_directory, "request")
    assert len(requests) == 2 * 4 * 2 and {request["worker"] for request in requests} == {0, 1}
    assert sorted((worker["step"], worker["worker"]) for worker in records(run_directory, "worker")) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    assert (run_directory / "checkpoints" / "latest").read_text() == "step_000002"
    launcher_log = (run_directory / "workers" / "launcher.log").read_text()
    assert "deepspeed.launcher.launch" in launcher_log
    assert launcher_log.count("-m', 'tlt_cli.processes.launched_rank'") == 2
    assert stat.S_IMODE((run_directory / "launch" / "driver.json").stat().st_mode) == 0o600
    assert not processes_of(run_directory)
    assert deepspeed_shared_buffers() <= buffers_before  # each rank unlinked its DeepSpeed all-reduce buffer


def test_a_launched_rank_names_the_buffer_deepspeed_maps_only_when_all_ranks_share_the_node():
    environment = {
        "LOCAL_SIZE": "2",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "RANK": "1",
    }
    expected = f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_29500_1"
    assert rank_buffer(environment) == SHARED_MEMORY_DIRECTORY / expected
    assert rank_buffer({**environment, "LOCAL_SIZE": "1"}) is None
    assert rank_buffer({key: value for key, value in environment.items() if key != "LOCAL_SIZE"}) is None


@pytest.mark.slow
def test_resume_with_the_deepspeed_launcher(small_model, hostfile, tmp_path):
    run_directory = tmp_path / "resumed"
    first = subprocess.run(
        hostfile_run(small_model, hostfile, tmp_path, "resumed", 2),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = subprocess.run(
        [*TLT, "train", "--resume", str(run_directory), "train.steps=3"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [step["step"] for step in records(run_directory, "step")] == [0, 1, 2]
    assert (run_directory / "checkpoints" / "latest").read_text() == "step_000003"
    assert not processes_of(run_directory)


@pytest.mark.slow
def test_launched_ranks_own_their_sglang_servers_and_leave_none(small_model, hostfile, tmp_path):
    run_directory = tmp_path / "sglang"
    port_base = free_port_range(4)
    command = hostfile_run(
        small_model,
        hostfile,
        tmp_path,
        "sglang",
        2,
        "rollout.max_new_tokens=12",
        "rollout.backend=sglang",
        "rollout.sglang.gpus=[0,1,2,3]",
        "rollout.sglang.colocated=false",
        f"rollout.sglang.port_base={port_base}",
        "rollout.sglang.startup_timeout_s=60",
        "rollout.sglang.stop_timeout_s=5",
    )
    site = write_stand_in_sglang(tmp_path / "site")
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_SECONDS, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {request["worker"] for request in records(run_directory, "request")} == {0, 1}
    # rank r (local index r of the one node) owns servers 2r and 2r+1 and their ports
    server_pids = []
    for worker in (0, 1):
        for server in (0, 1):
            log = (run_directory / "workers" / f"worker-{worker}" / "sglang" / f"server-{server}.log").read_text()
            assert f"--port {port_base + 2 * (2 * worker + server)} " in log
            server_pids += [
                int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "fake-sglang: server pid" in line
            ]
    assert len(server_pids) == 4 and not any(live_group_members(pid) for pid in server_pids)
    assert not processes_of(run_directory)


@pytest.mark.parametrize(
    "plugin, expected",
    [
        ("RaiseOnRankOne", "error: worker 1 failed: RuntimeError: rank 1 was told to fail"),
        ("ExitOnEveryRank", "error: the DeepSpeed launcher exited with code 3 before rank(s) 0, 1 finished"),
    ],
)
def test_a_failing_rank_is_one_line_exit_1_and_leaves_no_process_or_run(
    plugin, expected, small_model, hostfile, tmp_path
):
    run_directory = tmp_path / "failing"
    command = hostfile_run(
        small_model, hostfile, tmp_path, "failing", 2, f"plugins.enabled=[rank_failure_plugins:{plugin}]"
    )
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    first_line = result.stderr.strip().splitlines()[0]
    assert first_line.startswith(expected), result.stderr[-3000:]
    # it failed before its first step: nothing to resume, so the run directory is gone
    assert "Traceback" not in result.stderr and "--keep-log" in result.stderr
    assert not run_directory.exists() and not processes_of(run_directory)


def test_ctrl_c_stops_every_rank_and_exits_130(small_model, hostfile, tmp_path):
    run_directory = tmp_path / "interrupted"
    driver = subprocess.Popen(
        hostfile_run(small_model, hostfile, tmp_path, "interrupted", 50),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + RUN_TIMEOUT_SECONDS
    while time.time() < deadline and driver.poll() is None and not _has_step(run_directory):
        time.sleep(0.2)
    driver.send_signal(signal.SIGINT)
    _, stderr = driver.communicate(timeout=RUN_TIMEOUT_SECONDS)
    assert driver.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert not processes_of(run_directory)


def test_event_channel_delivers_in_order_rejects_strangers_and_ends_ranks_when_closed(tmp_path):
    listener = EventListener("127.0.0.1", b"secret of the run")
    rank = connect_to_driver("127.0.0.1", listener.port, b"secret of the run")
    for number in range(3):
        rank.put({"event": number})
    assert [listener.get(timeout=10) for _ in range(3)] == [{"event": number} for number in range(3)]
    with pytest.raises(
        ConnectionError, match=f"cannot reach the tlt train driver's event channel at 127.0.0.1:{listener.port}"
    ):
        connect_to_driver("127.0.0.1", listener.port, b"another secret")
    rank.close()
    listener.wait_for_senders(timeout=10)
    assert not listener.pending()

    # a rank in another process exits as soon as the driver closes the channel
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from tlt_cli.processes.event_channel import connect_to_driver; "
                f"connect_to_driver('127.0.0.1', {listener.port}, b'secret of the run').put('ready'); "
                "time.sleep(60); sys.exit(0)"
            ),
        ]
    )
    assert listener.get(timeout=60) == "ready"
    listener.close()
    assert child.wait(timeout=30) == 1


def _has_step(run_directory: Path) -> bool:
    trace = run_directory / "trace.jsonl"
    return trace.is_file() and '"type":"step"' in trace.read_text()
