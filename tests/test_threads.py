"""Torch's threads are set in one helper (tlt_cli/tuning/threads.py `torch_threads`) plus the process entry points:
the helper gives the count back after its block (an error included), and no other tlt_cli module calls
`torch.set_num_threads`, read with `ast`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tlt_cli.tuning.threads import torch_threads

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "tlt_cli"

# module path under tlt_cli/ -> why it may set torch's threads itself
SETTERS = {
    "tuning/threads.py": "the helper",
    "processes/distributed.py": "a native worker's entry point: the count for the process's life",
    "integrations/trl_run.py": "a TRL worker's entry point: the count for the process's life",
}


def test_the_helper_sets_the_count_inside_and_restores_it_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(before + 1):
        assert torch.get_num_threads() == before + 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == before


def thread_setters() -> set[str]:
    """The tlt_cli modules that call `set_num_threads`."""
    found = set()
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "set_num_threads":
                    found.add(path.relative_to(PACKAGE_ROOT).as_posix())
    return found


def test_only_the_helper_and_the_entry_points_set_torchs_threads():
    assert thread_setters() == set(SETTERS)
