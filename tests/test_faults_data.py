"""Chaos tests, files half of issue 21: damaged and hostile files, a full disk, markup in plugin errors.

Each fault is injected for real and goes through the real CLI (`python -m tlt_cli` in a
subprocess, or typer's CliRunner where nothing but the command runs): the command ends within a
bound (the subprocess timeout is a hang guard only), exits with the code a user error has (2) and
one `error:` line naming the file, prints no traceback, and every checkpoint, trace and drafter
the user had is still there and loads. The runs use the shipped tiny model with plain decoding
and the drafter sidecar from a random drafter (so checkpoints hold a drafter, its sidecar state and
DeepSpeed's files, without a drafter warm-up). A full disk is a 8-16 KiB tmpfs where this process
may mount one (root), else a file-size limit (RLIMIT_FSIZE, which makes writes fail with EFBIG)
in the subprocess; the training case needs the tmpfs and is skipped without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from recipe_overrides import small_run
from typer.testing import CliRunner

from tlt_cli.checkpoint import (
    DRAFTER_DIRECTORY,
    FILE_SIZES_KEY,
    STATE_FILE,
    CheckpointError,
    checked_state,
    latest_checkpoint,
    load_checkpoint_file,
)
from tlt_cli.cli import app
from tlt_cli.drafter.model import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    EagleDrafter,
    file_sha256,
    load_drafter,
    read_drafter_metadata,
    save_drafter,
)
from tlt_cli.drafter.trainer import DrafterBatch
from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import BUILTIN_TINY_MODEL, SHIPPED_TINY_MODEL
from tlt_cli.trace import read_trace
from tlt_cli.training.actor import deepspeed_checkpoint_classes
from tlt_plugins.drafter_sidecar import PLUGIN_NAME, StepData

TESTS = Path(__file__).resolve().parent
# hang guards only: a case that ends on its own takes a fraction of these
FAILING_COMMAND_TIMEOUT_S = 300
TRAINING_TIMEOUT_S = 900
SIDECAR_FROM_RANDOM = (f"plugins.enabled=[{PLUGIN_NAME}]", "drafter.init=random")
runner = CliRunner()


def tlt(command: list[str], timeout: float, preexec: Callable[[], None] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, preexec_fn=preexec)


def one_error_line(output: str, code: int, exit_code: int, *fragments: str) -> str:
    """The output's one `error:` line, after checking the exit code, that no traceback was printed, and the line."""
    assert exit_code == code, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def fails_with(result: subprocess.CompletedProcess, *fragments: str) -> str:
    return one_error_line(result.stdout + result.stderr, 2, result.returncode, *fragments)


def cli_fails_with(arguments: list[str], *fragments: str) -> str:
    result = runner.invoke(app, arguments)
    assert isinstance(result.exception, SystemExit), result.exception
    return one_error_line(result.output, 2, result.exit_code, *fragments)


