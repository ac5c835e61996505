"""A run's drafter carries to the next run on the model: two `tlt train` runs with TLT on, no flag given.

The first run starts fresh (none held), trains its drafter online and leaves it in the library when it ends; the
second, with the default `drafter.init: auto`, starts from exactly those weights and says so in one line.
"""

from __future__ import annotations

import shutil
import subprocess

from recipe_overrides import small_run

from tlt_cli.checkpoint import DRAFTER_DIRECTORY
from tlt_cli.drafter import library
from tlt_cli.drafter.model import WEIGHTS_FILE


def tlt_on_run(model, output, name):
    """One step of the shared small run on `model` with TLT on (mode auto and the drafter sidecar, as shipped)."""
    return small_run(
        model,
        output,
        name,
        1,
        "speculative.mode=auto",
        "plugins.enabled=[drafter_sidecar]",
        "rollout.max_new_tokens=24",
    )


def words(text):
    """The console's text with its line wrapping undone (rich wraps at the terminal's width)."""
    return " ".join(text.split())


def own_model_copy(small_model, folder):
    """The session's tiny model under new files (new modification times): a model no other test has a drafter
    for, so what this test publishes is read by no other."""
    folder.mkdir()
    for path in small_model.iterdir():
        if path.is_file():
            shutil.copyfile(path, folder / path.name)
    return folder


def test_the_second_run_starts_with_the_drafter_the_first_left(small_model, tmp_path, cache_directory):
    model = own_model_copy(small_model, tmp_path / "model")
    first = subprocess.run(tlt_on_run(model, tmp_path, "first"), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "drafter: none held for this model yet" in words(first.stdout)
    assert "drafter: kept for the next run on this model (step 0" in words(first.stdout)
    held, record = library.newest(cache_directory, model)
    assert record.source == "run first, step 0" and record.model == str(model)
    checkpointed = tmp_path / "first" / "checkpoints" / "step_000001" / DRAFTER_DIRECTORY / WEIGHTS_FILE
    assert (held / WEIGHTS_FILE).read_bytes() == checkpointed.read_bytes()

    second = subprocess.run(tlt_on_run(model, tmp_path, "second"), capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "drafter: the newest drafter tlt holds for this model, from run first, step 0" in words(second.stdout)
    assert f"({held})" in second.stdout.replace("\n", ""), "the line names the folder the workers load"
