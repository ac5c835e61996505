"""Small items of issue 66 (a new user's first hour, round 2): the op-build sentence only when the op is built,
exports that say what they measure and write their files with one mode, and the like; each on CPU in seconds."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from rich.console import Console
from typer.testing import CliRunner

from tests import test_display, test_export, test_export_policy, test_profile
from tlt_cli.cli import LOADING_LINE, app
from tlt_cli.display import TrainingDisplay
from tlt_cli.processes import op_build
from tlt_cli.processes.resume_point import resuming_sentence
from tlt_cli.processes.worker_events import starting_sentence

# fixtures: a run directory with checkpoints, and a drafter folder beside its tiny target and recipe
trained_run = test_export_policy.trained_run
drafter_folder = test_export.drafter_folder

# `tlt train` through the CLI in a fresh interpreter: whether torch was imported by the time it answered
TRAIN_WITHOUT_TORCH = """
import sys
from typer.testing import CliRunner
from tlt_cli.cli import app

result = CliRunner().invoke(app, ["train", *sys.argv[1:]])
print(result.output, end="")
print("exit", result.exit_code, "torch imported", "torch" in sys.modules)
"""

# a finder that stops the interpreter the moment torch is first imported, saying so on stdout
STOP_AT_TORCH = """
import sys

class StopAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("<torch imported here>")
            raise SystemExit(9)
        return None

sys.meta_path.insert(0, StopAtTorch())
"""


def run_python(code: str, tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    # DS_ACCELERATOR unset, as in a user's shell (an in-process DeepSpeed fixture sets it in this one)
    environment = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    environment.update(TLT_CACHE_DIR=str(tmp_path / "cache"), COLUMNS="100")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *arguments],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env=environment,
    )


def test_a_recipe_key_typo_is_answered_before_torch_is_imported(tmp_path):
    ran = run_python(TRAIN_WITHOUT_TORCH, tmp_path, "tiny-cpu", "trian.steps=3")
    lines = ran.stdout.strip().splitlines()
    assert lines[-1] == "exit 2 torch imported False", ran.stdout + ran.stderr
    assert lines[:-1] == [
        "error: override key 'trian.steps' is not a recipe key; did you mean 'train.steps'? sections are: run, "
        "model, task, train, workers, rollout, actor, checkpoint, speculative, drafter, plugins, trl."
    ]


def test_tlt_train_says_what_it_loads_before_torch_is_imported(tmp_path):
    ran = run_python(STOP_AT_TORCH + TRAIN_WITHOUT_TORCH, tmp_path, "tiny-cpu", "train.steps=1")
    loading = LOADING_LINE
    assert loading in ran.stdout and "<torch imported here>" in ran.stdout, ran.stdout + ran.stderr
    assert ran.stdout.index(loading) < ran.stdout.index("<torch imported here>")


def built_op(extensions: Path) -> None:
    """The .so torch leaves after building DeepSpeed's shared-memory op."""
    folder = extensions / op_build.SHARED_MEMORY_OP
    folder.mkdir(parents=True)
    (folder / f"{op_build.SHARED_MEMORY_OP}.so").write_bytes(b"")


def test_the_op_build_is_announced_only_when_the_cache_lacks_the_built_op(tmp_path, monkeypatch):
    extensions = tmp_path / op_build.EXTENSIONS_FOLDER
    builds = []
    monkeypatch.setattr(op_build, "build_shared_memory_op", lambda: builds.append("built"))
    said: list[str] = []
    op_build.built_deepspeed_ops(extensions, said.append)
    assert said == ["building DeepSpeed's CPU op (minutes, once per cache)"]
    assert "DeepSpeed builds its ops" in starting_sentence(2, extensions)
    built_op(extensions)
    said.clear()
    op_build.built_deepspeed_ops(extensions, said.append)
    assert said == [], "a built op is loaded in a second: nothing may say it builds"
    assert builds == ["built", "built"], "torch's loader still runs (it loads the .so)"
    assert starting_sentence(2, extensions) == "starting 2 worker(s): each loads the model"


# an export through the CLI in a fresh interpreter, as a user runs it: its output, then whether DeepSpeed was imported
EXPORT = """
import sys
from typer.testing import CliRunner
from tlt_cli.cli import app

result = CliRunner().invoke(app, sys.argv[1:])
print(result.output, end="")
print("exit", result.exit_code, "deepspeed imported", "deepspeed" in sys.modules)
"""


