"""Small items of issue 66 (a new user's first hour, round 2): the op-build sentence only when the op is built,
exports that say what they measure and write their files with one mode, and the like; each on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

from tlt_cli.processes import op_build
from tlt_cli.processes.worker_events import starting_sentence


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
