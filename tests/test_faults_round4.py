"""The chaos suite, round 4 (issue 43): damaged measurement records, a resume that changes a run, a run that
diverges, and low-level model-folder faults.

As in tests/test_faults.py, a fault a process meets is injected for real into the real CLI (`python -m tlt_cli`
in a subprocess): damaged cache records under the run's cache folder, a resume with another recipe or changed
settings, a learning rate that makes the policy's logits overflow, a model folder whose weights or chat template
are hostile. Each case checks what a user would see: exit code 2 (input) or 1 (a fault) with one sentence and
no traceback, or a run that goes on with one warning naming the damaged file. Faults of one function (a full
disk under a measurement's write, a planted symlink) are tried on that function, on a real small tmpfs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import test_faults as faults
import torch
from recipe_overrides import RECIPE, TLT, small_run
from safetensors.torch import load_file
from test_faults_round2 import model_copy, refused, small_tmpfs, tlt

from tlt_cli.config import load_recipe
from tlt_cli.engine.sampling import NonFiniteLogits, sample
from tlt_cli.models.tiny import SHIPPED_TINY_MODEL
from tlt_cli.trace import read_trace
from tlt_cli.training import update_precision
from tlt_cli.tuning import cache
from tlt_cli.tuning.cache import cached_record, machine_key, record_path
from tlt_cli.tuning.linear_forms import cached_plan
from tlt_cli.tuning.precision import CACHE_FOLDER as ROLLOUT_PRECISION

FOLDER = "example_choice"


def fast_record() -> dict:
    return {"seconds": {"fp32": 0.5, "bf16": 0.25}}


# ---------------------------------------------------------------- damaged measurement records


@pytest.mark.parametrize(
    "damage",
    [
        b'{"key": {"format"',  # cut short
        b"",
        bytes(range(256)),  # not UTF-8
        b"[]",
        b'{"key": 1}',
        "missing field",
        "zero field",
        "infinite field",
    ],
)
def test_a_damaged_record_counts_as_absent_with_one_warning_naming_it(tmp_path, caplog, damage):
    key = {**machine_key(torch.device("cpu")), "format": 1}
    record, path = cached_record(tmp_path, FOLDER, key, fast_record, update_precision.valid_record)
    if isinstance(damage, bytes):
        path.write_bytes(damage)
    else:
        broken = json.loads(path.read_text())
        if damage == "missing field":
            del broken["seconds"]["bf16"]
        else:
            broken["seconds"]["bf16"] = 0 if damage == "zero field" else float("inf")
        path.write_text(json.dumps(broken))
    measured = []
    again, again_path = cached_record(
        tmp_path, FOLDER, key, lambda: measured.append(1) or fast_record(), update_precision.valid_record
    )
    assert measured == [1] and again_path == path and again["seconds"] == record["seconds"]
    assert json.loads(path.read_text())["seconds"] == record["seconds"], "the damaged record is replaced"
    warnings = [entry.getMessage() for entry in caplog.records if entry.levelname == "WARNING"]
    assert warnings == [f"measurement record {path} is damaged (unparsable or out of shape); measuring again."]


@pytest.mark.parametrize("row_buckets", [[10**7], [], [0], [4, 2], ["1"]])
def test_a_linear_form_plan_with_absurd_row_buckets_is_measured_again(tmp_path, row_buckets):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    quick = {"row_buckets": (1, 2), "rounds": 1}
    plan, path = cached_plan([model], tmp_path, **quick)
    stored = json.loads(path.read_text())
    stored["plan"]["row_buckets"] = row_buckets
    path.write_text(json.dumps(stored))
    again, _ = cached_plan([model], tmp_path, **quick)
    assert again.row_buckets == (1, 2) and json.loads(path.read_text())["plan"]["row_buckets"] == [1, 2]


def test_a_full_disk_under_a_record_is_one_warning_and_leaves_no_temporary_file(tmp_path, caplog):
    with small_tmpfs(tmp_path / "small-cache", "64k") as disk:
        key = {"format": 1}
        big = {"seconds": {"fp32": 0.5, "bf16": 0.25}, "padding": "x" * (1 << 20)}
        record, path = cached_record(disk, FOLDER, key, lambda: big, update_precision.valid_record)
        assert record["padding"] == big["padding"] and path is None
        assert sorted(entry.name for entry in (disk / FOLDER).iterdir()) == [
            record_path(disk, FOLDER, key).stem + ".lock"
        ]
        warnings = [entry.getMessage() for entry in caplog.records if entry.levelname == "WARNING"]
        assert warnings == [
            f"measurement record {record_path(disk, FOLDER, key)} cannot be written (No space left on device); this "
            "run goes on without caching it."
        ]


def test_a_symlink_planted_at_a_records_lock_is_never_followed(tmp_path, caplog):
    key = {"format": 1}
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's file")
    lock = record_path(tmp_path / "cache", FOLDER, key).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    record, path = cached_record(tmp_path / "cache", FOLDER, key, fast_record, update_precision.valid_record)
    assert record["seconds"] == fast_record()["seconds"] and path is None
    assert victim.read_text() == "the user's file"
    warnings = [entry.getMessage() for entry in caplog.records if entry.levelname == "WARNING"]
    assert warnings == [
        f"measurement record {lock.with_suffix('.json')} cannot be written (Too many levels of symbolic links); this "
        "run goes on without caching it."
    ]


def test_the_machine_key_changes_with_the_cores_a_process_may_use(monkeypatch):
    everything = machine_key(torch.device("cpu"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(cache, "CGROUP_CPU_MAX", "/nonexistent/cpu.max")
    pinned = machine_key(torch.device("cpu"))
    assert pinned["usable_cores"] == 1 and pinned["cpu_quota"] == ""
    assert (os.cpu_count() or 1) == 1 or pinned != everything


# per cache folder, a damage that stopped every later run before: a traceback in the driver (update precision), a
# worker failing with UnicodeDecodeError (rollout precision). The linear forms are off in the run: a plan measured
# anew may differ by timing noise, and the rollout precision's key holds the plan, so its damaged record would go
# unread; a damaged plan is tried on cached_plan itself, which the worker calls
DAMAGES = {
    "update_precision": lambda text: b"[]",
    ROLLOUT_PRECISION: lambda text: b"\x80\x81 not JSON",
}


def damage_every_record(cache_dir: Path) -> list[Path]:
    """Damage every measurement record under `cache_dir` as DAMAGES says for its folder; the records damaged."""
    records = sorted(path for folder in DAMAGES for path in (cache_dir / folder).glob("*.json"))
    for path in records:
        path.write_bytes(DAMAGES[path.parent.name](path.read_text()))
    return records


# real `tlt train` runs of minutes each (a compiled DeepSpeed op per session): `pytest -m slow`
@pytest.mark.slow
def test_damaged_measurement_records_never_stop_a_run(small_model, cache_directory, tmp_path):
    """Every per-machine record a run reads (update precision in the driver, rollout precision in the worker) is
    damaged: the next run measures again, says which file it replaced, and trains."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    # the DeepSpeed op compiled once for the session (a minute on 2 cores), shared; the measurements are this test's
    shared_extensions = cache_directory / "torch_extensions"
    shared_extensions.mkdir(parents=True, exist_ok=True)
    (cache_dir / "torch_extensions").symlink_to(shared_extensions, target_is_directory=True)
    settings = ("actor.precision=auto", "rollout.dtype=auto", "rollout.linear_forms=off", "workers.count=1")
    first = subprocess.run(
        small_run(small_model, tmp_path, "first", 1, f"model.cache_dir={cache_dir}", *settings),
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    damaged = damage_every_record(cache_dir)
    assert {path.parent.name for path in damaged} == set(DAMAGES)
    second = subprocess.run(
        small_run(small_model, tmp_path, "second", 1, f"model.cache_dir={cache_dir}", *settings),
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    said = second.stdout + second.stderr + (tmp_path / "second" / "workers" / "worker-0.log").read_text()
    assert "Traceback" not in said
    for path in damaged:
        assert said.count(f"measurement record {path} is damaged") == 1, path
        assert json.loads(path.read_text())["key"]["format"] >= 1
    assert not [path for path in cache_dir.rglob(".*tmp-*")]


# ---------------------------------------------------------------- a damaged drafter warm-up cache


def test_a_damaged_drafter_warm_up_is_warmed_up_again_with_a_warning(tmp_path, caplog):
    from tlt_cli.drafter.model import CONFIG_FILE, WEIGHTS_FILE
    from tlt_cli.training.setup import prepare_drafter

    recipe = load_recipe(
        RECIPE,
        [
            "drafter.init=warmup",
            "drafter.warmup_steps=2",
            "drafter.warmup_prompts=4",
            "drafter.warmup_batch_size=2",
            "rollout.max_new_tokens=8",
            "speculative.mode=fixed",
        ],
    )
    folder, report = prepare_drafter(recipe, tmp_path)
    assert report is not None
    (folder / CONFIG_FILE).write_text("{not json")
    again, report = prepare_drafter(recipe, tmp_path)
    assert again == folder and report is not None, "warmed up again"
    assert json.loads((folder / CONFIG_FILE).read_text())["version"] >= 1
    assert load_file(str(folder / WEIGHTS_FILE))
    warnings = [entry.getMessage() for entry in caplog.records if entry.levelname == "WARNING"]
    assert warnings == [
        f"the cached drafter warm-up {folder} is damaged (its config or weights do not read back whole); warming up "
        "again."
    ]
    assert prepare_drafter(recipe, tmp_path) == (folder, None), "the replaced warm-up is used as it is"


# ---------------------------------------------------------------- a resume that changes the run


@pytest.fixture(scope="module")
def finished_run(small_model, tmp_path_factory) -> Path:
    """A 2-step run (actor fp32, rollout float32) with a checkpoint after each step."""
    output = tmp_path_factory.mktemp("runs")
    command = small_run(
        small_model,
        output,
        "base",
        2,
        "checkpoint.every=1",
        "actor.precision=fp32",
        "rollout.dtype=float32",
        "workers.count=1",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=faults.HANG_GUARD_SECONDS)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return output / "base"


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


# real `tlt train` runs of minutes each (a compiled DeepSpeed op per session): `pytest -m slow`
@pytest.mark.slow
def test_a_recipe_beside_resume_is_refused_unless_it_is_the_runs_own(run_copy):
    line = refused(tlt("train", "--resume", str(run_copy), str(RECIPE), "train.steps=3"))
    assert line.startswith(
        f"error: --resume continues run {run_copy} under its own recipe {run_copy / 'recipe.yaml'}, and {RECIPE} "
        "differs from it ("
    ), line
    assert line.endswith(f"; drop {RECIPE} and give what should change as key=value overrides."), line
    assert "run.name" in line and "train.steps" in line


# real `tlt train` runs of minutes each (a compiled DeepSpeed op per session): `pytest -m slow`
@pytest.mark.slow
@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("run.name=other", "the run directory is the one --resume names"),
        ("actor.zero_stage=1", "the checkpoint's optimizer state is sharded for its ZeRO stage"),
        ("train.trainer=trl", "each trainer writes checkpoints of its own layout"),
    ],
)
def test_an_override_the_checkpoint_cannot_honour_is_refused(run_copy, override, reason):
    key, _, value = override.partition("=")
    before = (run_copy / "recipe.yaml").read_text()
    line = refused(tlt("train", "--resume", str(run_copy), override))
    assert line.startswith(f"error: {key}: a resume cannot change it from "), line
    assert line.endswith(f"({reason}); resume without {key}={value}, or start a new run."), line
    assert (run_copy / "recipe.yaml").read_text() == before


