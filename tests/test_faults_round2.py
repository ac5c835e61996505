"""The chaos suite, round 2 (issue 31): a paused driver, remote code in a model folder, a full disk at the
first checkpoint, resuming the wrong run, hostile run names, records of SGLang servers.

As in tests/test_faults.py, every fault is injected for real into the real CLI (`python -m tlt_cli`
in a subprocess): SIGSTOP of the driver, a model folder whose code would write a marker file, a
small tmpfs, a read-only mount, a live process whose pid a record names. Each case checks what a
user would: the documented exit code (2 for what the user must fix, 1 for a failed run), one
`error:` line on the terminal and no traceback, nothing the user had lost, no process left behind.
The tiny models are copies of the shipped one made in the test's own folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import test_faults as faults
import torch
from recipe_overrides import PLAIN_DECODING, RECIPE, TLT, small_run
from transformers import AutoConfig, AutoModelForCausalLM

from tlt_cli.checkpoint import DiskFullError, prepare_staging, publish, remove_staging, save_collectively
from tlt_cli.config import load_recipe, recipe_to_yaml
from tlt_cli.drafter.model import EagleDrafter, save_drafter
from tlt_cli.export import is_previous_export
from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import SHIPPED_TINY_MODEL
from tlt_cli.processes.run_directory import RunDirectory
from tlt_cli.processes.run_failures import TrainingFailed, after_failure
from tlt_cli.sglang.registry import REGISTRY_DIRECTORY, record_server_groups, stop_recorded_servers
from tlt_cli.trace import read_trace

# a step of the small run takes a few seconds; a pause of the driver well past this deadline must not end it
PAUSED_STEP_TIMEOUT_S = 20
DRIVER_PAUSE_S = PAUSED_STEP_TIMEOUT_S + 10


def tlt(*arguments: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`tlt <arguments>` in a subprocess (the test plugins importable), bounded by the suite's hang guard."""
    return subprocess.run(
        [*TLT, *arguments],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
        env=faults.environment_with_test_plugins(),
    )


def model_copy(folder: Path) -> Path:
    """A copy of the shipped tiny model in `folder` (for a test to damage)."""
    return Path(shutil.copytree(SHIPPED_TINY_MODEL, folder))


# ---------------------------------------------------------------- a paused driver


def test_a_driver_paused_past_the_step_deadline_blames_no_worker_and_the_run_finishes(small_model, tmp_path):
    markers = tmp_path / "markers"
    command = small_run(
        small_model,
        tmp_path,
        "paused",
        3,
        "checkpoint.every=1",
        f"workers.step_timeout_s={PAUSED_STEP_TIMEOUT_S}",
        *faults.mark_rollouts(markers),
    )
    driver = faults.start(command, tmp_path)
    faults.wait_until(lambda: (markers / "rollout-1-1").exists(), faults.HANG_GUARD_SECONDS, process=driver)
    time.sleep(2)  # the driver has read the progress of step 1: its clocks run
    driver.send_signal(signal.SIGSTOP)  # Ctrl-Z; the workers run on
    time.sleep(DRIVER_PAUSE_S)
    driver.send_signal(signal.SIGCONT)  # fg
    code, stdout, stderr = faults.finish(driver, tmp_path)
    assert code == 0, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    faults.assert_intact(tmp_path / "paused", steps=3)


# ---------------------------------------------------------------- remote code in a model folder


def remote_code_model(folder: Path, marker: Path) -> Path:
    """A tiny model folder whose config.json maps an unknown model_type to code in the folder; importing that code
    writes `marker`."""
    model = model_copy(folder)
    config = json.loads((model / "config.json").read_text())
    config["model_type"] = "tlt_probe"
    config["auto_map"] = {"AutoConfig": "probe.ProbeConfig", "AutoModelForCausalLM": "probe.ProbeModel"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "probe.py").write_text(
        "from pathlib import Path\n"
        "from transformers import Qwen2Config, Qwen2ForCausalLM\n"
        f"Path({str(marker)!r}).write_text('the folder code ran')\n"
        "class ProbeConfig(Qwen2Config):\n"
        "    model_type = 'tlt_probe'\n"
        "class ProbeModel(Qwen2ForCausalLM):\n"
        "    config_class = ProbeConfig\n"
    )
    return model


def test_a_model_folder_with_code_is_refused_naming_the_key_even_when_stdin_says_yes(tmp_path):
    marker = tmp_path / "ran"
    model = remote_code_model(tmp_path / "remote", marker)
    result = tlt("recipes", "validate", str(RECIPE), f"model.path={model}", stdin="y\ny\ny\n")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "[y/N]" not in result.stdout + result.stderr, "transformers must never ask"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"invalid model.path: Model folder {model} asks"), result.stderr
    assert "model.trust_remote_code: true" in lines[0]
    assert not marker.exists(), "the folder's code ran"


