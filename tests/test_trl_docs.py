"""docs/trl.md's script runs as written: the test takes the first Python block under "Using tlt with your own TRL
script", runs it unchanged in a fresh folder and cache, and checks that TRL trained and tlt said what it did."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "trl.md"
SECTION = "## Using tlt with your own TRL script"


def docs_script() -> str:
    section = DOCS.read_text(encoding="utf-8").split(SECTION, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_docs_script_is_a_whole_script():
    script = docs_script()
    for needed in ("from trl import GRPOConfig, GRPOTrainer", "rollout_func=tlt_rollout()", "trainer.train()"):
        assert needed in script, needed
    compile(script, str(DOCS), "exec")


def test_the_docs_script_runs_as_written(tmp_path):
    (tmp_path / "script.py").write_text(docs_script(), encoding="utf-8")
    environment = {**os.environ, "TLT_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout
    assert "tlt rollout: ready in " in printed
    (end,) = [line for line in printed.splitlines() if line.startswith("tlt rollout: done: ")]
    assert re.match(r"tlt rollout: done: \d+ rollouts, [\d.]+ s decoding", end), end
    assert "SD" in end
    assert (tmp_path / "trl-grpo-out").is_dir(), "TRL trained into the script's output_dir"
