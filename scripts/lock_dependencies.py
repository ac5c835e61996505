"""Write tlt's tested dependency set (tlt_cli/constraints.txt) from a resolved environment.

Run it in the environment the tests just passed in, made the way README command 2 makes it:

    pip install torch==2.13.0 && pip install -e ".[dev,trl,tensorboard,wandb]" && pytest
    python scripts/lock_dependencies.py            # rewrites tlt_cli/constraints.txt
    python scripts/lock_dependencies.py --check    # exit 1 if the file differs from this environment

The file pins every distribution that tlt and its dev, trl, tensorboard and wandb extras need
(pip's constraints: what README commands 1 and 2 and .ci/run install with `-c`), so a new user gets
exactly the versions the tests passed with. torch is written without its local label (`2.13.0`,
not `2.13.0+cpu`), which pip matches to the CPU wheel on disk. `tlt --version` compares the
installed versions with this file (tlt_cli/versions.py). Say in CHANGELOG.md when the set moves.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK_FILE = Path(__file__).resolve().parents[1] / "tlt_cli" / "constraints.txt"
HEADER = """\
# tlt's tested dependency set: the versions README command 2's tests passed with (Python {python}, CPU).
# Installed with `pip install -c tlt_cli/constraints.txt ...` by README commands 1 and 2 and .ci/run.
# Written by scripts/lock_dependencies.py from a resolved environment; do not edit by hand.
"""
# the extras the tested set covers (README command 2); sglang's pins torch 2.14.1 and is a GPU install
LOCKED_EXTRAS = ("dev", "trl", "tensorboard", "wandb")


def dependency_closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Every distribution `root[extras]` needs in this environment, transitively: canonical name -> version.

    Walks the installed metadata (what pip resolved), evaluating each requirement's markers for this
    Python and the extras asked of its parent; an optional requirement that is not installed is skipped."""
    versions: dict[str, str] = {}
    pending = [(root, extras)]
    while pending:
        name, wanted_extras = pending.pop()
        for requirement_text in metadata.requires(name) or []:
            requirement = Requirement(requirement_text)
            environments = [{"extra": extra} for extra in wanted_extras] or [{"extra": ""}]
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            dependency = canonicalize_name(requirement.name)
            try:
                version = metadata.version(dependency)
            except metadata.PackageNotFoundError:
                continue
            if dependency not in versions:
                versions[dependency] = Version(version).public
                pending.append((dependency, tuple(requirement.extras)))
    return versions


def locked_lines() -> list[str]:
    """One `name==version` line per distribution tlt and its locked extras need, sorted by name,
    local labels dropped (torch 2.13.0+cpu is written 2.13.0)."""
    pins = dependency_closure("tlt", LOCKED_EXTRAS)
    return [f"{name}=={pins[name]}" for name in sorted(pins)]


def lock_text(lines: list[str]) -> str:
    python = ".".join(str(part) for part in sys.version_info[:2])
    return HEADER.format(python=python) + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock file differs from this environment")
    arguments = parser.parse_args()
    lines = locked_lines()
    text = lock_text(lines)
    if arguments.check:
        same = LOCK_FILE.exists() and LOCK_FILE.read_text() == text
        print(f"{LOCK_FILE}: {'matches' if same else 'differs from'} this environment")
        return 0 if same else 1
    temporary = LOCK_FILE.with_suffix(".txt.tmp")
    temporary.write_text(text)
    temporary.replace(LOCK_FILE)
    print(f"wrote {LOCK_FILE} ({len(lines)} pins)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
