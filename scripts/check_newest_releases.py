"""The canary: does tlt still work with the newest releases of what it depends on?

    python scripts/check_newest_releases.py [--json newest.json] [--keep]

Exports the committed tree (HEAD) and builds a throwaway virtual environment for it without the lock:
torch 2.13.0 (held: the registry's newer torch builds are CUDA builds of several GB, and the CPU wheel
is what tlt runs here), tlt itself without dependencies, then the newest release the registry has of
every library tlt and its dev, trl, tensorboard and wandb extras name, pyproject.toml's upper bounds
ignored (that is the point).
It runs a named fast subset in it (CHECKS: the engine against transformers on tiny models of each
family, SD identity, a DeepSpeed update, the TRL adapter, `tlt recipes validate`, a 2-step `tlt train`)
and prints one table: package, tested version (tlt_cli/constraints.txt), newest version, and
whether the subset passed with it, then each check's result. Exit 0 when every check passed.

When everything passes on a newer release: re-lock (README command 2 in a fresh environment, then
scripts/lock_dependencies.py), raise the bound in pyproject.toml and say so in CHANGELOG.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tlt_cli.versions import TRACKED, tested_versions  # noqa: E402

LOCKED_EXTRAS = ("dev", "trl", "tensorboard", "wandb")
HELD = {"torch": "2.13.0"}  # the CPU wheel on disk; any newer torch is a multi-GB CUDA download
# the rows of the table beside the tracked libraries
ALSO_SHOWN = ("tensorboard", "wandb", "accelerate", "safetensors", "tokenizers", "numpy")
# check name -> command, run in the repository with the canary environment's Python and tlt
CHECKS: dict[str, list[str]] = {
    "engine vs transformers (tiny Qwen2, Llama; every family the engine decodes)": [
        "{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine.py", "{engine_tests}",
    ],
    "SD greedy identity and sampled distribution": [
        "{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_speculative.py",
        "-k", "token_identical or matches_the_target_distribution",
    ],
    "DeepSpeed update (logprobs, every parameter changes, save/load)": [
        "{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_actor.py",
    ],
    "TRL adapter (GRPOTrainer trains on tlt's rollout; SD identical)": [
        "{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_trl_rollout.py",
        "-k", "trains_every_parameter or token_identical",
    ],
    "tlt recipes validate": ["{tlt}", "recipes", "validate", "tiny-cpu", "trl-tiny-cpu"],
    "tlt train, 2 steps, TLT on": [
        "{tlt}", "train", "recipes/tiny-cpu.yaml", "train.steps=2", "run.output_dir={work}/runs",
        "drafter.warmup_steps=20", "drafter.warmup_prompts=64",
    ],
}  # fmt: skip


@dataclass
class CheckResult:
    name: str
    passed: bool
    seconds: float
    tail: str  # the command's last output lines


def locked_dependency_names(sources: Path) -> list[str]:
    """The libraries tlt and its locked extras name directly (canonical names, no bounds)."""
    project = tomllib.loads((sources / "pyproject.toml").read_text())["project"]
    texts = [
        *project["dependencies"],
        *(text for extra in LOCKED_EXTRAS for text in project["optional-dependencies"][extra]),
    ]
    return sorted({canonicalize_name(Requirement(text).name) for text in texts})


def run_logged(command: list[str], log: Path, **kwargs) -> subprocess.CompletedProcess:
    with open(log, "a") as handle:
        handle.write(f"\n$ {' '.join(map(str, command))}\n")
        handle.flush()
        return subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, text=True, **kwargs)


def committed_sources(work: Path) -> Path:
    """The repository as committed (HEAD), exported under `work`: the canary tests what would land, not
    whatever the working tree holds at the moment."""
    sources = work / "tlt"
    sources.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(sources)], input=archive, check=True)
    return sources


def build_environment(work: Path, sources: Path, log: Path) -> Path:
    """The canary venv: held torch, tlt (from `sources`) without dependencies, then the newest of everything else."""
    environment = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", environment], check=True)
    python = environment / "bin" / "python"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    held = work / "held.txt"
    held.write_text("".join(f"{name}=={version}\n" for name, version in HELD.items()))
    steps = [
        [*pip, "install", *(f"{name}=={version}" for name, version in HELD.items())],
        [*pip, "install", "--no-deps", "-e", str(sources)],
        [*pip, "install", "--upgrade", "--upgrade-strategy", "eager", "-c", held, *locked_dependency_names(sources)],
    ]
    for command in steps:
        if run_logged(command, log).returncode != 0:
            raise SystemExit(f"building the canary environment failed; see {log}")
    return python


def installed_in(python: Path) -> dict[str, str]:
    listed = subprocess.run(
        [python, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {canonicalize_name(item["name"]): item["version"].split("+")[0] for item in json.loads(listed)}


def expanded(template: list[str], fields: dict[str, str | list[str]]) -> list[str]:
    """The command of a check: each `{name}` part replaced by its field, a list field by its items."""
    command = []
    for part in template:
        value = fields.get(part[1:-1]) if part.startswith("{") and part.endswith("}") else None
        command.extend(value if isinstance(value, list) else [part.format(**fields)])
    return command


def run_checks(python: Path, work: Path, sources: Path, log: Path) -> list[CheckResult]:
    fields = {
        "python": str(python),
        "tlt": str(python.parent / "tlt"),
        "work": str(work),
        # the owned decode forward's tests, once they exist (issue 28)
        "engine_tests": [str(path.relative_to(sources)) for path in sorted((sources / "tests").glob("test_owned*.py"))],
    }
    environment = {**os.environ, "TLT_CACHE_DIR": str(work / "cache"), "PATH": f"{python.parent}:{os.environ['PATH']}"}
    results = []
    for name, template in CHECKS.items():
        started = time.perf_counter()
        completed = run_logged(expanded(template, fields), log, cwd=sources, env=environment, timeout=1800)
        tail = " | ".join(log.read_text().splitlines()[-3:])
        results.append(CheckResult(name, completed.returncode == 0, time.perf_counter() - started, tail))
        print(f"  {'pass' if results[-1].passed else 'FAIL'}  {name} ({results[-1].seconds:.0f} s)", flush=True)
    return results


def registry_newest(name: str) -> str:
    """The newest release of `name` the registry lists (pip index versions), or "?"."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
        capture_output=True,
        text=True,
    ).stdout
    first = listed.splitlines()[0] if listed else ""
    return first.partition("(")[2].rstrip(")") or "?"


