"""Run `tlt train` on the tiny recipe as a subprocess and read back its trace: shared by the benchmarks.

records = run_training("off-seed0", ["speculative.mode=off", "run.seed=0"], steps=20, output=Path("runs/bench"))
steps = [record for record in records if record["type"] == "step"]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"


def run_training(
    run_name: str, overrides: list[str], steps: int, output: Path, python_path: Path | None = None
) -> list[dict]:
    """Train `steps` steps of the tiny recipe with `overrides`; the step, worker, sd_config and warning
    records of its trace. `python_path` is prepended to PYTHONPATH (for `module:attribute` plugins)."""
    output.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(output / run_name, ignore_errors=True)  # the benchmark's own scratch run from an earlier call
    command = [
        sys.executable,
        "-m",
        "tlt_cli",
        "train",
        str(RECIPE),
        f"train.steps={steps}",
        f"run.name={run_name}",
        f"run.output_dir={output}",
        f"checkpoint.every={steps}",
        *overrides,
    ]
    environment = dict(os.environ)
    if python_path is not None:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, (str(python_path), environment.get("PYTHONPATH"))))
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=environment)
    lines = (output / run_name / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] in ("step", "worker", "sd_config", "warning")]


def run_variants(
    variants: dict[str, list[str]], overrides: list[str], steps: int, output: Path, python_path: Path | None = None
) -> dict[str, list[dict]]:
    """run_training for each named variant in turn, with the shared overrides after its own."""
    return {
        name: run_training(name.replace("+", "-"), [*variant, *overrides], steps, output, python_path)
        for name, variant in variants.items()
    }


def benchmark_parser(description: str, name: str, default_steps: int = 20) -> argparse.ArgumentParser:
    """What every training benchmark takes: --steps, --output-dir (runs/<name>), --out (<name>.json), overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--output-dir", type=Path, default=Path("runs") / name)
    parser.add_argument("--out", type=Path, default=Path(f"{name}.json"))
    parser.add_argument("overrides", nargs="*", help="extra key=value recipe overrides for every run")
    return parser


def step_rows(records: list[dict]) -> list[dict]:
    return [record for record in records if record["type"] == "step"]


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
