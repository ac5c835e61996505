"""A plain (non-editable) install works: pyproject.toml ships every package, the model and the recipes.

A subpackage missing from pyproject's list, or data read from next to the repository, works in an
editable install and breaks a plain one. The install test builds a wheel from a copy of the
sources, installs it with pip into a fresh virtual environment (its dependencies, torch included,
are borrowed from the running one through a .pth file: nothing is downloaded) and runs the
installed `tlt` from outside the repository.
"""

import shutil
import site
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(SETUPTOOLS["packages"])
    package_dirs = {name: ROOT / folder for name, folder in SETUPTOOLS["package-dir"].items()}
    found = set()
    for top_name, top_dir in package_dirs.items():
        for init in top_dir.rglob("__init__.py"):
            relative = init.parent.relative_to(top_dir)
            found.add(".".join([top_name, *relative.parts]))
    assert found == listed


def test_a_plain_install_finds_its_packages_model_and_recipes(tmp_path):
    sources = tmp_path / "sources"
    for folder in set(SETUPTOOLS["package-dir"].values()):
        shutil.copytree(ROOT / folder, sources / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for file_name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / file_name, sources / file_name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", tmp_path / "wheels", sources],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    environment = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", environment], check=True)
    python = environment / "bin" / "python"
    installed = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (installed / "borrowed_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = next((tmp_path / "wheels").glob("tlt-*.whl"))
    subprocess.run(
        [*pip, "--python", python, "install", "--no-deps", "--no-index", wheel],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )

    for package in SETUPTOOLS["packages"]:
        assert (installed / package.replace(".", "/") / "__init__.py").is_file(), package
    assert (installed / "tlt_cli" / "models" / "tiny_arith" / "config.json").is_file()
    where = subprocess.run(
        [python, "-c", "import tlt_cli.recipes as r; print(r.RECIPES_DIRECTORY)"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout.strip()
    assert Path(where) == installed / "tlt_recipes"
    tlt = [environment / "bin" / "tlt"]
    shown = subprocess.run([*tlt, "--version"], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert "transformers " in shown  # the tested set (constraints.txt) ships with the package
    listed = subprocess.run([*tlt, "recipes", "list"], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert sorted(line.split()[0] for line in listed.splitlines()) == sorted(
        path.stem for path in (ROOT / "recipes").glob("*.yaml")
    )
    validated = subprocess.run([*tlt, "recipes", "validate", "tiny-cpu"], capture_output=True, text=True, cwd=tmp_path)
    assert validated.returncode == 0 and validated.stdout.strip() == "ok  tiny-cpu: valid", (
        validated.stdout + validated.stderr
    )