def package_rows(newest: dict[str, str], all_passed: bool) -> list[dict]:
    tested = tested_versions()
    rows = []
    for name in (*TRACKED, *ALSO_SHOWN):
        if name not in newest and name not in tested:
            continue
        same = newest.get(name) == tested.get(name)
        held = f" (held; the registry has {registry_newest(name)}, a CUDA build)" if name in HELD else ""
        verdict = "tested" if same else ("pass" if all_passed else "fail")
        rows.append(
            {
                "package": name,
                "tested": tested.get(name, "-"),
                "newest": newest.get(name, "-") + held,
                "result": verdict,
            }
        )
    return rows


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(column), *(len(str(row[column])) for row in rows)) for column in columns]
    print("  ".join(column.ljust(width) for column, width in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row[column]).ljust(width) for column, width in zip(columns, widths)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the tables here")
    parser.add_argument("--keep", action="store_true", help="keep the throwaway environment (its path is printed)")
    arguments = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tlt-canary-"))
    log = work / "canary.log"
    started = time.perf_counter()
    print(f"building the canary environment in {work} (log: {log})", flush=True)
    sources = committed_sources(work)
    python = build_environment(work, sources, log)
    newest = installed_in(python)
    print(f"built in {time.perf_counter() - started:.0f} s; running the subset", flush=True)
    results = run_checks(python, work, sources, log)
    all_passed = all(result.passed for result in results)
    rows = package_rows(newest, all_passed)
    print()
    print_table(rows, ["package", "tested", "newest", "result"])
    print()
    print_table(
        [{"check": r.name, "result": "pass" if r.passed else "FAIL", "seconds": f"{r.seconds:.0f}"} for r in results],
        ["check", "result", "seconds"],
    )
    verdict = "every check passed" if all_passed else f"some checks FAILED (log: {log})"
    print(f"\n{verdict}; {time.perf_counter() - started:.0f} s in all")
    if arguments.json:
        arguments.json.write_text(json.dumps({"packages": rows, "checks": [asdict(r) for r in results]}, indent=2))
    if arguments.keep or not all_passed:
        print(f"canary environment kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all_passed else 1


if __name__ == "__main__":
    sys.exit(main())