def test_trusting_a_model_folder_with_code_says_so_plainly(tmp_path):
    marker = tmp_path / "ran"
    model = remote_code_model(tmp_path / "remote", marker)
    result = tlt("recipes", "validate", str(RECIPE), f"model.path={model}", "model.trust_remote_code=true")
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stderr.startswith(
        f"warning: model.trust_remote_code is true, so the Python code that the model folder {model} ships may run."
    ), result.stderr
    assert result.returncode == 0, result.stderr
    assert marker.exists(), "the recipe asked for the folder's code"


# ---------------------------------------------------------------- what validate must refuse before a run starts


def test_a_run_name_too_long_for_a_folder_is_one_sentence(tmp_path):
    result = tlt("recipes", "validate", str(RECIPE), f"run.output_dir={tmp_path}", f"run.name={'n' * 300}")
    assert refused(result) == (
        "invalid run.name is 300 bytes long, more than a folder name may be (255); choose a shorter run.name."
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_name_with_shell_characters_is_refused_under_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    name = "x;touch $HOME`id`"
    result = tlt("recipes", "validate", str(RECIPE), f"workers.hostfile={hostfile}", f"run.name={name}")
    assert refused(result) == (
        "invalid run.name holds ' ' '$' ';' '`', which a hostfile launch would pass through a shell; use "
        "letters, digits and @ % + = : , . / _ - only."
    )


@pytest.mark.parametrize("where", ["working folder", "run directory"])
def test_shell_characters_in_the_resolved_paths_of_a_hostfile_launch_are_refused(tmp_path, where):
    """From a folder named `exp $(touch x)` (or into one through a symlink) the run.name / run.output_dir text is
    clean, but pdsh's remote shell line would carry the absolute path and run the substitution."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    hostile = tmp_path / "exp $(touch x)"
    hostile.mkdir()
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "runs").symlink_to(hostile)
    folder, expected = (hostile, hostile) if where == "working folder" else (tmp_path / "clean", hostile / "tiny-cpu")
    result = subprocess.run(
        [*TLT, "recipes", "validate", str(RECIPE), f"workers.hostfile={hostfile}", "run.output_dir=runs"],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=faults.HANG_GUARD_SECONDS,
    )
    what = "the working folder" if where == "working folder" else "the run directory"
    assert refused(result) == (
        f"invalid workers.hostfile: {what} {expected} holds ' ' '$' '(' ')', which the launcher's remote shell "
        "would read as more than a path; run from, and into, folders named with letters, digits and "
        "@ % + = : , . / _ - only."
    )
    assert not list(tmp_path.rglob("x"))


def test_an_unwritable_cache_folder_is_refused_by_validate(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    result = subprocess.run(
        [*TLT, "recipes", "validate", str(RECIPE), f"run.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=faults.HANG_GUARD_SECONDS,
        env={**faults.environment_with_test_plugins(), "TLT_CACHE_DIR": str(blocker / "tlt")},
    )
    assert refused(result) == (
        f"invalid the cache folder ($TLT_CACHE_DIR, else ~/.cache/tlt): {blocker / 'tlt'} cannot hold tlt's cache "
        f"(built models, drafter warm-ups, compiled ops): {blocker} is not a folder; point it at a writable folder."
    )


def test_a_chat_template_that_raises_is_refused_by_validate(tmp_path):
    model = model_copy(tmp_path / "model")
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ raise_exception('this template takes no user turns') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    result = tlt("recipes", "validate", str(RECIPE), f"model.path={model}", f"run.output_dir={tmp_path}")
    assert refused(result) == (
        f"invalid model.path: the chat template of the tokenizer in {model} fails on the task's first prompt (this "
        "template takes no user turns); fix chat_template in its tokenizer_config.json."
    )


def refused(result: subprocess.CompletedProcess) -> str:
    """The one line of a command that refused with exit code 2 and no traceback."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


# ---------------------------------------------------------------- resuming the wrong run, or an unwritable one


def run_with_a_checkpoint(run_directory: Path, *overrides: str, world_size: int = 2) -> Path:
    """A run directory as `tlt train` leaves it after its first checkpoint (of `world_size` workers): its recipe
    (the default one, plain decoding, `overrides`), a trace of step 0 and checkpoint step_000001."""
    run_directory.mkdir(parents=True)
    recipe = load_recipe(RECIPE, [*PLAIN_DECODING, f"run.output_dir={run_directory.parent}", *overrides])
    (run_directory / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    (run_directory / "trace.jsonl").write_text('{"type": "run"}\n{"type": "step", "step": 0}\n')
    checkpoints = run_directory / "checkpoints"
    (prepare_staging(checkpoints, 1) / "weights.pt").write_bytes(b"weights")
    publish(checkpoints, 1, {"world_size": world_size}, keep=2)
    return run_directory


def test_a_resume_with_another_workers_count_is_refused_before_any_worker_starts(tmp_path):
    run_directory = run_with_a_checkpoint(tmp_path / "runs" / "two")
    result = tlt("train", "--resume", str(run_directory), "workers.count=1", "train.prompts_per_step=2")
    assert refused(result) == (
        f"error: workers.count: checkpoint {run_directory / 'checkpoints' / 'step_000001'} was written by 2 "
        "workers, the recipe has 1; resume with workers.count=2."
    )
    assert (run_directory / "checkpoints" / "step_000001" / "weights.pt").read_bytes() == b"weights"


def test_a_resume_with_another_model_is_refused_before_any_worker_starts(tmp_path):
    run_directory = run_with_a_checkpoint(tmp_path / "runs" / "tiny", f"model.path={model_copy(tmp_path / 'first')}")
    other = tmp_path / "wider"
    config = AutoConfig.from_pretrained(SHIPPED_TINY_MODEL, intermediate_size=1024)
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_TINY_MODEL / tokenizer_file, other / tokenizer_file)
    result = tlt("train", "--resume", str(run_directory), f"model.path={other}")
    line = refused(result)
    assert line.startswith(f"error: model.path: {other} is another model than the run was trained from"), line
    assert line.endswith(f"intermediate_size 512 vs 1024); resume with model.path={tmp_path / 'first'}."), line


@pytest.mark.parametrize(
    ("change", "difference"),
    [
        ("weights", "same config and shapes, but other weight values"),
        ("shape", "config.json differs: intermediate_size 512 vs 1024"),
    ],
)
def test_a_resume_when_the_same_model_path_now_holds_another_model_is_one_sentence(tmp_path, change, difference):
    """The run records its model (config, shapes, weights digest) when its directory is made; the folder is then
    overwritten in place, so only the path still matches. The resume is refused before any worker starts (it was
    99 "size mismatch" lines, rc 1, or, with equal shapes, training silently went on from other weights)."""
    model = model_copy(tmp_path / "model")
    recipe = load_recipe(
        RECIPE, [*PLAIN_DECODING, f"run.output_dir={tmp_path / 'runs'}", "run.name=tiny", f"model.path={model}"]
    )
    RunDirectory.create(recipe).release()
    run_directory = tmp_path / "runs" / "tiny"
    (run_directory / "trace.jsonl").write_text('{"type": "run"}\n{"type": "step", "step": 0}\n')
    (prepare_staging(run_directory / "checkpoints", 1) / "weights.pt").write_bytes(b"weights")
    publish(run_directory / "checkpoints", 1, {"world_size": 2}, keep=2)
    overrides = {"intermediate_size": 1024} if change == "shape" else {}
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model, **overrides)).save_pretrained(model)
    line = refused(tlt("train", "--resume", str(run_directory)))
    assert line == (
        f"error: model.path: {model} now holds another model than run {run_directory} was trained from "
        f"({difference}); resume with the model the run started from, or start a new run."
    )
    assert (run_directory / "checkpoints" / "step_000001" / "weights.pt").read_bytes() == b"weights"


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """`folder`, made and a tmpfs of `size` (mount's syntax: 1m, 24k) mounted on it for the block; skips the test
    where mounting is not allowed. The unmount is lazy, so a file a failed test left open cannot keep it mounted."""
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def test_a_resume_of_a_run_on_a_read_only_file_system_is_one_sentence(tmp_path):
    with small_tmpfs(tmp_path / "read-only", "1m") as mount:
        run_directory = run_with_a_checkpoint(mount / "copied-run", f"run.output_dir={tmp_path / 'first-place'}")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        result = tlt("train", "--resume", str(run_directory))
        assert refused(result) == (
            f"error: run directory {run_directory} cannot be written (Read-only file system), and a run writes its "
            "checkpoints and trace there; copy it to a writable place and --resume the copy."
        )
        assert sorted(path.name for path in run_directory.iterdir()) == ["checkpoints", "recipe.yaml", "trace.jsonl"]


