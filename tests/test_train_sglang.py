"""`tlt train` with `rollout.backend: sglang` end to end on CPU, against stand-in SGLang servers.

A stand-in `sglang` package on PYTHONPATH (tests/sglang_fakes.py) makes `python -m
sglang.launch_server` run tests/sglang_fake_server.py, a real HTTP server process. The actor stays
on CPU and weights go to the servers through a checkpoint on disk (`colocated: false`), the path
that needs no CUDA. Each run checks that no server process outlives `tlt train`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from recipe_overrides import PLAIN_DECODING, RECIPE, TLT
from sglang_fakes import FAKE_ARGUMENTS_VARIABLE, free_port_range, wait_for_first_generation, write_stand_in_sglang

from tlt_cli.sglang.server import live_group_members


@pytest.fixture()
def sglang_environment(tmp_path) -> dict[str, str]:
    site = write_stand_in_sglang(tmp_path / "site")
    # the stand-in first; the caller's own path after it (a worktree's tlt_cli over the installed one)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}


def sglang_run(model: Path, output: Path, name: str, workers: int, servers: int, *extra: str) -> list[str]:
    gpus = ",".join(str(gpu) for gpu in range(servers))
    return [
        *TLT,
        "train",
        str(RECIPE),
        f"model.path={model}",
        *PLAIN_DECODING,
        f"run.output_dir={output}",
        f"run.name={name}",
        "train.steps=2",
        f"workers.count={workers}",
        f"train.prompts_per_step={2 * workers}",
        "train.group_size=2",
        "rollout.max_new_tokens=12",
        "checkpoint.every=2",
        "rollout.backend=sglang",
        f"rollout.sglang.gpus=[{gpus}]",
        "rollout.sglang.colocated=false",
        f"rollout.sglang.port_base={free_port_range(2 * servers)}",
        "rollout.sglang.startup_timeout_s=60",
        "rollout.sglang.stop_timeout_s=5",
        *extra,
    ]


def server_pids(run_directory: Path) -> list[int]:
    """Pids of the (stand-in) server processes, as each logged it; each leads its own process group."""
    logs = sorted(run_directory.glob("workers/worker-*/sglang/server-*.log"))
    return [int(match) for log in logs for match in re.findall(r"fake-sglang: server pid (\d+)", log.read_text())]


def assert_no_server_left(run_directory: Path, expected: int) -> None:
    pids = server_pids(run_directory)
    assert len(pids) == expected, pids
    assert not any(live_group_members(pid) for pid in pids), "a server process outlived tlt train"


def read_records(run_directory: Path, kind: str) -> list[dict]:
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def test_two_steps_on_sglang_servers_trace_requests_sync_weights_and_stop_servers(
    small_model, tmp_path, sglang_environment
):
    command = sglang_run(small_model, tmp_path, "two", 2, 4)
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=sglang_environment)
    assert result.returncode == 0, result.stderr[-3000:]
    run_directory = tmp_path / "two"
    requests = read_records(run_directory, "request")
    assert len(requests) == 2 * 4 * 2 and {request["worker"] for request in requests} == {0, 1}
    # the fake server answers every request with 12 tokens or stops after 4, and reports SD counts
    assert all(request["tokens"] in (4, 12) and request["verify_passes"] >= 1 for request in requests)
    assert all(request["end"] >= request["start"] for request in requests)
    workers = read_records(run_directory, "worker")
    assert len(workers) == 4 and all(
        worker["weight_sync_seconds"] > 0 and worker["probe_accept_length"] == 3.0 for worker in workers
    )
    assert read_records(run_directory, "step")[-1]["accept_length"] == 3.0
    # the servers' log-probs (canned, -0.1 per position) are not the learner's: the mismatch is measured, the
    # weights pi_old / pi_rollout of the fake tokens under the real policy are mostly truncated
    for step in read_records(run_directory, "step"):
        assert step["actor_rollout_kl_k3"] > 0.1 and step["actor_rollout_weight_min"] < 1.0
    # worker r owns servers 2r and 2r+1 of the four, each updated from disk after both steps
    for worker in (0, 1):
        for server in (0, 1):
            log = (run_directory / "workers" / f"worker-{worker}" / "sglang" / f"server-{server}.log").read_text()
            assert f"--port {_port_of(command, 2 * worker + server)} " in log
            assert log.count("POST /update_weights_from_disk") == 2
    assert_no_server_left(run_directory, expected=4)
    assert not list((run_directory / "sglang-servers").glob("*.json"))


def _port_of(command: list[str], server: int) -> int:
    port_base = int(
        next(argument for argument in command if argument.startswith("rollout.sglang.port_base=")).split("=")[1]
    )
    return port_base + 2 * server


def test_a_server_that_crashes_at_start_is_one_error_with_its_log_tail(small_model, tmp_path, sglang_environment):
    environment = {**sglang_environment, FAKE_ARGUMENTS_VARIABLE: "--mode crash"}
    # --keep-log: the run fails before its first step, and the servers' logs name their pids
    result = subprocess.run(
        [*sglang_run(small_model, tmp_path, "crash", 1, 2), "--keep-log"],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    first_line = result.stderr.strip().splitlines()[0]
    assert "worker 0 failed: ServerStartError: SGLang server" in first_line and "while starting" in first_line
    assert "CUDA out of memory (fake crash for the tests)" in result.stderr and "Traceback" not in result.stderr
    assert_no_server_left(tmp_path / "crash", expected=2)


def test_ctrl_c_stops_the_run_and_its_servers(small_model, tmp_path, sglang_environment):
    # 50 steps of a second or more each: the run is far from done when interrupted
    run = subprocess.Popen(
        sglang_run(small_model, tmp_path, "interrupted", 1, 1, "train.steps=50"),
        env=sglang_environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    log = tmp_path / "interrupted" / "workers" / "worker-0" / "sglang" / "server-0.log"
    wait_for_first_generation(run, log, 300)
    # what a terminal does on Ctrl-C: SIGINT to the whole foreground process group
    os.killpg(run.pid, signal.SIGINT)
    _, stderr = run.communicate(timeout=120)
    assert run.returncode == 130 and "interrupted" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert_no_server_left(tmp_path / "interrupted", expected=1)