# real `tlt train` runs of minutes each (a compiled DeepSpeed op per session): `pytest -m slow`
@pytest.mark.slow
def test_a_resume_with_changed_settings_says_so_and_writes_them_to_the_run(run_copy):
    own = run_copy / "recipe.yaml"
    result = tlt(
        "train",
        "--resume",
        str(run_copy),
        str(own),  # the run's own recipe may be named
        "train.steps=3",
        "rollout.temperature=0.9",
        "actor.precision=bf16",
        "rollout.dtype=bfloat16",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (
        "resuming with changed settings: train.steps 2 -> 3, rollout.temperature 1.0 -> 0.9, rollout.dtype float32 "
        "-> bfloat16, actor.precision fp32 -> bf16" in result.stdout
    ), result.stdout
    resumed = load_recipe(own)
    assert (resumed.train.steps, resumed.rollout.temperature, resumed.actor.precision) == (3, 0.9, "bf16")
    runs = [record for record in read_trace(run_copy / "trace.jsonl") if record["type"] == "run"]
    assert runs[-1]["changed_settings"]["actor.precision"] == ["fp32", "bf16"]
    assert runs[-1]["actor_precision"]["precision"] == "bf16"
    profile = subprocess.run(
        [*TLT, "profile", str(run_copy), "--no-plots"], capture_output=True, text=True, timeout=600
    )
    assert profile.returncode == 0, profile.stderr
    lines = profile.stdout.splitlines()
    assert any(line.startswith("steps 0-1: rollout dtype: float32 (given)") for line in lines), profile.stdout
    assert any(line.startswith("steps 0-1: actor precision fp32 (as the recipe sets it)") for line in lines)
    assert any(line.startswith("steps 2-2: rollout dtype: bfloat16 (given)") for line in lines), profile.stdout
    assert any(line.startswith("steps 2-2: actor precision bf16") for line in lines)
    plain = tlt("train", "--resume", str(run_copy), "train.steps=4")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "resuming with changed settings: train.steps 3 -> 4" in plain.stdout
    assert "rollout.dtype" not in plain.stdout.split("resuming with changed settings:")[1].splitlines()[0]


# ---------------------------------------------------------------- a diverging run


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.temperature=1e-300", "rollout.temperature must be 0 (greedy) or at least 0.001, got 1e-300."),
        (
            "actor.rollout_correction_cap=1e308",
            "actor.rollout_correction_cap must be in (1, 10000] (importance weights are truncated at it), got 1e+308.",
        ),
    ],
)
def test_a_temperature_too_small_and_a_cap_beyond_float32_are_refused(override, message):
    line = refused(tlt("recipes", "validate", str(RECIPE), override))
    assert line.endswith(message), line


