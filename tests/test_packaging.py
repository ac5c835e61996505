"""pyproject.toml ships every package: a subpackage missing from its list works in an editable install and breaks a plain one."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed_in_pyproject():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(settings["packages"])
    package_dirs = {name: ROOT / folder for name, folder in settings["package-dir"].items()}
    found = set()
    for top_name, top_dir in package_dirs.items():
        for init in top_dir.rglob("__init__.py"):
            relative = init.parent.relative_to(top_dir)
            found.add(".".join([top_name, *relative.parts]))
    assert found == listed
