"""Run-directory files: atomic checkpoints, resume discovery, and the trace reader/truncation."""

import json

import pytest

from tlt_cli.checkpoint import CheckpointError, latest_checkpoint, prepare_staging, publish
from tlt_cli.trace import TraceError, TraceWriter, read_trace, truncate_trace


def _checkpoint(checkpoints, next_step, keep=2):
    staging = prepare_staging(checkpoints, next_step)
    (staging / "weights.bin").write_bytes(b"w" * next_step)
    return publish(checkpoints, next_step, {"world_size": 2}, keep=keep)


def test_publish_makes_latest_point_at_a_complete_checkpoint_and_prunes(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for step in (5, 10, 15):
        _checkpoint(checkpoints, step)
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.directory.name == "step_000015" and checkpoint.warning is None
    assert checkpoint.state["next_step"] == 15 and checkpoint.state["world_size"] == 2
    assert sorted(path.name for path in checkpoints.glob("step_*")) == ["step_000010", "step_000015"]


def test_a_killed_save_leaves_the_previous_checkpoint_in_charge(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    _checkpoint(checkpoints, 5)
    staging = prepare_staging(checkpoints, 10)  # killed before publish
    (staging / "weights.bin").write_bytes(b"partial")
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.directory.name == "step_000005" and checkpoint.next_step == 5
    # the next attempt starts from an empty staging folder
    assert list(prepare_staging(checkpoints, 10).iterdir()) == []


def test_resume_without_checkpoints_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint to resume"):
        latest_checkpoint(tmp_path)


def test_trace_round_trip_and_truncation_for_resume(tmp_path):
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path)
    writer.write({"type": "run", "name": "x"})
    for step in range(4):
        writer.write({"type": "step", "step": step, "mean_reward": step / 10})
    writer.close()
    with path.open("a") as handle:
        handle.write('{"type": "step", "st')  # a line cut short by SIGKILL
    truncate_trace(path, first_dropped_step=2)
    records = read_trace(path)
    assert [record.get("step") for record in records] == [None, 0, 1]


def test_bad_trace_lines_name_the_line(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"type": "run"}) + "\nnot json\n")
    with pytest.raises(TraceError, match="line 2"):
        read_trace(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(TraceError, match="line 1 is not a trace record"):
        read_trace(path)
