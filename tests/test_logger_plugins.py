"""The plugins tlt ships, run as a user runs them: TensorBoard and W&B logs read back with their own readers.

One `tlt train` of the tiny recipe with the drafter sidecar, both loggers and a logger that raises:
the TensorBoard event file (read with TensorBoard's EventAccumulator) and the W&B offline run
(its .wandb file parsed into wandb's own protobuf records) hold each step record's numbers, and
the raising logger costs one warning, not the run. Then the core without the plugins package:
a run without plugins trains, a recipe naming one is refused in one sentence.
"""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

from recipe_overrides import small_run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

TESTS = Path(__file__).resolve().parent
# the .wandb file is a LevelDB-style log: a 7-byte file header, then 32 KiB blocks of records,
# each with a 7-byte header (checksum, length, kind) holding one protobuf Record or a piece of one
WANDB_FILE_HEADER = struct.Struct("<4sHB")
WANDB_RECORD_HEADER = struct.Struct("<IHB")
WANDB_BLOCK = 32768
WANDB_WHOLE, WANDB_LAST = 1, 4


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a W&B offline run's .wandb file, as wandb's own protobuf messages."""
    data = path.read_bytes()
    assert WANDB_FILE_HEADER.unpack(data[: WANDB_FILE_HEADER.size])[0] == b":W&B"
    records, position, pieces = [], WANDB_FILE_HEADER.size, b""
    while position + WANDB_RECORD_HEADER.size <= len(data):
        left_in_block = WANDB_BLOCK - position % WANDB_BLOCK
        if left_in_block < WANDB_RECORD_HEADER.size:  # the rest of a block too short for a header is padding
            position += left_in_block
            continue
        _, length, kind = WANDB_RECORD_HEADER.unpack(data[position : position + WANDB_RECORD_HEADER.size])
        position += WANDB_RECORD_HEADER.size
        pieces += data[position : position + length]
        position += length
        if kind in (WANDB_WHOLE, WANDB_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def plugin_environment(tmp_path: Path) -> dict[str, str]:
    """The test plugins importable, W&B left to its default (offline) and kept in tmp_path."""
    environment = {
        key: value for key, value in os.environ.items() if not key.startswith("WANDB_") or key == "WANDB_SILENT"
    }
    environment.update(
        PYTHONPATH=os.pathsep.join([str(TESTS), environment.get("PYTHONPATH", "")]),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
    )
    return environment


def test_tensorboard_and_wandb_log_every_step_and_a_failing_logger_costs_one_warning(tmp_path, small_model):
    command = small_run(
        small_model,
        tmp_path,
        "logged",
        2,
        "plugins.enabled=[drafter_sidecar,tensorboard,wandb,plugins_for_tests:FailingLogger]",
        "drafter.init=random",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=plugin_environment(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    warnings = [line for line in result.stdout.splitlines() if "plugin plugins_for_tests:FailingLogger" in line]
    assert len(warnings) == 1 and "OSError: logger backend unreachable at step 0" in warnings[0], warnings
    run_directory = tmp_path / "logged"
    trace = [json.loads(line) for line in (run_directory / "trace.jsonl").read_text().splitlines()]
    steps = [record for record in trace if record["type"] == "step"]
    assert [step["step"] for step in steps] == [0, 1] and "drafter_steps" in steps[0]

    events = EventAccumulator(str(run_directory / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for key in ("mean_reward", "response_length_p50", "rollout_seconds", "idle_worker_seconds", "drafter_steps"):
        assert key in scalars, (key, scalars)
        assert [(event.step, event.value) for event in events.Scalars(key)] == [
            (step["step"], float(as_float32(step[key]))) for step in steps
        ]
    assert "rollout_start" not in scalars  # wall-clock times are not plotted
    recipe_text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "name: logged" in recipe_text and "steps: 2" in recipe_text

    (wandb_file,) = (run_directory / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(wandb_file)
    (run,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    config = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in run.config.update}
    assert run.display_name == "logged" and config["train"]["steps"] == 2 and config["run"]["name"] == "logged"
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]
    logged = [row for row in history if "mean_reward" in row]  # W&B may add rows of its own (runtime)
    assert [row["_step"] for row in logged] == [0, 1], history
    for row, step in zip(logged, steps):
        assert row["mean_reward"] == step["mean_reward"] and row["drafter_steps"] == step["drafter_steps"]


def as_float32(value: float) -> float:
    """`value` as TensorBoard stores a scalar (float32)."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


BLOCKER = '''
import sys


class BlockTltPlugins:
    """Finds nothing named tlt_plugins: the plugins package is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "tlt_plugins" or name.startswith("tlt_plugins."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, BlockTltPlugins())
'''


def test_the_core_trains_without_the_plugins_package_and_names_a_missing_plugin_in_one_sentence(tmp_path, small_model):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), os.environ.get("PYTHONPATH", "")])}
    probe = subprocess.run(
        [sys.executable, "-c", "import tlt_cli.cli, tlt_cli.plugins; import tlt_plugins"],
        capture_output=True,
        text=True,
        env=environment,
    )
    assert probe.returncode != 0 and "No module named 'tlt_plugins'" in probe.stderr  # the blocker works

    trained = subprocess.run(
        small_run(small_model, tmp_path, "bare", 1),
        capture_output=True,
        text=True,
        timeout=900,
        env=environment,
    )
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-3000:]
    assert (tmp_path / "bare" / "trace.jsonl").is_file()

    refused = subprocess.run(
        small_run(small_model, tmp_path, "refused", 1, "plugins.enabled=[drafter_sidecar]"),
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert refused.returncode == 2
    message = (refused.stdout + refused.stderr).strip()
    assert "Traceback" not in message and "plugin 'drafter_sidecar'" in message, message
    assert "No module named 'tlt_plugins'" in message and "leave 'drafter_sidecar' out of plugins.enabled" in message
    assert not (tmp_path / "refused").exists()
