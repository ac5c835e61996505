"""The real-model recipe end to end (slow): `tlt train recipes/real-cpu.yaml train.steps=3`, then `tlt profile` of it.

Needs the model folder the recipe names (scripts/make_real_model.py makes it; the test skips
without it). The drafter warm-up is cached under $TLT_CACHE_DIR as in any run, so only the first
run pays for it (about 10 minutes on 2 cores); each RL step then takes minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tlt_cli.config import load_recipe
from tlt_cli.recipes import RECIPES_DIRECTORY

RECIPE = RECIPES_DIRECTORY / "real-cpu.yaml"
MODEL = Path(load_recipe(RECIPE).model.path)
STEPS = 3


def tlt(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tlt_cli", *arguments], check=False, capture_output=True, text=True, timeout=3 * 3600
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not (MODEL / "config.json").is_file(), reason=f"no {MODEL}: make it with scripts/make_real_model.py"
)
def test_real_recipe_trains_three_steps_and_its_profile_shows_the_tail(tmp_path):
    trained = tlt("train", str(RECIPE), f"train.steps={STEPS}", f"run.output_dir={tmp_path}")
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