def run_is_intact(run_directory: Path, damaged: Path | None = None) -> None:
    """Every checkpoint (but the one the test damaged) passes its checks and its files load; the trace reads;
    the drafters load on the run's model."""
    allowed = (StepData, DrafterBatch, *deepspeed_checkpoint_classes())
    target, _ = load_policy(BUILTIN_TINY_MODEL)
    for checkpoint in sorted((run_directory / "checkpoints").glob("step_*")):
        if checkpoint == damaged:
            continue
        checked_state(checkpoint)
        for weights in checkpoint.rglob("*.pt"):
            load_checkpoint_file(weights, allowed, map_location="cpu")
        load_drafter(checkpoint / DRAFTER_DIRECTORY, target)
    assert [record["step"] for record in read_trace(run_directory / "trace.jsonl") if record["type"] == "step"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, cache_directory) -> Path:
    """A 4-step run with checkpoints after steps 2 and 4 (the sidecar's drafter in each)."""
    output = tmp_path_factory.mktemp("runs")
    result = tlt(small_run(Path(BUILTIN_TINY_MODEL), output, "base", 4, *SIDECAR_FROM_RANDOM), TRAINING_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return output / "base"


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    """A copy of the base run this test may damage."""
    return Path(shutil.copytree(base_run, tmp_path / "run"))


def resume(
    run_directory: Path, *overrides: str, timeout: float = FAILING_COMMAND_TIMEOUT_S
) -> subprocess.CompletedProcess:
    return tlt([sys.executable, "-m", "tlt_cli", "train", "--resume", str(run_directory), *overrides], timeout)


@pytest.mark.slow
@pytest.mark.parametrize(("content", "message"), [("{bad", "is not valid JSON"), ("{}", "has no 'next_step'")])
def test_resume_with_a_corrupt_state_json_and_no_earlier_checkpoint_is_one_sentence(run_copy, content, message):
    checkpoints = run_copy / "checkpoints"
    shutil.rmtree(checkpoints / "step_000002")
    state = checkpoints / "step_000004" / STATE_FILE
    state.write_text(content)
    fails_with(resume(run_copy), str(state), message)
    assert state.read_text() == content
    run_is_intact(run_copy, damaged=checkpoints / "step_000004")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["state.json {bad", "truncated actor weights"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(run_copy, fault):
    latest = run_copy / "checkpoints" / "step_000004"
    if fault == "state.json {bad":
        (latest / STATE_FILE).write_text("{bad")
    else:
        weights = latest / "actor" / "mp_rank_00_model_states.pt"
        weights.write_bytes(weights.read_bytes()[:1000])
    result = resume(run_copy, timeout=TRAINING_TIMEOUT_S)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "Using the previous complete checkpoint" in warnings[0], output
    assert str(latest) in warnings[0]
    steps = [record["step"] for record in read_trace(run_copy / "trace.jsonl") if record["type"] == "step"]
    assert steps == [0, 1, 2, 3]  # steps 2 and 3 ran again from the checkpoint after step 2
    assert latest_checkpoint(run_copy).directory == latest and latest_checkpoint(run_copy).warning is None
    run_is_intact(run_copy)


class RunsCode:
    """A pickle that runs a shell command when unpickled without weights_only."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_malicious_pickle_in_the_run_directory_is_refused_on_resume_and_runs_nothing(run_copy, tmp_path):
    latest = run_copy / "checkpoints" / "step_000004"
    marker = tmp_path / "code-ran"
    hostile = latest / "actor" / "mp_rank_00_model_states.pt"  # read by DeepSpeed's checkpoint engine
    hostile.write_bytes(pickle.dumps({"module": RunsCode(marker)}, protocol=2))
    # the attacker fixes the recorded sizes too, so only the load itself can refuse the file
    state = json.loads((latest / STATE_FILE).read_text())
    state[FILE_SIZES_KEY]["actor/mp_rank_00_model_states.pt"] = hostile.stat().st_size
    (latest / STATE_FILE).write_text(json.dumps(state))
    fails_with(resume(run_copy), str(hostile), "cannot be loaded safely", "unsupported GLOBAL posix.system")
    assert not marker.exists()
    run_is_intact(run_copy, damaged=latest)


def test_a_weights_only_load_refuses_code_and_names_the_file(tmp_path):
    marker = tmp_path / "code-ran"
    hostile = tmp_path / "state.pt"
    hostile.write_bytes(pickle.dumps(RunsCode(marker), protocol=2))
    with pytest.raises(
        CheckpointError, match=r"state.pt cannot be loaded safely \(Trying to load unsupported GLOBAL posix.system"
    ) as refused:
        load_checkpoint_file(hostile)
    assert "\n" not in str(refused.value) and not marker.exists()


def test_a_file_with_bytes_zeroed_and_its_size_kept_is_refused_naming_the_file(tmp_path):
    import torch

    path = tmp_path / "state.pt"
    torch.save({"weights": torch.arange(4096, dtype=torch.float32)}, path)
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size // 2)
        handle.write(bytes(4096))
    with pytest.raises(CheckpointError, match=r"state.pt is damaged \(record state/data/0 does not match") as refused:
        load_checkpoint_file(path)
    assert "\n" not in str(refused.value)


@pytest.fixture
def wrong_shape_model(tmp_path) -> Path:
    """The shipped tiny model's folder with one tensor one row too long."""
    from safetensors.torch import load_file, save_file

    folder = Path(shutil.copytree(SHIPPED_TINY_MODEL, tmp_path / "model"))
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(name for name in tensors if name.endswith("mlp.up_proj.weight"))
    tensors[name] = tensors[name].new_zeros((tensors[name].shape[0] + 1, tensors[name].shape[1]))
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


def test_wrong_shape_weights_fail_validate_and_train_in_one_sentence(wrong_shape_model, tmp_path):
    command = small_run(wrong_shape_model, tmp_path / "runs", "wrong", 2)
    recipe_and_overrides = command[command.index("train") + 1 :]
    validate = tlt([*command[:3], "recipes", "validate", *recipe_and_overrides], FAILING_COMMAND_TIMEOUT_S)
    assert validate.returncode == 2 and "Traceback" not in validate.stdout + validate.stderr
    assert "up_proj.weight has shape" in validate.stderr and "ok " not in validate.stdout
    fails_with(tlt(command, FAILING_COMMAND_TIMEOUT_S), "model.safetensors do not fit its config.json")
    assert not (tmp_path / "runs" / "wrong").exists()


@pytest.fixture
def drafter_export(tmp_path) -> tuple[Path, Path]:
    """(a drafter folder of the shipped tiny model, a recipe naming that model) for export-drafter."""
    save_drafter(EagleDrafter(load_policy(BUILTIN_TINY_MODEL)[0], seed=0), tmp_path / "drafter")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"run: {{name: exported, output_dir: {tmp_path / 'runs'}}}\nmodel: {{path: {BUILTIN_TINY_MODEL}}}\n"
        "train: {steps: 2, prompts_per_step: 2, group_size: 2}\nrollout: {max_new_tokens: 24}\n"
    )
    return tmp_path / "drafter", recipe


def _wrong_shape_drafter(drafter: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = drafter / WEIGHTS_FILE
    tensors = load_file(str(weights))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1].contiguous()
    save_file(tensors, str(weights))
    config = json.loads((drafter / CONFIG_FILE).read_text())
    (drafter / CONFIG_FILE).write_text(json.dumps({**config, "weights_sha256": file_sha256(weights)}))


MALFORMED_DRAFTERS = {
    "not JSON": (lambda drafter: (drafter / CONFIG_FILE).write_text("{not json"), "is not valid JSON"),
    "a list": (lambda drafter: (drafter / CONFIG_FILE).write_text("[1, 2]"), "is a JSON list, not an object"),
    "no weights_sha256": (
        lambda drafter: (drafter / CONFIG_FILE).write_text(
            json.dumps(
                {k: v for k, v in json.loads((drafter / CONFIG_FILE).read_text()).items() if k != "weights_sha256"}
            )
        ),
        "lacks weights_sha256",
    ),
    "wrong-shape weights": (_wrong_shape_drafter, "do not fit a drafter of this target"),
}


@pytest.mark.parametrize(("content", "message"), [("{bad", "is not valid JSON"), ("{}", "has no 'next_step'")])
def test_export_of_a_checkpoint_with_a_corrupt_state_json_is_one_sentence(drafter_export, tmp_path, content, message):
    drafter, recipe = drafter_export
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
    shutil.copytree(drafter, checkpoint / DRAFTER_DIRECTORY)
    shutil.copy(recipe, tmp_path / "run" / "recipe.yaml")
    (checkpoint / STATE_FILE).write_text(content)
    (checkpoint.parent / "latest").write_text(checkpoint.name)
    for source in (checkpoint, tmp_path / "run"):
        cli_fails_with(["export-drafter", str(source), str(tmp_path / "out")], str(checkpoint / STATE_FILE), message)
    assert (checkpoint / STATE_FILE).read_text() == content and not (tmp_path / "out").exists()
    read_drafter_metadata(checkpoint / DRAFTER_DIRECTORY)


@pytest.mark.parametrize("fault", sorted(MALFORMED_DRAFTERS))
def test_a_malformed_drafter_folder_is_one_sentence_naming_the_file(drafter_export, tmp_path, fault):
    drafter, recipe = drafter_export
    damage, message = MALFORMED_DRAFTERS[fault]
    damage(drafter)
    kept = {path.name: path.read_bytes() for path in drafter.iterdir()}
    line = cli_fails_with(["export-drafter", str(drafter), str(tmp_path / "out"), "--recipe", str(recipe)], message)
    assert str(drafter) in line and not (tmp_path / "out").exists()
    assert {path.name: path.read_bytes() for path in drafter.iterdir()} == kept


def test_export_force_onto_the_source_parent_is_refused_and_the_drafter_stays(drafter_export, tmp_path):
    drafter, recipe = drafter_export
    for output in (drafter.parent, drafter):
        cli_fails_with(
            ["export-drafter", str(drafter), str(output), "--recipe", str(recipe), "--force"], "or a folder holding it"
        )
    read_drafter_metadata(drafter)
    load_drafter(drafter, load_policy(BUILTIN_TINY_MODEL)[0])


@contextlib.contextmanager
def full_disk(tmp_path: Path, size_kib: int) -> Iterator[tuple[Path, Callable[[], None] | None]]:
    """(a folder on a `size_kib` tmpfs, None) where mounting works, else (a plain folder, a preexec_fn that
    limits the size of any file the subprocess writes to `size_kib` KiB, SIGXFSZ ignored so writes fail)."""
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
        if shutil.which("mount") and os.geteuid() == 0
        else False
    )
    if mounted:
        try:
            yield folder, None
        finally:
            subprocess.run(["umount", str(folder)], check=False)
        return

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size_kib * 1024, size_kib * 1024))

    yield folder, limit_file_size