# ---------------------------------------------------------------- a full disk at the first checkpoint


def test_a_full_disk_at_the_first_checkpoint_is_one_sentence_and_frees_the_disk(small_model, tmp_path):
    # 2 MiB: the recipe, the lock, the workers' logs and the trace of step 0 fit, the first checkpoint (tens of MB,
    # after step 1) does not
    with small_tmpfs(tmp_path / "small-disk", "2m") as disk:
        run_directory = disk / "full"
        result = tlt(*small_run(small_model, disk, "full", 3)[len(TLT) :])
        line = refused(result)
        assert line.startswith(f"error: the file system of run directory {run_directory} is full ("), line
        assert line.endswith(
            " bytes free), so checkpoint step_000002 could not be written and its partial files are removed; free "
            "some space; no checkpoint was completed, so start the run again with another run.name or after "
            f"removing {run_directory}."
        ), line
        assert list((run_directory / "checkpoints").iterdir()) == [], "the partial checkpoint keeps the disk full"
        log = (run_directory / "run.log").read_text()
        assert "Traceback" in log and "DiskFullError" in log, log
        assert [record["step"] for record in read_trace(run_directory / "trace.jsonl") if record["type"] == "step"] == [
            0
        ]


def save_onto_a_full_disk(checkpoints: Path, next_step: int) -> tuple[str, type[BaseException]]:
    """The message of the DiskFullError of a one-rank save of 4 MiB of weights into `checkpoints`, and its cause's
    type.

    Only text and a type leave this call: the error's traceback holds torch's file open (the disk stays full)
    until it goes, as it goes with a worker that reported it."""
    try:
        save_collectively(
            checkpoints,
            next_step,
            0,
            lambda: None,
            lambda staging: torch.save(torch.zeros(1 << 20), staging / "weights.pt"),
            {},
            keep=2,
        )
    except DiskFullError as error:  # not pytest.raises: its record of the error is a cycle only gc would free
        return str(error), type(error.__cause__)
    raise AssertionError("4 MiB fitted on a 1 MiB disk")


