"""The chaos suite, round 5 (issue 51): record values the validators themselves crashed on, a resume under another
`speculative.mode`, a diverging drafter (reset, then off: the run goes on), tampered checkpoints, hostile templates,
configs and records.

As in tests/test_faults_round4.py, a fault a process meets is injected for real into the real CLI (`python -m
tlt_cli` in a subprocess) where it is a process fault; a record's damage is tried on the function that reads it.
Each case checks what a user would see: exit code 2 (input) or 1 (a fault) with one sentence and no traceback,
or a run that goes on with one warning naming the damaged file. The cases that run `tlt train` for minutes are
under the slow marker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import test_faults as faults
import torch
from recipe_overrides import TLT
from test_faults_round4 import fast_record

from tlt_cli.speculative.costs import PassCosts
from tlt_cli.training import update_precision
from tlt_cli.tuning.cache import cached_record, machine_key
from tlt_cli.tuning.pass_costs import CACHE_FOLDER as PASS_COSTS
from tlt_cli.tuning.pass_costs import measured_pass_costs
from tlt_cli.tuning.precision import CACHE_FOLDER as ROLLOUT_PRECISION
from tlt_cli.tuning.precision import rollout_precision

# ---------------------------------------------------------------- record values the validators crashed on (LM1),
# records that are not regular files or name no machine (L5), absurd but valid pass costs (L6)

HUGE = 10**400  # an integer JSON holds and no float does


def _damaged(text: str, folder: str, damage: str) -> str | bytes:
    """The record's JSON `text` with `damage` done to it (raw JSON: Python's json writes no integer past a float)."""
    record = json.loads(text)
    if damage == "no key":
        del record["key"]
        return json.dumps(record)
    if folder == PASS_COSTS:
        if damage == "huge integer":
            return _with(record, ["target_ms", 0, 0], "HUGE")
        if damage == "tiny time":
            return _with(record, ["target_ms", 0, 0], 5e-324)
        if damage == "infinite axis":
            return _with(record, ["rows", -1], "INFINITY")
        if damage == "20,000 rows":
            record["rows"] = list(range(1, 20_001))
            record["target_ms"] = [record["target_ms"][0]] * 20_000
            return json.dumps(record)
        if damage == "another dtype":
            record["dtype"] = "bfloat16" if record["dtype"] != "bfloat16" else "float32"
            return json.dumps(record)
    figures = "seconds" if folder == "update_precision" else "step_ms"
    name = next(iter(record[figures]))
    return _with(record, [figures, name], {"huge integer": "HUGE", "tiny time": 5e-324}[damage])


def _with(record: dict, path: list, value: object) -> str:
    """`record` as JSON with the value at `path` replaced ("HUGE": 10**400, "INFINITY": Infinity, as raw JSON)."""
    inner = record
    for step in path[:-1]:
        inner = inner[step]
    inner[path[-1]] = {"HUGE": "@@HUGE@@", "INFINITY": "@@INF@@"}.get(value, value) if isinstance(value, str) else value
    return json.dumps(record).replace('"@@HUGE@@"', str(HUGE)).replace('"@@INF@@"', "Infinity")


def _record_of(folder: str, cache_dir: Path):
    """A measurement of `folder`, read through its real reader: (its figures, the path of its record)."""
    if folder == "update_precision":
        key = {**machine_key(torch.device("cpu")), "format": 1}
        record, path = cached_record(cache_dir, folder, key, fast_record, update_precision.valid_record)
        return record["seconds"], path
    from test_speculative import tiny_target

    target = _target(tiny_target)
    if folder == ROLLOUT_PRECISION:
        choice = rollout_precision("auto", target, None, cache_dir)
        (path,) = (cache_dir / folder).glob("*.json")
        return choice.step_ms, path
    costs = measured_pass_costs(target, None, torch.float32, None, cache_dir, most_rows=2)
    (path,) = (cache_dir / folder).glob("*.json")
    return costs, path


_TARGETS: dict = {}


def _target(make):
    if "target" not in _TARGETS:
        torch.manual_seed(0)
        _TARGETS["target"] = make()
    return _TARGETS["target"]


def _warnings(caplog) -> list[str]:
    return [entry.getMessage() for entry in caplog.records if entry.levelname == "WARNING"]


RECORD_DAMAGES = [
    (folder, damage)
    for folder in ("update_precision", ROLLOUT_PRECISION, PASS_COSTS)
    for damage in ("huge integer", "tiny time", "no key", "fifo", "link to /dev/zero")
] + [(PASS_COSTS, damage) for damage in ("infinite axis", "20,000 rows", "another dtype")]


@pytest.mark.parametrize(("folder", "damage"), RECORD_DAMAGES)
def test_a_record_its_validator_crashed_on_is_damaged_with_one_warning_and_measured_again(
    tmp_path, caplog, folder, damage
):
    first, path = _record_of(folder, tmp_path)
    if damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif damage == "link to /dev/zero":
        path.unlink()
        path.symlink_to("/dev/zero")
    else:
        path.write_text(_damaged(path.read_text(), folder, damage))
    again, again_path = _record_of(folder, tmp_path)  # a FIFO is never waited on, /dev/zero never read to its end
    assert again_path == path and path.is_file() and not path.is_symlink()
    if folder == PASS_COSTS:
        assert again.rows == first.rows and again.dtype == "float32" and len(again.rows) < 64
        assert min(value for row in again.target_ms for value in row) > 1e-6
        again.describe()  # no division by zero
    else:
        assert set(again) == set(first) and all(1e-9 < value < 1e9 for value in again.values())
    assert _warnings(caplog) == [f"measurement record {path} is damaged (unparsable or out of shape); measuring again."]


def test_pass_costs_refuse_times_and_grids_that_would_divide_by_zero_or_stall_each_step():
    good = {"rows": [1, 2], "tokens": [1, 16], "target_ms": [[1.0, 2.0], [1.5, 3.0]], "dtype": "float32"}
    assert PassCosts.from_dict(good).verify_ratio(16) == 2.0
    for damage in (
        {"target_ms": [[5e-324, 2.0], [1.5, 3.0]]},
        {"target_ms": [[HUGE, 2.0], [1.5, 3.0]]},
        {"rows": [1, float("inf")]},
        {"rows": [1, True]},
        {"rows": list(range(1, 20_001)), "target_ms": [[1.0, 2.0]] * 20_000},
    ):
        with pytest.raises(ValueError):
            PassCosts.from_dict({**good, **damage})


# ---------------------------------------------------------------- a checkpoint's SD schedule state (LM2, L1)


def _schedules(chosen: tuple[int, ...] = (1, 4, 2)) -> dict:
    """A mode-auto cost schedule and a rule-table (adaptive) schedule, each having chosen for `chosen` batch sizes."""
    from tlt_cli.config import SpeculativeMode, SpeculativeSection
    from tlt_cli.speculative.cost_schedule import CostSchedule, candidate_configs
    from tlt_cli.speculative.modes import adaptive_schedule
    from tlt_cli.training.setup import speculative_plan

    costs = PassCosts.from_dict(
        {"rows": [1, 4], "tokens": [1, 16], "target_ms": [[1.0, 1.5], [1.2, 3.0]], "dtype": "float32"}
    )
    schedules = {
        "auto": CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0),
        "adaptive": adaptive_schedule(speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive)), seed=0),
    }
    for schedule in schedules.values():
        for batch_size in chosen:
            schedule(batch_size)
    return schedules


def _tampered(state: dict, damage: str) -> object:
    if damage == "empty":
        return {}
    if damage == "a list":
        return [1, 2]
    if damage == "bad random state":
        return {**state, "random": (3, (1, 2), None)}
    if damage == "NaN correction":
        return {**state, "correction": {"off": float("nan")}}
    if damage == "negative correction":
        return {**state, "correction": {"off": -2.0}}
    if damage == "zero correction":
        return {**state, "correction": {"off": 0.0}}
    raise AssertionError(damage)


@pytest.mark.parametrize(
    "damage",
    ["empty", "a list", "bad random state", "NaN correction", "negative correction", "zero correction"],
)
def test_a_tampered_schedule_state_starts_the_schedule_fresh_with_one_sentence_naming_the_file(tmp_path, damage):
    from tlt_cli.speculative.schedule_state import restored_schedule

    schedule = _schedules()["auto"]
    saved = schedule.state_dict()
    fresh = _schedules()["auto"]
    before = fresh.state_dict()
    warning = restored_schedule(fresh, _tampered(saved, damage), tmp_path / "adaptive-schedule-rank-0.pt")
    assert warning is not None and str(tmp_path / "adaptive-schedule-rank-0.pt") in warning
    assert warning.endswith("the SD schedule starts fresh.") and "\n" not in warning
    assert repr(fresh.state_dict()) == repr(before), "left as it was"
    fresh(1)  # still chooses


@pytest.mark.parametrize(("saved_by", "resumed_by"), [("auto", "adaptive"), ("adaptive", "auto")])
def test_a_schedule_state_of_another_mode_starts_the_schedule_fresh(tmp_path, saved_by, resumed_by):
    from tlt_cli.speculative.schedule_state import restored_schedule

    schedules = _schedules()
    warning = restored_schedule(schedules[resumed_by], schedules[saved_by].state_dict(), tmp_path / "state.pt")
    assert warning == (
        f"SD schedule state {tmp_path / 'state.pt'} is not this schedule's (the checkpoint was written under another "
        "speculative.mode, or the file is damaged); the SD schedule starts fresh."
    )


def test_a_whole_schedule_state_is_restored():
    from tlt_cli.speculative.schedule_state import restored_schedule

    fresh = _schedules(chosen=())
    for mode, schedule in _schedules(chosen=(1, 4, 2, 3, 1)).items():
        assert restored_schedule(fresh[mode], schedule.state_dict(), Path("state.pt")) is None
        assert repr(fresh[mode].state_dict()) == repr(schedule.state_dict())


def test_an_embedded_rollout_resumed_from_a_checkpoint_without_schedule_state_warns_and_starts_fresh(tmp_path):
    """speculative.mode off -> auto: SD off wrote no schedule state; the checkpoint is complete."""
    from test_speculative import TargetAsDrafter, tiny_target

    from tlt_cli.config import SpeculativeMode, SpeculativeSection
    from tlt_cli.rollout.embedded import EmbeddedRollout
    from tlt_cli.training.setup import speculative_plan

    target = tiny_target()
    rollout = EmbeddedRollout(
        target,
        1,
        0,
        speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive)),
        TargetAsDrafter(target),
        seed=0,
    )
    missing = tmp_path / "step_000002" / "adaptive-schedule-rank-0.pt"
    rollout.load_state(missing)
    assert rollout.take_warnings() == [
        f"checkpoint {missing.parent} holds no SD schedule state (adaptive-schedule-rank-0.pt: speculative.mode did "
        "not adapt when it was written); the SD schedule starts fresh."
    ]
    missing.parent.mkdir()
    torch.save({"acceptance": {}, "correction": {}}, missing)  # a cost schedule's fields: mode auto -> adaptive
    rollout.load_state(missing)
    (warning,) = rollout.take_warnings()
    assert warning.startswith(f"SD schedule state {missing} is not this schedule's")
    missing.write_bytes(b"\x80 not a torch file")
    rollout.load_state(missing)
    (warning,) = rollout.take_warnings()
    assert warning.startswith(f"checkpoint file {missing} cannot be loaded safely") and warning.endswith(
        "; the SD schedule starts fresh."
    )


# ---------------------------------------------------------------- a diverging drafter (LM3)


def test_drafts_sampled_from_a_diverged_drafter_are_the_drafters_and_the_call_finishes_without_them():
    from test_speculative import TargetAsDrafter, generate, requests_for, tiny_target

    from tlt_cli.engine.sampling import SamplingParams
    from tlt_cli.speculative.decoder import SpeculativeDecoder
    from tlt_cli.speculative.types import SpeculativeConfig

    target = tiny_target()
    drafter = TargetAsDrafter(target)
    drafter.noise.fill_(float("nan"))  # the drafter's logits are NaN, the target's are fine
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(steps=3))
    completions = generate(target, requests_for(3, seed=1), SamplingParams(max_new_tokens=8), 1, decoder)
    assert [len(completion.response_ids) for completion in completions] == [8, 8, 8]
    assert decoder.drafter_diverged  # the worker resets the drafter (tests/test_drafter_divergence.py)


def test_a_diverged_policy_under_sd_is_still_the_policys():
    from test_speculative import TargetAsDrafter, generate, requests_for, tiny_target

    from tlt_cli.engine.sampling import NonFiniteDrafts, NonFiniteLogits, SamplingParams
    from tlt_cli.speculative.decoder import SpeculativeDecoder
    from tlt_cli.speculative.types import SpeculativeConfig

    target = tiny_target()
    decoder = SpeculativeDecoder(TargetAsDrafter(tiny_target()), SpeculativeConfig(steps=3))
    with torch.no_grad():
        target.lm_head.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLogits) as raised:
        generate(target, requests_for(3, seed=1), SamplingParams(max_new_tokens=8), 1, decoder)
    assert not isinstance(raised.value, NonFiniteDrafts)


def test_the_worker_names_actor_lr_for_the_policys_divergence():
    from types import SimpleNamespace

    from recipe_overrides import RECIPE

    from tlt_cli.config import load_recipe
    from tlt_cli.engine.sampling import NonFiniteLogits
    from tlt_cli.training.worker_loop import WorkerLoop

    loop = WorkerLoop.__new__(WorkerLoop)
    loop.recipe = load_recipe(RECIPE, ["drafter.lr=1e30"])
    loop.spec = SimpleNamespace(start_step=0)
    message = loop.divergence(3, NonFiniteLogits("the logits sampled from are not finite"))
    assert "actor.lr" in message and "drafter" not in message  # a drafter's divergence stops no run


# ---------------------------------------------------------------- a tampered checkpoint, a damaged trace (L1, L12)


def _checkpoint(tmp_path: Path, state: object) -> Path:
    folder = tmp_path / "run" / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    (folder / "weights.pt").write_bytes(b"x" * 10)
    (folder / "state.json").write_text(json.dumps(state))
    (folder.parent / "latest").write_text(folder.name)
    return folder


@pytest.mark.parametrize(
    "file_sizes", [["weights.pt", 10], {"weights.pt": "10"}, {"../../elsewhere": 10}, {"/etc/passwd": 10}]
)
def test_a_checkpoint_state_whose_file_sizes_are_out_of_shape_is_damaged_in_one_sentence(tmp_path, file_sizes):
    from tlt_cli.checkpoint import CheckpointError, latest_checkpoint

    folder = _checkpoint(tmp_path, {"next_step": 2, "file_sizes": file_sizes})
    with pytest.raises(CheckpointError) as raised:
        latest_checkpoint(tmp_path / "run")
    assert str(raised.value) == (
        f"checkpoint state {folder / 'state.json'} has no 'file_sizes' (file name -> bytes); it was not written by tlt "
        "or is damaged."
    )


def test_latest_linked_to_a_file_never_shows_that_files_text(tmp_path):
    from tlt_cli.checkpoint import latest_checkpoint

    folder = _checkpoint(tmp_path, {"next_step": 2})
    secret = tmp_path / "secret.txt"
    secret.write_text("step_000002 the user's private words")
    (folder.parent / "latest").unlink()
    (folder.parent / "latest").symlink_to(secret)
    found = latest_checkpoint(tmp_path / "run")
    assert found.directory == folder and "private" not in found.warning
    assert found.warning == (
        f"{folder.parent / 'latest'} does not name a checkpoint (it is a link, or not a small file of one name). Using "
        f"the previous complete checkpoint {folder}."
    )


@pytest.mark.parametrize(
    "line",
    [
        b"[1, 2]",
        b'{"type": "step", "step": "x"}',
        b"\xff\xfe not UTF-8",
        b'{"type": "step", "step": ' + b"9" * 30 + b"}",
        b"[" * 100_000,
        b'{"step": 0}',
    ],
)
def test_a_damaged_trace_line_is_dropped_on_resume_with_one_warning_naming_the_file(tmp_path, caplog, line):
    from tlt_cli.processes.run_directory import recorded_steps
    from tlt_cli.trace import read_trace, truncate_trace

    trace = tmp_path / "trace.jsonl"
    good = [{"type": "run"}, {"type": "step", "step": 0}, {"type": "step", "step": 1}, {"type": "step", "step": 2}]
    lines = [json.dumps(record).encode() for record in good]
    trace.write_bytes(b"\n".join([*lines[:2], line, *lines[2:]]) + b"\n")
    assert recorded_steps(trace) == 3
    truncate_trace(trace, 2)
    assert read_trace(trace) == good[:3]
    assert _warnings(caplog) == [f"trace {trace}: line 3 is damaged (not a trace record) and is dropped."]


# ---------------------------------------------------------------- chat templates one C-level operation escaped (L2)


@pytest.mark.parametrize(
    ("template", "said"),
    [
        # minutes of one C-level multiplication: the suite's hang guard stops the render the old SIGALRM could not
        ("{{ 10 ** (10 ** 9) }}", "ran more than 5 s on one prompt"),
        # 7.2 GB tokenized: stopped at 1 GiB more memory, or at 5 s of CPU on a loaded machine, whichever comes first
        ("{{ 'ab ' * 10**7 }}{{ messages[0]['content'] }}", "on one prompt"),
    ],
)
def test_a_chat_template_escaping_the_time_limit_in_one_c_operation_is_stopped_at_validate(tmp_path, template, said):
    from recipe_overrides import RECIPE
    from test_faults_round2 import model_copy, refused

    model = model_copy(tmp_path / "model")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    validate = [*TLT, "recipes", "validate", str(RECIPE), f"model.path={model}"]
    # the largest resident memory of validate and its children, measured by a wrapper process of its own
    wrapper = (
        "import resource, subprocess, sys; result = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stdout.write(result.stdout); sys.stderr.write(result.stderr); "
        "sys.stdout.write('\\npeak_kib=%d' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
        "sys.exit(result.returncode)"
    )
    result = subprocess.run(
        [sys.executable, "-c", wrapper, *validate], capture_output=True, text=True, timeout=faults.HANG_GUARD_SECONDS
    )
    line = refused(result)
    assert line.startswith(f"invalid model.path {model}: the tokenizer's chat template ") and said in line, line
    assert line.endswith("fix chat_template in the model folder's tokenizer_config.json."), line
    assert int(result.stdout.rsplit("peak_kib=", 1)[1]) < 4 << 20, "the render never took 4 GiB (it took 7.2 GB)"


def test_a_chat_template_within_the_limits_renders_as_before(tmp_path):
    from transformers import AutoTokenizer

    from tlt_cli.models.tiny import SHIPPED_TINY_MODEL
    from tlt_cli.tasks import prompts

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TINY_MODEL)
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    first = prompts.encode_prompt(tokenizer, "what is 2 + 3?")
    assert tokenizer.chat_template in prompts._PROBED, "rendered once under the limits"
    assert prompts.encode_prompt(tokenizer, "what is 2 + 3?") == first
    assert first == tokenizer.encode("<user>what is 2 + 3?<assistant>", add_special_tokens=False)


# ---------------------------------------------------------------- absurd config.json sizes (L3), weights that are not
# floating-point (L4)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [
        ("num_hidden_layers", 1_000_000, "has num_hidden_layers 1000000 in config.json; it must be a whole number"),
        ("num_attention_heads", 0, "has num_attention_heads 0 in config.json; it must be a whole number"),
        ("hidden_size", -64, "has hidden_size -64 in config.json; it must be a whole number"),
        ("vocab_size", "many", "vocab_size"),
        ("num_attention_heads", 3, "which its num_attention_heads 3 do not divide"),
    ],
)
def test_a_config_with_absurd_sizes_is_one_sentence_at_validate(tmp_path, key, value, said):
    from recipe_overrides import RECIPE
    from test_faults_round2 import model_copy, refused, tlt

    model = model_copy(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    config.pop("layer_types", None)  # one entry per layer: transformers checks its length against the layers
    (model / "config.json").write_text(json.dumps(config))
    line = refused(tlt("recipes", "validate", str(RECIPE), f"model.path={model}"))  # a million layers hung it
    assert line.startswith(f"invalid model.path: Model at {model} ") and said in line, line


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_integer_or_bool_weights_of_the_right_shapes_are_refused_at_validate(tmp_path, dtype):
    from recipe_overrides import RECIPE
    from safetensors.torch import load_file, save_file
    from test_faults_round2 import model_copy, refused, tlt

    model = model_copy(tmp_path / "model")
    tensors = load_file(str(model / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(model / "model.safetensors"))
    line = refused(tlt("recipes", "validate", str(RECIPE), f"model.path={model}"))
    assert line == (
        f"invalid model.path: Model weights in {model / 'model.safetensors'} hold {name} as integers or booleans, not "
        "floating-point numbers; the file is damaged or not a model's weights."
    ), line


# ---------------------------------------------------------------- tlt profile on hostile records (L7), its picture
# written through a planted link (L8)


def _hostile_trace(damage: str) -> list[dict]:
    from test_profile import hand_made_trace

    records = hand_made_trace()
    requests = [record for record in records if record["type"] == "request"]
    if damage == "span that overflows":
        requests[0].update(start=-1.7e308, end=1.7e308)
    elif damage == "tokens 2**62":
        requests[0]["tokens"] = 2**62
    elif damage == "negative tokens":
        requests[0]["tokens"] = -5
    elif damage == "a million depths":
        requests[0].update(accepted_by_depth=[1] * 1_000_000, proposed_by_depth=[1] * 1_000_000)
    elif damage == "a time too large for a float":
        requests[0]["end"] = "@@HUGE@@"  # written as the raw JSON integer 10**400
    elif damage == "sd_config of 0 seconds":
        for record in records:
            if record["type"] == "sd_config" and record["config"] != "off":
                record["seconds"] = 0
    return records


@pytest.mark.parametrize(
    "damage",
    [
        "span that overflows",
        "tokens 2**62",
        "negative tokens",
        "a million depths",
        "a time too large for a float",
        "sd_config of 0 seconds",
    ],
)
def test_tlt_profile_on_hostile_records_is_one_sentence_or_a_profile_never_a_traceback(tmp_path, damage):
    import io

    from rich.console import Console

    from tlt_cli.profile.analysis import analyse
    from tlt_cli.profile.records import ProfileInputError, load_records
    from tlt_cli.profile.report import render_profile

    trace = tmp_path / "trace.jsonl"
    lines = [json.dumps(record).replace('"@@HUGE@@"', str(HUGE)) for record in _hostile_trace(damage)]
    trace.write_text("\n".join(lines) + "\n")
    try:
        profile = analyse(load_records(tmp_path), tail_batch=4)
    except ProfileInputError as error:
        assert str(error).startswith(f"{trace} line ") and "\n" not in str(error), error
        assert damage != "sd_config of 0 seconds"
    else:
        assert damage == "sd_config of 0 seconds"
        render_profile(Console(file=io.StringIO()), profile, [], [], [])


def test_a_csv_field_past_the_csv_limit_is_one_sentence(tmp_path):
    from tlt_cli.profile.records import ProfileInputError, load_records

    records = tmp_path / "requests.csv"
    records.write_text("step,worker,start,end,tokens,note\n0,0,0,1,10," + "x" * 200_000 + "\n")
    with pytest.raises(ProfileInputError, match=rf"^{records} line \d+ is not a CSV row \(field larger than"):
        load_records(records)


def test_profile_pictures_are_never_written_through_a_planted_link(tmp_path):
    from test_profile import hand_made_trace, write_jsonl

    from tlt_cli.profile.plots import LENGTHS_FILE, TIMELINE_FILE
    from tlt_cli.profile.profiler import profile_source

    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's file")
    pid = os.getpid()
    for name in (TIMELINE_FILE, LENGTHS_FILE):
        (tmp_path / f".{name}.tmp-{pid}").symlink_to(victim)
    result = profile_source(str(tmp_path), None, 2, tmp_path, 4, None, pictures=True)
    assert result.pictures and all(path.read_bytes().startswith(b"\x89PNG") for path in result.pictures)
    assert victim.read_text() == "the user's file"


# ---------------------------------------------------------------- draft depths and export options out of range (L9),
# tlt_rollout() through a recipe's checks (L10)


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("speculative.steps=1000000", "speculative: speculative steps is 1000000; set it to at most 64."),
        ("speculative.topk=100000", "speculative: speculative topk is 100000; set it to at most 64."),
        ("speculative.draft_tokens=100000", "speculative: speculative draft_tokens is 100000; set it to at most 1024."),
    ],
)
def test_a_draft_depth_far_beyond_any_response_is_refused(override, said):
    from recipe_overrides import RECIPE

    from tlt_cli.config import load_recipe
    from tlt_cli.recipe_checks import RecipeError, check_values

    with pytest.raises(RecipeError) as raised:
        check_values(load_recipe(RECIPE, [override]))
    assert str(raised.value) == said


def test_a_rule_of_a_depth_past_the_bound_is_refused():
    from tlt_cli.speculative.shapes import shape_problem
    from tlt_cli.speculative.types import SpeculativeConfig

    assert shape_problem(SpeculativeConfig(steps=100_000)) == "speculative steps is 100000; set it to at most 64."
    assert (
        shape_problem(SpeculativeConfig(steps=0, ngram_tokens=10**6))
        == "ngram tokens is 1000000; set it to at most 64."
    )


@pytest.mark.parametrize(
    ("prompts", "draft_steps", "max_new_tokens", "said"),
    [
        (8, 100_000, None, "--draft-steps in 1..64"),
        (8, 4, -5, "--max-new-tokens must be at least 1"),
        (8, 4, 0, "--max-new-tokens must be at least 1"),
        (10**9, 4, None, "--prompts must be in 1..10000"),
    ],
)
def test_export_options_out_of_range_are_one_sentence_before_anything_is_measured(
    prompts, draft_steps, max_new_tokens, said
):
    from recipe_overrides import RECIPE

    from tlt_cli.config import load_recipe
    from tlt_cli.export import ExportError, held_out_probe

    with pytest.raises(ExportError) as raised:
        held_out_probe(load_recipe(RECIPE), None, prompts, max_new_tokens, draft_steps)
    assert said in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("speculative", "drafter_config", "said"),
    [
        ({"mode": "auto", "reprobe_steps": 0}, None, "speculative.reprobe_steps must be at least 1, got 0."),
        ({"mode": "fixed", "steps": -1}, None, "speculative: speculative steps is -1; set it to at least 1."),
        ({"collapse_accept_length": float("nan")}, None, "speculative.collapse_accept_length must be a finite number"),
        (None, {"lr": -1.0}, "drafter.lr must be positive"),
    ],
)
def test_tlt_rollout_checks_its_sections_as_a_recipes(speculative, drafter_config, said):
    pytest.importorskip("trl")
    from tlt_cli.errors import UserError
    from tlt_cli.integrations.trl import tlt_rollout

    with pytest.raises(UserError) as raised:
        tlt_rollout(speculative=speculative, drafter_config=drafter_config, drafter="random")
    assert str(raised.value).startswith(said), raised.value


def test_tlt_rollouts_default_mode_is_auto_as_its_docstring_says():
    pytest.importorskip("trl")
    from tlt_cli.integrations.trl import tlt_rollout
    from tlt_cli.speculative.plan import SpeculationMode

    assert tlt_rollout(drafter="random").speculative.mode == SpeculationMode.auto
    assert "(None: its defaults, mode auto;" in tlt_rollout.__doc__


# ---------------------------------------------------------------- the same faults met by real `tlt train` processes:
# a resume under another speculative.mode (LM2), a checkpoint of another model's shapes (L1), a diverging drafter (LM3)

WARM_UP_BRIEFLY = ("drafter.warmup_steps=2", "drafter.warmup_prompts=4", "drafter.warmup_batch_size=2")


def _train(command: list[str]) -> subprocess.CompletedProcess:
    from test_faults import HANG_GUARD_SECONDS

    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_SECONDS)


def _trace_warnings(run: Path) -> list[str]:
    from tlt_cli.trace import read_trace

    return [record["message"] for record in read_trace(run / "trace.jsonl") if record["type"] == "warning"]


@pytest.fixture(scope="module")
def plain_run(small_model, tmp_path_factory) -> Path:
    """A 2-step run with SD off and one worker, a checkpoint after each step."""
    from recipe_overrides import small_run

    output = tmp_path_factory.mktemp("runs")
    command = small_run(small_model, output, "plain", 2, "checkpoint.every=1", "workers.count=1")
    result = _train([*command, "actor.precision=fp32", "rollout.dtype=float32"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return output / "plain"


# real `tlt train` runs of minutes each: `pytest -m slow`
@pytest.mark.slow
def test_a_resume_under_another_speculative_mode_starts_the_schedule_fresh_with_one_line(plain_run, tmp_path):
    from test_faults_round2 import tlt

    run = Path(shutil.copytree(plain_run, tmp_path / "run"))
    to_auto = tlt("train", "--resume", str(run), "train.steps=3", "speculative.mode=auto", *WARM_UP_BRIEFLY)
    assert to_auto.returncode == 0, to_auto.stdout[-3000:] + to_auto.stderr[-3000:]
    assert "Traceback" not in to_auto.stdout + to_auto.stderr and "incomplete" not in to_auto.stdout + to_auto.stderr
    state = run / "checkpoints" / "step_000002" / "adaptive-schedule-rank-0.pt"
    assert _trace_warnings(run) == [
        f"worker 0: checkpoint {state.parent} holds no SD schedule state ({state.name}: speculative.mode did not "
        "adapt when it was written); the SD schedule starts fresh."
    ]
    to_adaptive = tlt("train", "--resume", str(run), "train.steps=4", "speculative.mode=adaptive")
    assert to_adaptive.returncode == 0, to_adaptive.stdout[-3000:] + to_adaptive.stderr[-3000:]
    assert "Traceback" not in to_adaptive.stdout + to_adaptive.stderr
    state = run / "checkpoints" / "step_000003" / "adaptive-schedule-rank-0.pt"
    assert _trace_warnings(run)[-1] == (
        f"worker 0: SD schedule state {state} is not this schedule's (the checkpoint was written under another "
        "speculative.mode, or the file is damaged); the SD schedule starts fresh."
    )


# real `tlt train` runs of minutes each: `pytest -m slow`
@pytest.mark.slow
def test_a_checkpoint_of_another_models_shapes_is_one_sentence_whose_advice_does_not_repeat_the_failure(
    plain_run, tmp_path
):
    from test_faults import one_line

    from tlt_cli.training.actor import ACTOR_WEIGHTS_FILE, CHECKPOINT_TAG

    run = Path(shutil.copytree(plain_run, tmp_path / "run"))
    checkpoint = run / "checkpoints" / "step_000002"
    weights = checkpoint / CHECKPOINT_TAG / ACTOR_WEIGHTS_FILE
    saved = torch.load(weights, weights_only=False)
    name = next(iter(saved["module"]))
    saved["module"][name] = saved["module"][name][:-1].clone()  # one row short: another model's shape
    torch.save(saved, weights)
    state = json.loads((checkpoint / "state.json").read_text())
    state["file_sizes"][str(weights.relative_to(checkpoint))] = weights.stat().st_size  # passes the size check
    (checkpoint / "state.json").write_text(json.dumps(state))
    result = _train([*TLT, "train", "--resume", str(run), "train.steps=3"])
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    line = one_line(result.stdout, result.stderr)
    assert line.startswith(f"error: checkpoint {checkpoint} cannot be loaded (RuntimeError: "), line
    assert line.endswith(
        f"it is damaged or holds another model; remove {checkpoint} and --resume falls back to the checkpoint "
        "before it, or start a new run."
    ), line
    assert "continue with --resume" not in line
    shutil.rmtree(checkpoint)  # the advice, followed: the resume goes on from step_000001
    again = _train([*TLT, "train", "--resume", str(run), "train.steps=3"])
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]


# real `tlt train` runs of minutes each: `pytest -m slow`
@pytest.mark.slow
def test_a_diverging_drafter_is_reset_then_turned_off_and_the_run_trains_on(small_model, tmp_path):
    from recipe_overrides import small_run

    from tlt_cli.trace import read_trace

    command = small_run(
        small_model,
        tmp_path,
        "drafter-diverged",
        6,
        "speculative.mode=fixed",
        "speculative.steps=3",
        "plugins.enabled=[drafter_sidecar]",
        "drafter.lr=1e30",
        *WARM_UP_BRIEFLY,
    )
    result = _train(command)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = read_trace(tmp_path / "drafter-diverged" / "trace.jsonl")
    steps = [record for record in records if record["type"] == "step"]
    assert [record["step"] for record in steps] == list(range(6))  # the policy trained every step
    actions = [record["drafter_divergence"] for record in steps if record["drafter_divergence"] is not None]
    assert actions[0] == "reset" and actions[-1] == "off", actions
    lines = [line for line in result.stdout.splitlines() if "so the drafter diverged, not the policy" in line]
    assert len(lines) == len(actions), result.stdout[-3000:]
    assert "(most likely drafter.lr 1e+30" in lines[0] and "starts again from fresh weights" in lines[0], lines
    assert "the drafter is off for the rest of the run" in lines[-1], lines
    assert "Traceback" not in result.stdout + result.stderr


# ---------------------------------------------------------------- wording (L12)


def test_dev_null_given_as_a_file_is_named_as_what_it_is(tmp_path):
    from tlt_cli.config import RecipeError, load_recipe
    from tlt_cli.processes.hostfile import HostfileError, read_hostfile

    with pytest.raises(RecipeError) as raised:
        load_recipe(Path("/dev/null"))
    assert str(raised.value).startswith(
        "recipe file /dev/null is not a regular file (a device, a FIFO or a socket); pass the path of a YAML recipe"
    )
    with pytest.raises(HostfileError, match=r"^/dev/null is not a regular file \(a device, a FIFO or a socket\);"):
        read_hostfile(Path("/dev/null"))


def test_a_run_folder_without_recipe_yaml_is_named_as_such_not_given_recipe_path_advice(tmp_path):
    from tlt_cli.errors import UserError
    from tlt_cli.processes.resume_settings import resumed_recipe

    with pytest.raises(UserError) as raised:
        resumed_recipe(tmp_path, None, [])
    assert str(raised.value) == (
        f"--resume {tmp_path}: it has no recipe.yaml ({tmp_path / 'recipe.yaml'} does not exist), so it is not a tlt "
        "run directory or it was damaged; give the run directory tlt train made, or start a new run."
    )


def test_a_resume_that_fills_empty_task_options_lists_only_the_keys_it_sets():
    from recipe_overrides import RECIPE

    from tlt_cli.config import load_recipe
    from tlt_cli.processes.resume_settings import changed_settings

    before = load_recipe(RECIPE, ["task.options={}"])
    after = load_recipe(RECIPE, ["task.name=jsonl_math", "task.options={path: /data/problems.jsonl}"])
    assert changed_settings(before, after) == {
        "task.name": ("arithmetic", "jsonl_math"),
        "task.options.path": (None, "/data/problems.jsonl"),
    }