def test_sampling_from_non_finite_logits_is_named():
    with pytest.raises(NonFiniteLogits, match="not finite"):
        sample(torch.tensor([[float("nan"), 0.5]]), torch.Generator().manual_seed(0))


# real `tlt train` runs of minutes each (a compiled DeepSpeed op per session): `pytest -m slow`
@pytest.mark.slow
def test_a_diverging_run_stops_naming_the_step_and_the_learning_rate_and_never_advises_resume(tmp_path):
    # one worker on the shipped model (seeded): its logits overflow at step 1; with two workers of the session's
    # model they stayed finite (huge, sampling one token) for 6 steps, which is not what this test is about
    command = small_run(
        SHIPPED_TINY_MODEL,
        tmp_path,
        "diverged",
        4,
        "checkpoint.every=1",
        "actor.lr=1e30",
        "workers.count=1",
        "actor.precision=fp32",
        "rollout.dtype=float32",
        "rollout.linear_forms=off",
    )
    result = subprocess.run(command, capture_output=True, text=True, timeout=faults.HANG_GUARD_SECONDS)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    line = faults.one_line(result.stdout, result.stderr)
    assert "so training diverged (most likely actor.lr 1e+30 is too high)" in line, line
    assert line.startswith("error: worker ") and ": step " in line, line
    assert "do not --resume it" in line and "--resume " + str(tmp_path) not in line, line


