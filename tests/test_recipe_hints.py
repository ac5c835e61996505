"""The small refusals of a first hour: `validate` says valid and notes an existing run, a mistyped key or recipe
name gets a "did you mean", and a missing recipe file is refused before torch is imported."""

import subprocess
import sys

from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.processes.run_directory import TRACE_FILE

runner = CliRunner()


def test_validate_says_valid_and_notes_an_existing_run_directory(tmp_path):
    output = f"run.output_dir={tmp_path}"
    fresh = runner.invoke(app, ["recipes", "validate", "tiny-cpu", output])
    assert fresh.exit_code == 0, fresh.output
    assert fresh.output.strip() == "ok  tiny-cpu: valid"
    (tmp_path / "tiny-cpu").mkdir()
    (tmp_path / "tiny-cpu" / TRACE_FILE).write_text("")
    again = runner.invoke(app, ["recipes", "validate", "tiny-cpu", output])
    assert again.exit_code == 0, again.output
    assert "ok  tiny-cpu: valid (note: " in again.output and "already holds a run" in again.output


def test_a_mistyped_key_or_section_gets_the_closest_key():
    key = runner.invoke(app, ["recipes", "validate", "tiny-cpu", "train.step=3"])
    assert key.exit_code == 2 and "did you mean 'train.steps'?" in key.output
    section = runner.invoke(app, ["recipes", "validate", "tiny-cpu", "trian.steps=3"])
    assert section.exit_code == 2 and "did you mean 'train.steps'?" in section.output


def test_a_mistyped_recipe_name_gets_the_closest_shipped_one():
    for command in (["recipes", "validate", "tiny-cp"], ["recipes", "show", "tiny-cp"], ["train", "tiny-cp"]):
        result = runner.invoke(app, command)
        assert result.exit_code == 2, result.output
        assert "recipe file tiny-cp does not exist; did you mean 'tiny-cpu'?" in result.output


def test_a_missing_recipe_file_is_refused_before_torch_is_imported(tmp_path):
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom tlt_cli.cli import app\n"
        f"result = CliRunner().invoke(app, ['train', {str(tmp_path / 'nosuch.yaml')!r}])\n"
        "print(result.exit_code, 'torch' in sys.modules)\nprint(result.output)\n"
    )
    finished = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    first_line, message = finished.stdout.split("\n", 1)
    assert first_line == "2 False" and "nosuch.yaml does not exist" in message
