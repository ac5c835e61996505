"""Which versions of the libraries tlt reaches into are installed, against the ones it was tested with.

The tested set is tlt_cli/constraints.txt (the lock README's commands install with, written by
scripts/lock_dependencies.py); the supported range of each library is tlt's own requirement in
pyproject.toml, read back from the installed package's metadata, so neither is written twice.
`tlt --version` prints `version_table()`, the trace's run record carries `installed_versions()`,
and every command starts by printing `out_of_range_warnings()` (one sentence a library) so a user
on an untested release reads that first instead of a traceback deep inside a forward.
Only metadata is read: nothing here imports torch or transformers.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from importlib import metadata, resources

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

# the libraries whose versions a run depends on (sglang only where it is installed)
TRACKED = ("torch", "transformers", "deepspeed", "trl", "sglang")


@dataclass(frozen=True)
class LibraryVersion:
    name: str
    installed: str | None  # None: not installed
    tested: str | None  # the lock's version; None: not in the tested set (sglang)
    supported: str  # tlt's requirement for it, e.g. ">=5.0,<=5.24.0" ("" if tlt names none)

    @property
    def in_tested_set(self) -> bool:
        return self.installed is not None and self.installed == self.tested

    @property
    def in_supported_range(self) -> bool:
        if self.installed is None or not self.supported:
            return True
        return SpecifierSet(self.supported).contains(self.installed, prereleases=True)


def installed_version(name: str) -> str | None:
    """The installed version without its local label (torch's `+cpu`), or None."""
    try:
        return Version(metadata.version(name)).public
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """tlt, Python, and each tracked library's installed version (None: not installed); the trace records it."""
    versions: dict[str, str | None] = {"tlt": installed_version("tlt"), "python": platform.python_version()}
    versions.update({name: installed_version(name) for name in TRACKED})
    return versions


def tested_versions() -> dict[str, str]:
    """The lock's pins, canonical name -> version."""
    text = resources.files("tlt_cli").joinpath("constraints.txt").read_text()
    pins = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            pins[canonicalize_name(requirement.name)] = str(requirement.specifier).removeprefix("==")
    return pins


def supported_ranges() -> dict[str, str]:
    """tlt's own requirement per library (extras included), canonical name -> specifier text."""
    ranges = {}
    for line in metadata.requires("tlt") or []:
        requirement = Requirement(line)
        ranges[canonicalize_name(requirement.name)] = str(requirement.specifier)
    return ranges


def library_versions() -> list[LibraryVersion]:
    tested, supported = tested_versions(), supported_ranges()
    return [
        LibraryVersion(name, installed_version(name), tested.get(name), supported.get(name, "")) for name in TRACKED
    ]


def version_table() -> list[str]:
    """The lines `tlt --version` prints: tlt, Python, then each tracked library with a mark where it is
    not the tested version."""
    lines = [f"tlt {installed_version('tlt')}", f"python {platform.python_version()}"]
    for library in library_versions():
        if library.installed is None:
            if library.name != "sglang":
                lines.append(f"{library.name} not installed")
            continue
        lines.append(f"{library.name} {library.installed}{_mark(library)}")
    return lines


def _mark(library: LibraryVersion) -> str:
    if library.in_tested_set:
        return ""
    if not library.in_supported_range:
        return f"  (outside the supported range {library.supported}; tested with {library.tested or 'none'})"
    if library.tested is None:
        return "  (not in the tested set)"
    return f"  (not the tested version {library.tested})"


def out_of_range_warnings() -> list[str]:
    """One sentence for each installed library outside tlt's supported range."""
    return [
        f"{library.name} {library.installed} is outside the range tlt supports ({library.supported}); "
        f"install the tested set with `pip install -c tlt_cli/constraints.txt -e .` "
        f"(tested with {library.name} {library.tested or library.supported})."
        for library in library_versions()
        if not library.in_supported_range
    ]