@pytest.mark.slow
def test_export_onto_a_full_disk_is_one_sentence_and_leaves_nothing(drafter_export, tmp_path):
    drafter, recipe = drafter_export
    with full_disk(tmp_path, 16) as (disk, preexec):
        output = disk / "exported"
        command = [
            sys.executable,
            "-m",
            "tlt_cli",
            "export-drafter",
            str(drafter),
            str(output),
            "--recipe",
            str(recipe),
            "--prompts",
            "1",
        ]
        fails_with(tlt(command, FAILING_COMMAND_TIMEOUT_S, preexec), "cannot write", "nothing was exported")
        assert not output.exists() and list(disk.iterdir()) == []
    read_drafter_metadata(drafter)


def _requests_csv(path: Path) -> Path:
    rows = ["step,worker,start,end,tokens"] + [
        f"0,{worker},0.0,{1 + request},{10 + request}" for worker in (0, 1) for request in range(4)
    ]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_profile_pictures_onto_a_full_disk_are_one_sentence_and_leave_nothing(tmp_path):
    requests = _requests_csv(tmp_path / "requests.csv")
    with full_disk(tmp_path, 8) as (disk, preexec):
        command = [sys.executable, "-m", "tlt_cli", "profile", str(requests), "--output-dir", str(disk / "pictures")]
        fails_with(tlt(command, FAILING_COMMAND_TIMEOUT_S, preexec), "cannot write", "profile_")
        assert [path.name for path in (disk / "pictures").iterdir()] == []


