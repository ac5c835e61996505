"""The examples run as a reader runs them: `python examples/minimal_grpo.py`, here with a tiny step."""

import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_minimal_grpo_runs_grpo_steps_and_prints_their_rewards():
    result = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "minimal_grpo.py"),
            "--steps",
            "2",
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rewards = [float(reward) for reward in re.findall(r"^step \d+: mean reward (\S+)", result.stdout, re.MULTILINE)]
    assert len(rewards) == 2 and all(0.0 <= reward <= 1.0 for reward in rewards)
