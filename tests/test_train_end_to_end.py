"""`tlt train` end to end on CPU: two real worker processes, DeepSpeed ZeRO-2, trace and checkpoints.

The fast test runs 2 steps; the slow one kills a run with SIGKILL mid-way, resumes it and checks it
ends with the same metrics as a run that was never killed.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from recipe_overrides import DETERMINISTIC, TLT, small_run

from tlt_cli.training.memory_parts import PART_NAMES
from tlt_cli.versions import installed_versions


def read_records(run_directory: Path, kind: str) -> list[dict]:
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] == kind]


def test_two_steps_write_trace_checkpoint_and_summary(small_model, tmp_path):
    result = subprocess.run(small_run(small_model, tmp_path, "two", 2), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "run summary" in result.stdout and str(tmp_path / "two") in result.stdout
    run_directory = tmp_path / "two"
    steps = read_records(run_directory, "step")
    assert [step["step"] for step in steps] == [0, 1]
    requests = read_records(run_directory, "request")
    assert len(requests) == 2 * 4 * 2 and {request["worker"] for request in requests} == {0, 1}
    workers = read_records(run_directory, "worker")
    assert len(workers) == 4 and all(worker["idle_seconds"] >= 0 for worker in workers)
    # each worker's resident peaks (GB) in the rollout and the update; the step carries the highest
    for step in steps:
        own = [worker for worker in workers if worker["step"] == step["step"]]
        peaks = [max(worker["memory_rollout_peak_gb"], worker["memory_update_peak_gb"]) for worker in own]
        assert min(peaks) > 0.1 and step["memory_peak_gb"] == max(peaks)
    assert "peak resident memory of a worker" in result.stdout
    # each worker's resident set at its step's end by part (tlt_cli/training/memory_parts.py), what malloc_trim gave
    # back after it, and no warning: the peak stays within the estimate
    for worker in workers:
        parts = {name: worker[f"memory_{name}_gb"] for name in PART_NAMES}
        assert parts["policy_weights"] > 0 and parts["optimizer"] > 0 and 0.1 < sum(parts.values()) < 10
        assert worker["memory_returned_gb"] > -0.05
    assert "passed the estimate" not in result.stdout
    # the slower worker of each step has no idle time; the other waits for it
    for step in (0, 1):
        idle = sorted(worker["idle_seconds"] for worker in workers if worker["step"] == step)
        assert idle[0] == 0.0
    assert (run_directory / "checkpoints" / "latest").read_text() == "step_000002"
    assert (run_directory / "recipe.yaml").is_file()
    (run,) = read_records(run_directory, "run")
    assert run["versions"] == installed_versions() and run["versions"]["transformers"]
    # each worker's rollout precision (rollout.dtype auto) and the figures that chose it, shown live as well
    precision = run["rollout_precision"]
    assert set(precision) == {"0", "1"} and precision["0"]["reason"] == "measured"
    assert precision["0"]["dtype"] in ("float32", "bfloat16") and set(precision["0"]["step_ms"]) == {
        "float32",
        "bfloat16",
    }
    # weighed for the batch each worker decodes: its 4 completions of a step
    assert precision["0"]["rows"] == 4 and set(precision["0"]["batch_step_ms"]) == {"float32", "bfloat16"}
    assert f"rollout dtype: {precision['0']['dtype']} (measured: float32 step" in result.stdout
    # the rollout/learner mismatch of every step: none when both decode and learn in float32 (the learner's own
    # policy, weights 1), small when either runs in bfloat16 (rollout.dtype, actor.precision: both auto)
    float32 = all(chosen["dtype"] == "float32" for chosen in precision.values())
    float32 = float32 and run["actor_precision"]["precision"] == "fp32"
    for step in steps:
        if float32:
            assert 0.0 <= step["actor_rollout_kl_k3"] < 1e-9 and step["actor_rollout_weight_truncated"] == 0.0
            assert 1 - 1e-4 < step["actor_rollout_weight_min"] <= step["actor_rollout_weight_max"] < 1 + 1e-4
        else:
            assert 0.0 < step["actor_rollout_kl_k3"] < 1e-2 and step["actor_rollout_weight_truncated"] < 0.05
    # the live rows hold the watched columns (the mismatch is behind --columns all); an SD-off run states no SD effect
    assert "resp tok" in result.stdout and "More columns: tlt train --columns all." in result.stdout
    assert "in this run" not in result.stdout
    profiled = subprocess.run([*TLT, "profile", str(run_directory), "--no-plots"], capture_output=True, text=True)
    assert profiled.returncode == 0 and f"rollout dtype: {precision['0']['dtype']} (measured" in profiled.stdout
    # actor.precision auto: measured on this machine, the choice and its figures in the run record and the log
    actor_precision = run["actor_precision"]
    assert actor_precision["precision"] in ("fp32", "bf16")
    assert set(actor_precision["micro_batch_seconds"]) == {"fp32", "bf16"}
    assert f"actor precision {actor_precision['precision']} (auto: measured on this machine" in result.stdout
    # the run's recipe keeps the recipe as given (auto), so a resume chooses again; the run record keeps what ran
    assert "precision: auto" in (run_directory / "recipe.yaml").read_text()


def test_a_second_run_with_the_same_name_is_refused(small_model, tmp_path):
    (tmp_path / "taken" / "checkpoints").mkdir(parents=True)
    result = subprocess.run(small_run(small_model, tmp_path, "taken", 2), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--resume" in result.stderr


@pytest.mark.slow
def test_sigkill_then_resume_ends_with_the_same_metrics(small_model, tmp_path):
    steps = 6
    reference = subprocess.run(
        small_run(small_model, tmp_path, "reference", steps), capture_output=True, text=True, timeout=900
    )
    assert reference.returncode == 0, reference.stderr[-3000:]

    killed = subprocess.Popen(
        small_run(small_model, tmp_path, "killed", steps),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    checkpoint = tmp_path / "killed" / "checkpoints" / "step_000004"
    deadline = time.time() + 600
    while not checkpoint.is_dir() and time.time() < deadline and killed.poll() is None:
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    assert checkpoint.is_dir(), "the run ended before it could be killed mid-way"

    resumed = subprocess.run(
        [*TLT, "train", "--resume", str(tmp_path / "killed")], capture_output=True, text=True, timeout=900
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = read_records(tmp_path / "reference", "step")
    actual = read_records(tmp_path / "killed", "step")
    assert [record["step"] for record in actual] == list(range(steps))
    for want, got in zip(expected, actual):
        for key in DETERMINISTIC:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (want["step"], key)
