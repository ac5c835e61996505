"""Run-directory files: atomic checkpoints, resume discovery, and the trace reader/truncation."""

import json

import pytest

from tlt_cli.checkpoint import CheckpointError, latest_checkpoint, prepare_staging, publish
from tlt_cli.config import MAX_STEPS
from tlt_cli.profile.records import ProfileInputError, load_records
from tlt_cli.trace import TraceError, TraceWriter, numbered_records, read_trace, request_record, truncate_trace


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


def test_checkpoints_past_a_million_steps_order_by_number_and_resume_from_the_newest(tmp_path):
    """step_1000000 is one digit wider than step_999995: pruning and resume go by the number, not the name's text."""
    checkpoints = tmp_path / "checkpoints"
    for step in (999_990, 999_995, 1_000_000):
        _checkpoint(checkpoints, step)
    assert sorted(path.name for path in checkpoints.glob("step_*")) == ["step_1000000", "step_999995"]
    assert latest_checkpoint(tmp_path).next_step == 1_000_000
    (checkpoints / "latest").write_text("step_1000005")  # names a checkpoint that is not there: the newest is used
    assert latest_checkpoint(tmp_path).directory.name == "step_1000000"
    _checkpoint(checkpoints, MAX_STEPS)
    assert latest_checkpoint(tmp_path).next_step == MAX_STEPS


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
    with pytest.raises(TraceError, match="line 1 is not a JSON object"):
        read_trace(path)
    path.write_text('{"step": 0}\n')
    with pytest.raises(TraceError, match="line 1 is not a trace record"):
        read_trace(path)
    path.write_bytes(b'{"type": "run"}\n{"type": "st\xc3\x28ep"}\n')
    with pytest.raises(TraceError, match="line 2 is not UTF-8 text"):
        read_trace(path)


def test_trace_and_profile_read_jsonl_through_one_reader(tmp_path):
    """read_trace and `tlt profile` share numbered_records: the same lines and messages, each its own error type."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"type": "run", "world_size": 1}\n\n{"type": "step", "st')
    with pytest.raises(TraceError) as from_trace:
        read_trace(path)
    with pytest.raises(ProfileInputError) as from_profile:
        load_records(path)
    assert (
        str(from_trace.value)
        == str(from_profile.value)
        == (
            f"{path} line 3 (the last) is cut short (Unterminated string starting at): the file is truncated; "
            "wait for the run to write it, or delete that line."
        )
    )
    path.write_text('{"type": "run", "world_size": 1}\n\n{"type": "step", "step": 0}\n')
    assert list(numbered_records(path)) == [(1, {"type": "run", "world_size": 1}), (3, {"type": "step", "step": 0})]


def test_request_records_have_one_builder_and_read_back(tmp_path):
    """The native worker loop and the TRL worker build request records with trace.request_record."""
    native = request_record(
        step=0,
        worker=1,
        request_id=3,
        start=10.0,
        end=12.5,
        prompt_tokens=7,
        tokens=9,
        reward=1.0,
        finished_by_eos=True,
        verify_passes=4,
        accepted_tokens=5,
        accepted_by_depth=(3, 2),
        proposed_by_depth=(4, 3),
    )
    # TRL's own generation counts no SD: zeros and empty lists, the same keys in the same order
    trl = request_record(
        step=0,
        worker=0,
        request_id=0,
        start=10.0,
        end=11.0,
        prompt_tokens=7,
        tokens=4,
        reward=0.0,
        finished_by_eos=False,
    )
    assert (
        list(native)
        == list(trl)
        == [
            "type",
            "step",
            "worker",
            "request_id",
            "start",
            "end",
            "prompt_tokens",
            "tokens",
            "reward",
            "finished_by_eos",
            "verify_passes",
            "accepted_tokens",
            "accepted_by_depth",
            "proposed_by_depth",
        ]
    )
    assert (native["accepted_by_depth"], trl["verify_passes"], trl["proposed_by_depth"]) == ([3, 2], 0, [])
    path = tmp_path / "trace.jsonl"
    writer = TraceWriter(path)
    for record in (native, trl):
        writer.write(record)
    writer.close()
    assert read_trace(path) == [native, trl]