@pytest.mark.slow
def test_a_trace_write_onto_a_full_disk_ends_the_run_in_one_sentence(tmp_path):
    # 24 KiB: the recipe, the run lock and the two workers' logs take a 4 KiB page each, the trace
    # (about 3 KiB a step) fills the last two pages in its third step, before any checkpoint is due
    with full_disk(tmp_path, 24) as (disk, preexec):
        if preexec is not None:
            pytest.skip("cannot mount a small tmpfs here; a file-size limit would also stop the workers' own writes")
        command = small_run(Path(BUILTIN_TINY_MODEL), disk, "full", 8, "checkpoint.every=100")
        message = fails_with(
            tlt(command, TRAINING_TIMEOUT_S), str(disk / "full" / "trace.jsonl"), "No space left on device"
        )
        # no step reached a checkpoint: no --resume is offered
        assert "no checkpoint was completed" in message and "--resume" not in message
        records = (disk / "full" / "trace.jsonl").read_text().splitlines()
        assert json.loads(records[0])["type"] == "run"  # what fitted is kept


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("requests.jsonl", '{"step": 0, "worker": 0, "start": 0.0, "end": NaN, "tokens": 5}\n', "line 1: 'end' is nan"),
        ("requests.csv", "step,worker,start,end,tokens\n0,0,0.0,Infinity,5\n", "line 2: 'end' is 'Infinity'"),
        ("requests.csv", "step,worker,start,end,tokens\n0,0,0.0,1.0,5\n0,1,0.0,nan,5\n", "line 3: 'end' is 'nan'"),
    ],
)
def test_profile_input_with_nan_or_infinity_is_one_sentence_naming_the_line(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    cli_fails_with(["profile", str(path), "--no-plots"], str(path), message, "expected a finite number")


def test_profile_input_in_latin1_is_one_sentence_naming_the_line(tmp_path):
    path = tmp_path / "requests.csv"
    path.write_bytes("step,worker,start,end,tokens\n0,0,0.0,1.0,5\n# caf\u00e9\n".encode("latin-1"))
    cli_fails_with(["profile", str(path), "--no-plots"], f"{path} line 3 is not UTF-8", "0xe9")


def test_profile_json_is_strict_and_a_trace_without_requests_is_one_sentence(tmp_path):
    result = runner.invoke(app, ["profile", str(_requests_csv(tmp_path / "requests.csv")), "--json", "--no-plots"])
    assert result.exit_code == 0, result.output
    json.loads(result.output, parse_constant=lambda constant: pytest.fail(f"not strict JSON: {constant}"))
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"type": "run", "world_size": 1}\n{"type": "step", "step": 0, "rollout_start": 0.0, "rollout_end": 1.0}\n'
    )
    cli_fails_with(["profile", str(trace), "--no-plots"], str(trace), "has no request records")
    cli_fails_with(["profile", str(trace), "--sd-speedup", "inf"], "give a finite factor")


