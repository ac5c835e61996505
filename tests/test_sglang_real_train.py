"""`tlt train` with `rollout.backend: sglang` on a real SGLang 0.5.23 server on CPU, started, owned and
stopped by tlt: three steps with weights pushed from disk after each update, the trace's request records
against the embedded backend's (the same requests and prompts, fields of the same types, bounded values), and
every process of the servers gone after Ctrl-C, SIGTERM and a worker killed mid-run (found by a mark in the
run's environment, which SGLang's scheduler and detokenizer inherit but do not show on their command line), and
every file they made gone too: what their processes held in /dev/shm, and what SGLang makes in its temporary
folder (each run gets a temporary folder of its own, which must be empty at the end). After a SIGKILL of
`tlt train` itself, nothing outlives it to clean up: the next server start removes what the killed run left.

Run: `pytest -m real_sglang tests/test_sglang_real_train.py` after scripts/build_sglang_cpu_env.py (skipped,
with the reason, without its environment). The actor stays on CPU (`colocated: false`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from leaks import MARK_VARIABLE, tagged_processes
from recipe_overrides import small_run
from sglang_fakes import fake_launch, free_port_range, wait_for_first_generation
from sglang_real import (
    SIDE_PYTHON,
    RunWatch,
    real_sglang_overrides,
    requires_real_sglang,
    sglang_processes,
    sglang_shared_memory,
)

from tlt_cli.sglang.server import ServerGroup

pytestmark = [pytest.mark.real_sglang, pytest.mark.slow, requires_real_sglang]

TESTS = Path(__file__).resolve().parent
SIGTERM_EXIT = 143
# seconds a process of a run that ended gets to exit before it counts as a survivor
SURVIVOR_GRACE_SECONDS = 10.0


def train_command(model: Path, output: Path, name: str, steps: int, *extra: str) -> tuple[list[str], int]:
    """recipe_overrides.small_run made smaller (one worker, 2 prompts x 2 samples of 16 tokens, a checkpoint every
    3 steps), `extra` last; and the first of two free ports for its server."""
    smaller = ("workers.count=1", "train.prompts_per_step=2", "rollout.max_new_tokens=16", "checkpoint.every=3")
    return small_run(model, output, name, steps, *smaller, *extra), free_port_range(2)


def environment(mark: str, temporary_folder: Path | None = None) -> dict[str, str]:
    """The run's environment, tagged with `mark`: every process it starts (SGLang's children too) carries it; with
    `temporary_folder` as the system temporary folder (TMPDIR) of all of them."""
    folder = {"TMPDIR": str(temporary_folder)} if temporary_folder is not None else {}
    return {
        **os.environ,
        "PYTHONPATH": f"{TESTS}{os.pathsep}{TESTS.parent}",
        "OMP_NUM_THREADS": "1",
        MARK_VARIABLE: mark,
        **folder,
    }


@pytest.fixture
def run_temporary_folder(monkeypatch):
    """A system temporary folder for the run (short: SGLang makes Unix sockets in it), also this process's."""
    folder = Path(tempfile.mkdtemp(prefix="tlt-real-"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def watch_run(mark: str) -> RunWatch:
    """A watch of the run tagged with `mark`: its processes (SGLang's scheduler and detokenizer found as descendants)
    and what they hold in /dev/shm."""
    return RunWatch(lambda: tagged_processes(mark))


def assert_no_process_left(watch: RunWatch) -> None:
    """No process of the run (the watch saw SGLang's scheduler and detokenizer, so it could tell) still runs."""
    assert sglang_processes(watch.process_names()), f"the watch saw no SGLang child: {watch.process_names()}"
    assert not watch.survivors(SURVIVOR_GRACE_SECONDS), (
        f"processes of the run outlived it (SGLang's server, scheduler or detokenizer?): {watch.survivors(0)}"
    )


def assert_no_files_left(watch: RunWatch, temporary_folder: Path) -> None:
    """Nothing of the run's servers in /dev/shm (the watch saw SGLang's entries, so it could tell) nor in the run's
    temporary folder."""
    assert sglang_shared_memory(watch.seen_names()), f"the watch saw no SGLang entry: {watch.seen_names()}"
    assert not watch.left_shared_memory(), "/dev/shm entries of the run's SGLang processes outlived the run"
    assert sorted(temporary_folder.iterdir()) == [], "files in the run's temporary folder outlived the run"


def records(run_directory: Path, kind: str) -> list[dict]:
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def request_key(request: dict) -> tuple[int, int, int]:
    return request["step"], request["worker"], request["request_id"]


def server_log(run_directory: Path) -> Path:
    return run_directory / "workers" / "worker-0" / "sglang" / "server-0.log"


def test_three_steps_on_a_real_server_trace_like_the_embedded_backend(small_model, tmp_path, run_temporary_folder):
    command, port = train_command(small_model, tmp_path, "real", 3)
    command += [*real_sglang_overrides(port), "rollout.sglang.skip_tokenizer_init=false"]
    mark = uuid.uuid4().hex
    with watch_run(mark) as watch:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=900, env=environment(mark, run_temporary_folder)
        )
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
    assert_no_process_left(watch)
    assert not list((run_directory / "sglang-servers").glob("*.json"))
    assert_no_files_left(watch, run_temporary_folder)

    embedded_command, _ = train_command(small_model, tmp_path, "embedded", 1)
    embedded = subprocess.run(
        embedded_command, capture_output=True, text=True, timeout=600, env=environment(uuid.uuid4().hex)
    )
    assert embedded.returncode == 0, embedded.stderr[-3000:]
    # step 0 of both: the same requests of the same prompts, each field of the same type, no speculation counted;
    # the sampled tokens differ (another engine's random stream), so their count and reward are only bounded
    embedded_requests = {request_key(request): request for request in records(tmp_path / "embedded", "request")}
    served_requests = {request_key(request): request for request in requests if request["step"] == 0}
    assert served_requests.keys() == embedded_requests.keys()
    for key, served in served_requests.items():
        expected = embedded_requests[key]
        assert {name: type(value) for name, value in served.items()} == {
            name: type(value) for name, value in expected.items()
        }, key
        for same in ("prompt_tokens", "verify_passes", "accepted_tokens", "accepted_by_depth", "proposed_by_depth"):
            assert served[same] == expected[same], (key, same)
        assert 1 <= served["tokens"] <= 16 and 0.0 <= served["reward"] <= 1.0, served
        assert served["finished_by_eos"] or served["tokens"] == 16, served


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_interrupting_tlt_train_stops_the_real_server(small_model, tmp_path, run_temporary_folder, how):
    command, port = train_command(small_model, tmp_path, how, 50)
    mark = uuid.uuid4().hex
    with watch_run(mark) as watch:
        run = start_run([*command, *real_sglang_overrides(port)], mark, run_temporary_folder)
        wait_for_first_generation(run, server_log(tmp_path / how), 600)
        if how == "ctrl-c":
            os.killpg(run.pid, signal.SIGINT)  # what a terminal does: the whole foreground group
        else:
            os.kill(run.pid, signal.SIGTERM)  # what a scheduler does: the trainer alone
        _, stderr = run.communicate(timeout=180)
    assert run.returncode == (130 if how == "ctrl-c" else SIGTERM_EXIT), stderr[-3000:]
    assert "Traceback" not in stderr
    assert_no_process_left(watch)
    assert_no_files_left(watch, run_temporary_folder)


def start_run(command: list[str], mark: str, temporary_folder: Path) -> subprocess.Popen:
    """`tlt train` in a session of its own (as from a terminal), its output piped."""
    return subprocess.Popen(
        command,
        env=environment(mark, temporary_folder),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_after_a_sigkill_of_tlt_train_the_next_server_start_removes_what_its_servers_left(
    small_model, tmp_path, run_temporary_folder
):
    """SIGKILL of the trainer: its worker exits with it, and the servers get SIGTERM from Linux (their starter's
    parent-death signal); no process of the run may stay, and what the servers left is removed by the next server
    start (a fake server here: the removal is the start's, whatever it serves)."""
    command, port = train_command(small_model, tmp_path, "killed", 50)
    mark = uuid.uuid4().hex
    with watch_run(mark) as watch:
        run = start_run([*command, *real_sglang_overrides(port)], mark, run_temporary_folder)
        wait_for_first_generation(run, server_log(tmp_path / "killed"), 600)
        os.kill(run.pid, signal.SIGKILL)
        run.communicate(timeout=60)
    assert_no_process_left(watch)
    assert watch.left_shared_memory() and list(run_temporary_folder.iterdir()), (
        "nothing was left to remove: the test cannot tell"
    )
    with ServerGroup([fake_launch(0, tmp_path / "next")], startup_timeout_s=20, stop_timeout_s=5):
        pass
    assert_no_files_left(watch, run_temporary_folder)


def test_a_worker_killed_mid_run_leaves_no_real_server_and_no_file_of_it(small_model, tmp_path, run_temporary_folder):
    command, port = train_command(
        small_model, tmp_path, "failing", 3, "plugins.enabled=[sglang_real_plugins:KillWorkerAfterFirstRollout]"
    )
    mark = uuid.uuid4().hex
    # --keep-log: the run fails before its first checkpoint, and its server log is read below
    with watch_run(mark) as watch:
        result = subprocess.run(
            [*command, *real_sglang_overrides(port), "--keep-log"],
            capture_output=True,
            text=True,
            timeout=900,
            env=environment(mark, run_temporary_folder),
        )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "worker 0 was killed by SIGKILL (code -9) without reporting an error" in result.stderr
    assert "POST /generate" in server_log(tmp_path / "failing").read_text()
    assert_no_process_left(watch)
    assert_no_files_left(watch, run_temporary_folder)
