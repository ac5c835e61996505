"""What tlt says about the installed libraries: `tlt --version`, the tested set (tlt_cli/constraints.txt)
against pyproject's ranges, and the one-sentence warning for a library outside its supported range."""

from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from typer.testing import CliRunner

from tlt_cli import versions
from tlt_cli.cli import app

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
LOCKED_EXTRAS = ("dev", "trl", "tensorboard", "wandb")
# libraries whose internals tlt reaches into: each needs an upper bound in pyproject.toml
REACHED_INTO = ("transformers", "deepspeed", "trl", "sglang")

runner = CliRunner()


def pyproject_requirements(extras=tuple(PYPROJECT["optional-dependencies"])) -> list[Requirement]:
    """tlt's core requirements and those of the given extras, as pyproject.toml writes them."""
    texts = [*PYPROJECT["dependencies"]]
    for extra in extras:
        texts += PYPROJECT["optional-dependencies"][extra]
    return [Requirement(text) for text in texts]


def test_version_lists_tlt_python_and_each_library_with_its_installed_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("tlt ") and lines[1].startswith("python ")
    for name in ("torch", "transformers", "deepspeed", "trl"):
        installed = versions.installed_version(name)
        (line,) = [line for line in lines if line.split()[0] == name]
        assert line.split()[1] == installed


def test_the_tested_set_pins_every_requirement_inside_pyprojects_ranges():
    tested = versions.tested_versions()
    assert tested["torch"] == "2.13.0"
    for requirement in pyproject_requirements(LOCKED_EXTRAS):  # the sglang extra is a GPU install, not locked
        name = canonicalize_name(requirement.name)
        assert name in tested, f"{name} is not pinned in tlt_cli/constraints.txt"
        assert requirement.specifier.contains(tested[name], prereleases=True), (name, tested[name])


@pytest.mark.parametrize("name", REACHED_INTO)
def test_libraries_tlt_reaches_into_have_an_upper_bound_at_a_tested_release(name):
    (requirement,) = [r for r in pyproject_requirements() if canonicalize_name(r.name) == name]
    uppers = [spec for spec in requirement.specifier if spec.operator in ("<=", "==")]
    assert uppers, f"{name} has no upper bound at a tested release in pyproject.toml"
    if name in versions.tested_versions():
        assert uppers[0].version == versions.tested_versions()[name]


def test_a_library_outside_its_range_gets_one_warning_sentence_and_the_command_still_runs(monkeypatch):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "5.99.0" if name == "transformers" else real(name))
    (warning,) = versions.out_of_range_warnings()
    assert warning.startswith("transformers 5.99.0 is outside the range tlt supports (")
    assert versions.tested_versions()["transformers"] in warning
    result = runner.invoke(app, ["recipes", "list"])
    assert result.exit_code == 0 and "warning: transformers 5.99.0 is outside" in result.output
    assert "transformers 5.99.0  (outside the supported range" in runner.invoke(app, ["--version"]).output


def test_no_warning_in_the_tested_environment():
    assert versions.out_of_range_warnings() == []