MARKUP_PLUGIN = '''
class GlooLikeFailure:
    """Raises an error whose text looks like rich markup, as gloo's do."""

    def __init__(self, recipe):
        pass

    def on_rollout_start(self, context):
        raise RuntimeError("[/tmp/gloo/transport/tcp/pair.cc:537] Connection closed by peer [bold]")
'''


@pytest.mark.slow
def test_a_plugin_error_holding_markup_disables_the_plugin_and_profile_shows_it(tmp_path):
    (tmp_path / "markup_plugin.py").write_text(MARKUP_PLUGIN)
    command = small_run(
        Path(BUILTIN_TINY_MODEL), tmp_path / "runs", "markup", 2, "plugins.enabled=[markup_plugin:GlooLikeFailure]"
    )
    environment_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path), environment_path])
    try:
        result = tlt(command, TRAINING_TIMEOUT_S)
    finally:
        os.environ["PYTHONPATH"] = environment_path
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output
    assert "GlooLikeFailure disabled on worker 0: on_rollout_start raised" in output
    assert "[/tmp/gloo/transport/tcp/pair.cc:537] Connection closed by peer [bold]" in output
    profile = runner.invoke(app, ["profile", str(tmp_path / "runs" / "markup"), "--no-plots"])
    assert profile.exit_code == 0 and profile.exception is None, profile.output
    assert "pair.cc:537] Connection closed by peer [bold]" in " ".join(profile.output.split())  # lines wrap
