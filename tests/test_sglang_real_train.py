"""`tlt train` with `rollout.backend: sglang` on a real SGLang 0.5.23 server on CPU, started, owned and
stopped by tlt: three steps with weights pushed from disk after each update, the trace's request records
against the embedded backend's, and the servers gone after Ctrl-C, SIGTERM and a worker killed mid-run.

Run: `pytest -m real_sglang tests/test_sglang_real_train.py` after scripts/build_sglang_cpu_env.py (skipped,
with the reason, without its environment). The actor stays on CPU (`colocated: false`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from recipe_overrides import small_run
from sglang_fakes import free_port_range, wait_for_first_generation
from sglang_real import SIDE_PYTHON, real_sglang_overrides, requires_real_sglang

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow, requires_real_sglang]

TESTS = Path(__file__).resolve().parent
SIGTERM_EXIT = 143


def train_command(model: Path, output: Path, name: str, steps: int, *extra: str) -> tuple[list[str], int]:
    """recipe_overrides.small_run made smaller (one worker, 2 prompts x 2 samples of 16 tokens, a checkpoint every
    3 steps), `extra` last; and the first of two free ports for its server."""
    smaller = ("workers.count=1", "train.prompts_per_step=2", "rollout.max_new_tokens=16", "checkpoint.every=3")
    return small_run(model, output, name, steps, *smaller, *extra), free_port_range(2)


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{TESTS.parent}", "OMP_NUM_THREADS": "1"}


def records(run_directory: Path, kind: str) -> list[dict]:
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def sglang_processes(port: int) -> list[int]:
    """Pids of live processes started from the side environment's Python for the server on `port`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and str(port).encode() in argv and any(b"sglang" in part for part in argv):
            found.append(int(entry.name))
    return found


def server_log(run_directory: Path) -> Path:
    return run_directory / "workers" / "worker-0" / "sglang" / "server-0.log"


def test_three_steps_on_a_real_server_trace_like_the_embedded_backend(small_model, tmp_path):
    command, port = train_command(small_model, tmp_path, "real", 3)
    command += [*real_sglang_overrides(port), "rollout.sglang.skip_tokenizer_init=false"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=environment())
    assert result.returncode == 0, result.stderr[-3000:]
    run_directory = tmp_path / "real"
    requests = records(run_directory, "request")
    assert len(requests) == 3 * 2 * 2 and {request["step"] for request in requests} == {0, 1, 2}
    assert all(request["end"] >= request["start"] and 1 <= request["tokens"] <= 16 for request in requests)
    assert all(isinstance(request["reward"], float) for request in requests)
    workers = records(run_directory, "worker")
    assert len(workers) == 3 and all(worker["weight_sync_seconds"] > 0 for worker in workers)
    log = server_log(run_directory).read_text()
    assert f"{SIDE_PYTHON} -m sglang.launch_server" in log and "--device cpu" in log
    assert log.count("POST /update_weights_from_disk") == 3 and "fired up" in log
    assert not sglang_processes(port), "an SGLang process outlived tlt train"
    assert not list((run_directory / "sglang-servers").glob("*.json"))

    embedded_command, _ = train_command(small_model, tmp_path, "embedded", 1)
    embedded = subprocess.run(embedded_command, capture_output=True, text=True, timeout=600, env=environment())
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    embedded_keys = {tuple(sorted(request)) for request in records(tmp_path / "embedded", "request")}
    assert {tuple(sorted(request)) for request in requests} == embedded_keys


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupting_tlt_train_stops_the_real_server(small_model, tmp_path, how):
    command, port = train_command(small_model, tmp_path, how, 50)
    run = subprocess.Popen(
        [*command, *real_sglang_overrides(port)],
        env=environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    wait_for_first_generation(run, server_log(tmp_path / how), 600)
    if how == "ctrl-c":
        os.killpg(run.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
    else:
        os.kill(run.pid, signal.SIGTERM)  # what a scheduler does: the trainer alone
    _, stderr = run.communicate(timeout=180)
    assert run.returncode == (130 if how == "ctrl-c" else SIGTERM_EXIT), stderr[-3000:]
    assert "Traceback" not in stderr
    assert not sglang_processes(port), "an SGLang process outlived tlt train"


def test_a_worker_killed_mid_run_leaves_no_real_server(small_model, tmp_path):
    command, port = train_command(
        small_model, tmp_path, "failing", 3, "plugins.enabled=[sglang_real_plugins:KillWorkerAfterFirstRollout]"
    )
    # --keep-log: the run fails before its first checkpoint, and its server log is read below
    result = subprocess.run(
        [*command, *real_sglang_overrides(port), "--keep-log"],
        capture_output=True,
        text=True,
        timeout=900,
        env=environment(),
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "worker 0 was killed by SIGKILL (code -9) without reporting an error" in result.stderr
    assert "POST /generate" in server_log(tmp_path / "failing").read_text()
    assert not sglang_processes(port), "an SGLang process outlived tlt train"
