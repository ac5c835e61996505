"""Small items of issue 66 (a new user's first hour, round 2): the op-build sentence only when the op is built,
exports that say what they measure and write their files with one mode, and the like; each on CPU in seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tlt_cli.cli import LOADING_LINE
from tlt_cli.processes import op_build
from tlt_cli.processes.worker_events import starting_sentence

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
    environment = {**os.environ, "TLT_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "100"}
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
