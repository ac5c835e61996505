"""Small items of issue 66 (a new user's first hour, round 3): export-drafter's lines before torch loads and before
the target loads, and tlt profile's configuration labels whole at 100 columns; each on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from tests import test_profile
from tests.test_first_hour_round2 import EXPORT, STOP_AT_TORCH, run_python
from tlt_cli.cli import EXPORT_DRAFTER_LOADING_LINE, app
from tlt_cli.config.loading import load_recipe
from tlt_cli.export import DrafterSource, loading_sentence


def test_export_drafter_says_what_it_loads_before_torch_is_imported(tmp_path):
    ran = run_python(STOP_AT_TORCH + EXPORT, tmp_path, "export-drafter", str(tmp_path), str(tmp_path / "out"))
    assert EXPORT_DRAFTER_LOADING_LINE in ran.stdout and "<torch imported here>" in ran.stdout, ran.stdout + ran.stderr
    assert ran.stdout.index(EXPORT_DRAFTER_LOADING_LINE) < ran.stdout.index("<torch imported here>")


def test_the_line_before_the_target_loads_names_the_model_the_checkpoint_and_the_drafter():
    recipe = load_recipe(Path(__file__).parents[1] / "recipes" / "tiny-cpu.yaml")
    checkpoint = Path("runs/tiny-cpu/checkpoints/step_000006")
    from_run = DrafterSource(checkpoint / "drafter", recipe, rl_step=5, checkpoint_dir=checkpoint)
    assert loading_sentence(from_run) == (
        "loading the target builtin:tiny-arith with the actor weights of runs/tiny-cpu/checkpoints/step_000006 and "
        "the drafter in runs/tiny-cpu/checkpoints/step_000006/drafter"
    )
    alone = DrafterSource(Path("my-drafter"), recipe, rl_step=None, checkpoint_dir=None)
    assert loading_sentence(alone) == "loading the target builtin:tiny-arith and the drafter in my-drafter"


def test_tlt_profile_shows_whole_configuration_labels_at_100_columns(tmp_path):
    records = test_profile.hand_made_trace()
    for record in records:
        if record.get("config") == "s4-k1-t5":  # a hybrid's label, as mode auto's n-gram hybrids are named
            record["config"] = "s4-k1-t5+ngram8"
    test_profile.write_jsonl(tmp_path / "trace.jsonl", records)
    result = CliRunner().invoke(app, ["profile", str(tmp_path), "--no-plots"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert "│ s4-k1-t5+ngram8 │" in result.output and "…" not in result.output, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 100