def test_torch_save_onto_a_full_disk_names_the_disk_and_advises_resume_only_with_a_complete_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "small-disk", "1m") as disk:
        run_directory = disk / "run"
        checkpoints = run_directory / "checkpoints"
        message, cause = save_onto_a_full_disk(checkpoints, 1)
        assert message.startswith(f"the file system of run directory {run_directory} is full ("), message
        assert message.endswith(
            "so checkpoint step_000001 could not be written and its partial files are removed; free some space; no "
            f"checkpoint was completed, so start the run again with another run.name or after removing {run_directory}."
        ), message
        assert cause is RuntimeError, "torch reports a full disk with no errno; its error is kept for the run's log"
        remove_staging(checkpoints)
        (prepare_staging(checkpoints, 1) / "weights.pt").write_bytes(b"weights")
        publish(checkpoints, 1, {}, keep=2)
        message, _ = save_onto_a_full_disk(checkpoints, 2)
        assert message.endswith(
            f"free some space; complete checkpoints are kept, continue with --resume {run_directory}."
        ), message
        remove_staging(checkpoints)
        assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_000001"]


def test_a_runtime_error_of_a_save_on_a_disk_with_room_stays_itself(tmp_path):
    def fail(staging: Path) -> None:
        raise RuntimeError("a bug in a plugin's save")

    with pytest.raises(RuntimeError, match="a bug in a plugin's save") as raised:
        save_collectively(tmp_path / "checkpoints", 1, 0, lambda: None, fail, {}, keep=2)
    assert not isinstance(raised.value, DiskFullError)


def test_a_failed_run_points_at_its_log_only_once_written_and_at_resume_only_with_a_checkpoint(tmp_path):
    run_directory = tmp_path / "run"
    run_directory.mkdir()
    held = RunDirectory.resume(run_directory)
    bug = TrainingFailed("worker 0 failed: RuntimeError: a bug")
    try:
        assert str(after_failure(bug, "Traceback: ...", held, discard=False, keep_log=False)) == (
            f"worker 0 failed: RuntimeError: a bug (traceback in {run_directory / 'run.log'}; no checkpoint was "
            f"completed, so start the run again with another run.name or after removing {run_directory})."
        )
        checkpoints = run_directory / "checkpoints"
        (prepare_staging(checkpoints, 1) / "weights.pt").write_bytes(b"weights")
        publish(checkpoints, 1, {}, keep=2)
        prepare_staging(checkpoints, 2)  # the save the failure cut short
        (run_directory / "run.log").unlink()
        (run_directory / "run.log").mkdir()  # a log that cannot be written
        assert str(after_failure(bug, "Traceback: ...", held, discard=False, keep_log=False)) == (
            f"worker 0 failed: RuntimeError: a bug (complete checkpoints are kept, continue with --resume "
            f"{run_directory})."
        )
        assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_000001"]
    finally:
        held.release()


