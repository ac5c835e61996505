"""The real-model recipe: where it finds its model (fast), and end to end (slow): `tlt train
recipes/real-cpu.yaml train.steps=3`, then `tlt profile` of it.

The recipe names its model `cache:models/SmolLM2-135M-Instruct`, the folder under tlt's cache
($TLT_CACHE_DIR, else ~/.cache/tlt) that scripts/make_real_model.py writes. The slow test needs
that folder in the user's cache (it skips without it) and passes it to the run by its full path,
since the tests' own TLT_CACHE_DIR is a temporary folder. Its drafter starts fresh (drafter.init online:
no offline warm-up before step 0); each RL step takes minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tests.tiny_models import tiny_qwen2
from tlt_cli.cli import app
from tlt_cli.config import load_recipe
from tlt_cli.models.loading import load_policy, resolve_model_path
from tlt_cli.models.tiny import save_model_folder, tiny_tokenizer
from tlt_cli.recipes import RECIPES_DIRECTORY

RECIPE = RECIPES_DIRECTORY / "real-cpu.yaml"
# resolved when the module loads, before the tests' TLT_CACHE_DIR points at a temporary folder
MODEL = resolve_model_path(load_recipe(RECIPE).model.path)
STEPS = 3


def tlt(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tlt_cli", *arguments], check=False, capture_output=True, text=True, timeout=3 * 3600
    )


def test_the_recipe_names_its_model_under_tlts_cache(tmp_path, monkeypatch):
    assert load_recipe(RECIPE).model.path == "cache:models/SmolLM2-135M-Instruct"
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    assert resolve_model_path("cache:models/SmolLM2-135M-Instruct") == tmp_path / "models/SmolLM2-135M-Instruct"
    monkeypatch.delenv("TLT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_model_path("cache:models/m") == tmp_path / "home/.cache/tlt/models/m"
    assert resolve_model_path("~/m") == tmp_path / "home/m"


def test_a_model_in_the_cache_loads_by_its_cache_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    tokenizer = tiny_tokenizer()
    save_model_folder(tiny_qwen2(len(tokenizer)), tokenizer, tmp_path / "models" / "tiny")
    model, _ = load_policy("cache:models/tiny")
    assert model.config.vocab_size == len(tokenizer)


def test_validate_names_the_script_to_run_when_the_cache_model_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["recipes", "validate", str(RECIPE)])
    assert result.exit_code != 0
    message = [line for line in result.output.splitlines() if "model.path" in line]
    assert len(message) == 1 and "python scripts/make_real_model.py" in message[0], result.output
    assert str(tmp_path / "models" / "SmolLM2-135M-Instruct") in message[0]
    assert "Traceback" not in result.output


@pytest.mark.slow
@pytest.mark.skipif(
    not (MODEL / "config.json").is_file(), reason=f"no {MODEL}: make it with scripts/make_real_model.py"
)
def test_real_recipe_trains_three_steps_and_its_profile_shows_the_tail(tmp_path):
    trained = tlt("train", str(RECIPE), f"train.steps={STEPS}", f"run.output_dir={tmp_path}", f"model.path={MODEL}")
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    run_directory = tmp_path / "real-cpu"
    profiled = tlt("profile", str(run_directory), "--json", "--no-plots")
    assert profiled.returncode == 0, profiled.stdout[-4000:] + profiled.stderr[-4000:]
    profile = json.loads(profiled.stdout)
    assert [step["step"] for step in profile["steps"]] == list(range(STEPS))
    assert all(step["rollout_seconds"] > 0 and step["tail_seconds"] >= 0 for step in profile["steps"])
    assert profile["lengths"]["tail_ratio"] is not None
    shown = tlt("profile", str(run_directory), "--no-plots")
    assert shown.returncode == 0 and "tail" in shown.stdout