# ---------------------------------------------------------------- hostile model folders


def bin_model(folder: Path, weights: object) -> Path:
    """A copy of the tiny model whose weights are a pytorch_model.bin holding `weights` (given the real tensors)."""
    model = model_copy(folder)
    tensors = load_file(str(model / "model.safetensors"))
    (model / "model.safetensors").unlink()
    torch.save(weights(tensors) if callable(weights) else weights, model / "pytorch_model.bin")
    return model


class Planted:
    """A class no weights-only load allows."""


@pytest.mark.parametrize(
    ("weights", "said"),
    [
        (lambda tensors: {**tensors, "note": "a string"}, "hold 'note': a str, not a tensor"),
        (lambda tensors: list(tensors.values()), "hold a list, not a dict of tensors by name"),
        (lambda tensors: {**tensors, "planted": Planted()}, "cannot be loaded safely ("),
    ],
)
def test_a_bin_file_of_other_values_is_one_sentence_at_validate(tmp_path, weights, said):
    model = bin_model(tmp_path / "model", weights)
    line = refused(tlt("recipes", "validate", str(RECIPE), f"model.path={model}"))
    assert line.startswith(f"invalid model.path: Model weights in {model / 'pytorch_model.bin'} "), line
    assert said in line and "weights_only" not in line, line