def test_export_policy_prints_no_deepspeed_warning_and_writes_every_file_with_the_umasks_mode(tmp_path, trained_run):
    run, _ = trained_run
    out = tmp_path / "policy"
    previous = os.umask(0o022)
    try:
        exported = run_python(EXPORT, tmp_path, "export-policy", str(run), str(out))
    finally:
        os.umask(previous)
    assert exported.stdout.strip().splitlines()[-1].startswith("exit 0"), exported.stdout + exported.stderr
    assert "Setting accelerator" not in exported.stdout + exported.stderr
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in out.iterdir()}
    assert modes["model.safetensors"] == "0o644" and set(modes.values()) == {"0o644"}, modes


def test_export_drafter_says_what_it_measures_before_it_measures_without_deepspeeds_warning(tmp_path, drafter_folder):
    drafter, recipe, _ = drafter_folder
    out = tmp_path / "out"
    previous = os.umask(0o022)
    try:
        exported = run_python(
            EXPORT, tmp_path, "export-drafter", str(drafter), str(out), "--recipe", str(recipe), "--prompts", "1"
        )
    finally:
        os.umask(previous)
    lines = exported.stdout.strip().splitlines()
    assert lines[-1].startswith("exit 0 "), exported.stdout + exported.stderr
    assert "Setting accelerator" not in exported.stdout + exported.stderr
    loading = [number for number, line in enumerate(lines) if line.startswith("loading the target ")]
    measuring = [number for number, line in enumerate(lines) if line.startswith("measuring the drafter's accept")]
    exported_line = [number for number, line in enumerate(lines) if line.startswith("exported ")]
    assert loading and measuring and exported_line, exported.stdout
    assert lines[0] == "tlt export-drafter: loading torch and transformers", exported.stdout
    assert loading[0] < measuring[0] < exported_line[0], exported.stdout
    assert "1 held-out prompts, one at a time, up to 40 new tokens each with 4 draft tokens" in lines[measuring[0]]
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


def test_a_resumed_runs_live_count_starts_at_its_resumed_step_and_the_resume_names_it():
    output = io.StringIO()
    terminal = Console(file=output, width=100, force_terminal=True)
    with TrainingDisplay(terminal, "tlt train tiny-cpu", 6, start_step=3) as display:
        display.add_step({**test_display.BASE, "step": 3})
    assert "tlt train tiny-cpu: step 4/6" in output.getvalue()
    assert "step 1/6" not in output.getvalue()
    assert resuming_sentence(Path("runs/tiny-cpu/checkpoints/step_000003"), 3, 6) == (
        "resuming from runs/tiny-cpu/checkpoints/step_000003, written after step 2: the run continues at step 3 of "
        "steps 0-5"
    )
    assert resuming_sentence(Path("c"), 6, 6) == "resuming from c: all 6 steps are done, none is left to run"


def test_tlt_profiles_tables_fit_100_columns_and_leave_out_depths_no_pass_drafted(tmp_path):
    records = test_profile.hand_made_trace()
    for record in records:
        if "accepted_by_depth" in record:  # a chain of 8 draft tokens a pass of which only 3 were drafted
            record["accepted_by_depth"] = [*record["accepted_by_depth"], 0, 0, 0, 0, 0]
            record["proposed_by_depth"] = [*record["proposed_by_depth"], 0, 0, 0, 0, 0]
    test_profile.write_jsonl(tmp_path / "trace.jsonl", records)
    result = CliRunner().invoke(app, ["profile", str(tmp_path), "--no-plots"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100 and "…" not in result.output, result.output
    depth_rows = [line.split()[1] for line in lines if line.startswith("│") and line.count("│") == 6]
    assert depth_rows == ["1", "2", "3"], result.output


def test_tlts_own_lines_wrap_at_word_boundaries_in_a_terminal_and_stay_one_line_in_a_log():
    sentence = " ".join(f"word{number:03d}" for number in range(40))  # 319 characters, no word cut at 100
    terminal_output, log_output = io.StringIO(), io.StringIO()
    terminal = Console(file=terminal_output, width=100, force_terminal=True, color_system=None)
    TrainingDisplay(terminal, "run", 2).progress(sentence)  # a preparation line, before the live table starts
    wrapped = terminal_output.getvalue().splitlines()
    assert " ".join(wrapped).split() == sentence.split() and len(wrapped) == 4, wrapped
    assert all(len(line) <= 100 for line in wrapped)
    TrainingDisplay(Console(file=log_output, width=100), "run", 2).progress(sentence)
    assert log_output.getvalue().splitlines() == [sentence]