# ---------------------------------------------------------------- export-drafter onto symbolic links


def drafter_to_export(folder: Path) -> tuple[Path, Path]:
    """(a drafter folder of the shipped tiny model, a recipe naming that model), made in `folder`."""
    save_drafter(EagleDrafter(load_policy(str(SHIPPED_TINY_MODEL))[0], seed=0), folder / "drafter")
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        f"run: {{name: exported, output_dir: {folder / 'runs'}}}\nmodel: {{path: {SHIPPED_TINY_MODEL}}}\n"
        "train: {steps: 2, prompts_per_step: 2, group_size: 2}\nrollout: {max_new_tokens: 24}\n"
    )
    return folder / "drafter", recipe


def export(drafter: Path, output: Path, recipe: Path) -> subprocess.CompletedProcess:
    return tlt("export-drafter", str(drafter), str(output), "--recipe", str(recipe), "--prompts", "1", "--force")


def test_export_force_onto_a_symlinked_output_writes_through_the_link_and_leaves_nothing_beside_it(tmp_path):
    drafter, recipe = drafter_to_export(tmp_path)
    exports = tmp_path / "exports"
    (exports / "v1").mkdir(parents=True)
    (exports / "v1" / "tlt_export.json").write_text("{}")  # a previous export, as far as --force can tell
    (exports / "latest").symlink_to("v1")
    result = export(drafter, exports / "latest", recipe)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(os.listdir(exports)) == ["latest", "v1"], "a stray .previous or staging folder"
    assert os.readlink(exports / "latest") == "v1"
    assert "measurement" in json.loads((exports / "v1" / "tlt_export.json").read_text())
    assert is_previous_export(exports / "v1")


@pytest.mark.parametrize("below_the_link", ["", "exported"])
def test_an_export_through_a_dangling_symlink_is_one_sentence_naming_the_link_and_its_target(tmp_path, below_the_link):
    drafter, recipe = drafter_to_export(tmp_path)
    link = tmp_path / "out"
    link.symlink_to("gone")
    before = sorted(os.listdir(tmp_path))
    result = export(drafter, link / below_the_link if below_the_link else link, recipe)
    assert refused(result) == (
        f"error: {link} is a symbolic link to {tmp_path / 'gone'}, which does not exist; create that folder, or "
        "choose another output folder."
    )
    assert sorted(os.listdir(tmp_path)) == before and link.is_symlink()


# ---------------------------------------------------------------- records of SGLang servers in the run directory


def test_only_the_servers_a_worker_recorded_are_stopped_and_a_malformed_record_is_dropped(tmp_path):
    unrelated = subprocess.Popen(["sleep", "600"], start_new_session=True)  # leads a group of its own, as a server
    server = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        records = tmp_path / REGISTRY_DIRECTORY
        records.mkdir()
        # a record written by hand, or by an older tlt, names the unrelated group with no start of its leader
        (records / "worker-0.json").write_text(json.dumps({"worker": 0, "process_groups": [unrelated.pid]}))
        (records / "worker-2.json").write_text('{"worker": 2, "process_gr')  # cut short
        record_server_groups(tmp_path, 1, [server.pid])
        assert stop_recorded_servers(tmp_path, timeout_s=10) == [server.pid]
        assert server.wait(timeout=faults.HANG_GUARD_SECONDS) == -signal.SIGTERM
        assert unrelated.poll() is None, "a process tlt did not start was signalled"
        assert list(records.iterdir()) == []
    finally:
        for process in (unrelated, server):
            process.kill()
            process.wait()


# ---------------------------------------------------------------- the test suite itself


def test_a_test_session_leaves_no_deepspeed_buffer_in_shared_memory(tmp_path):
    """A session whose test leaves a buffer as a killed rank does (named as DeepSpeed names it, mapped by no one)
    ends with it removed by tests/conftest.py's session fixture."""
    left = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{os.getpid()}_0"
    (tmp_path / "test_killed_rank.py").write_text(
        "from pathlib import Path\n\n"
        f"def test_a_rank_killed_from_outside():\n    Path({str(left)!r}).write_bytes(b'0' * 4096)\n"
    )
    session = faults.inner_pytest_session(tmp_path / "test_killed_rank.py", tmp_path)
    try:
        assert session.returncode == 0, session.stdout[-3000:]
        assert not left.exists(), "the session left its DeepSpeed buffer in /dev/shm"
    finally:
        left.unlink(missing_ok=True)