def test_a_bin_file_of_tensors_validates(tmp_path):
    model = bin_model(tmp_path / "model", lambda tensors: tensors)
    result = tlt("recipes", "validate", str(RECIPE), f"model.path={model}")
    assert result.returncode == 0, result.stderr


def test_a_chat_template_that_loops_for_ever_is_stopped_at_validate(tmp_path):
    model = model_copy(tmp_path / "model")
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}"
    config_path.write_text(json.dumps(config))
    line = refused(tlt("recipes", "validate", str(RECIPE), f"model.path={model}"))
    assert line == (
        f"invalid model.path {model}: the tokenizer's chat template ran more than 5 s on one prompt (a loop too "
        "long?); fix chat_template in the model folder's tokenizer_config.json."
    ), line


def test_calibrate_refuses_a_recipe_to_rewrite_before_it_measures(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: {steps: -1}\n")
    output = tmp_path / "calibration" / "calibration.json"
    line = refused(tlt("calibrate", str(RECIPE), "--write-recipe", str(broken), "--output", str(output)))
    assert line.startswith(f"error: --write-recipe {broken}: "), line
    assert not output.parent.exists(), "nothing was measured"


def test_the_profile_names_each_segments_precisions_by_its_steps():
    from tlt_cli.profile.analysis import precision_lines
    from tlt_cli.profile.records import PrecisionSegment
    from tlt_cli.tuning.precision import PrecisionChoice

    segments = [
        PrecisionSegment(0, {"0": PrecisionChoice("float32", "given", {}, {})}, "actor precision fp32 (given)"),
        PrecisionSegment(2, {"0": PrecisionChoice("bfloat16", "given", {}, {})}, "actor precision bf16 (given)"),
    ]
    assert precision_lines(segments, last_step=3) == [
        "steps 0-1: rollout dtype: float32 (given)",
        "steps 0-1: actor precision fp32 (given)",
        "steps 2-3: rollout dtype: bfloat16 (given)",
        "steps 2-3: actor precision bf16 (given)",
    ]
    assert precision_lines(segments[:1], last_step=3) == [
        "rollout dtype: float32 (given)",
        "actor precision fp32 (given)",
    ]


@pytest.mark.parametrize("damage", ["zero", "missing"])
def test_a_damaged_rollout_precision_record_is_measured_again(tmp_path, damage):
    """What a worker meets: a verify figure zeroed (a ZeroDivisionError before) or a figure missing (a KeyError)."""
    from test_speculative import tiny_target

    from tlt_cli.tuning.precision import rollout_precision

    target = tiny_target()
    choice = rollout_precision("auto", target, None, tmp_path)
    (path,) = (tmp_path / ROLLOUT_PRECISION).glob("*.json")
    stored = json.loads(path.read_text())
    if damage == "zero":
        stored["verify_ms"]["bfloat16"] = 0
    else:
        del stored["batch_step_ms"]
    path.write_text(json.dumps(stored))
    again = rollout_precision("auto", target, None, tmp_path)
    assert again.reason == "measured" and all(value > 0 for value in again.verify_ms.values())
    assert set(json.loads(path.read_text())["batch_step_ms"]) == {"float32", "bfloat16"}
    assert choice.rows == again.rows
