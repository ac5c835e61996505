"""Run `tlt train` on a recipe (the tiny one by default) as a subprocess and read back its trace, and the
figures a side-by-side comparison prints: shared by the benchmarks.

records = run_training("off-seed0", ["speculative.mode=off", "run.seed=0"], steps=20, output=Path("runs/bench"))
steps = [record for record in records if record["type"] == "step"]
side_by_side({"rollout_seconds": 20, "step_seconds": 40}, {"rollout_seconds": 10, "step_seconds": 30})
# rollout 2.0x, step 1.33x, Amdahl bound 1 / (0.5 + 0.5 / 2) = 1.33x: the step got all the bound allows
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"


def run_training(
    run_name: str,
    overrides: list[str],
    steps: int,
    output: Path,
    python_path: Path | None = None,
    recipe: Path = RECIPE,
) -> list[dict]:
    """Train `steps` steps of `recipe` (the tiny one) with `overrides`; the step, worker, sd_config and
    warning records of its trace. `python_path` is prepended to PYTHONPATH (for `module:attribute` plugins)."""
    output.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(output / run_name, ignore_errors=True)  # the benchmark's own scratch run from an earlier call
    command = [
        sys.executable,
        "-m",
        "tlt_cli",
        "train",
        str(recipe),
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
    return trace_records(output / run_name)


def trace_records(run_directory: Path) -> list[dict]:
    """The step, worker, sd_config and warning records of a run's trace."""
    lines = (run_directory / "trace.jsonl").read_text().splitlines()
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


def amdahl_bound(rollout_share: float, rollout_ratio: float) -> float:
    """The most a step can speed up when only its rollout, `rollout_share` of the step, runs
    `rollout_ratio` times faster: 1 / ((1 - r) + r / s)."""
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_ratio)


def side_by_side(baseline: dict, candidate: dict) -> dict:
    """Speed of `candidate` against `baseline`, each given by its mean rollout_seconds and step_seconds:
    the rollout and step ratios (baseline / candidate), the baseline's rollout share of a step, the
    Amdahl bound those allow and the step ratio as a fraction of that bound."""
    rollout_ratio = baseline["rollout_seconds"] / candidate["rollout_seconds"]
    step_ratio = baseline["step_seconds"] / candidate["step_seconds"]
    rollout_share = baseline["rollout_seconds"] / baseline["step_seconds"]
    bound = amdahl_bound(rollout_share, rollout_ratio)
    return {
        "rollout_ratio": rollout_ratio,
        "step_ratio": step_ratio,
        "baseline_rollout_share": rollout_share,
        "amdahl_bound": bound,
        "step_ratio_of_bound": step_ratio / bound,
    }


def reward_gap(curves: dict[str, dict[int, list[float]]], baseline: str, candidate: str) -> dict:
    """Reward curves (variant -> seed -> mean reward of each step) compared as distributions: each seed's
    mean over its steps, the gap candidate - baseline of the variants' means, and the seed-to-seed
    standard deviation of the per-seed means (the noise a gap must stay within; nan with one seed)."""
    per_seed = {name: [statistics.fmean(curve) for curve in curves[name].values()] for name in (baseline, candidate)}
    pooled = per_seed[baseline] + per_seed[candidate]
    return {
        "per_seed_mean_reward": per_seed,
        "gap": statistics.fmean(per_seed[candidate]) - statistics.fmean(per_seed[baseline]),
        "seed_std": statistics.stdev(pooled) if len(per_seed[baseline]) > 1 else math.nan,
    }


def render_side_by_side(console: Console, figures: dict, baseline: str, candidate: str) -> None:
    """The side_by_side figures as one line each."""
    console.print(
        f"{candidate} vs {baseline}: rollout {figures['rollout_ratio']:.2f}x, step {figures['step_ratio']:.2f}x; "
        f"{baseline}'s rollout is {figures['baseline_rollout_share']:.0%} of its step, so the Amdahl bound is "
        f"{figures['amdahl_bound']:.2f}x and the step got {figures['step_ratio_of_bound']:.0%} of it",
        highlight=False,
    )


def render_rewards(console: Console, curves: dict[str, dict[int, list[float]]], gap: dict) -> None:
    """Mean reward of each step over the seeds, per variant, then the reward_gap line."""
    table = Table(title="mean reward per step over seeds", title_justify="left")
    table.add_column("step", justify="right")
    for name in curves:
        table.add_column(name, justify="right")
    steps = min(len(curve) for runs in curves.values() for curve in runs.values())
    for step in range(steps):
        means = (statistics.fmean(curve[step] for curve in runs.values()) for runs in curves.values())
        table.add_row(str(step), *(f"{value:.3f}" for value in means))
    console.print(table)
    console.print(
        f"mean reward over all steps, per seed: "
        f"{ {name: [round(value, 3) for value in means] for name, means in gap['per_seed_mean_reward'].items()} }; "
        f"gap {gap['gap']:+.3f}, "
        f"seed-to-seed std {gap['seed_std']:.3f}",
        highlight=False,
    )
