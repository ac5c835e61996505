"""Fidelity of tlt's rollout under TRL: with SD off, the reward curve matches TRL's own generation within seed noise.

    python scripts/trl_fidelity.py --steps 20 --seeds 0 1 2 --out benchmarks/trl_fidelity.json

Runs `tlt train` on recipes/trl-tiny-cpu.yaml (or --recipe) for each seed twice, the same model,
task, batch and TRL settings, speculative decoding and the drafter off in both:
  trl   rollout.backend=trl: TRL's own generation (transformers' generate);
  tlt   rollout.backend=embedded: tlt's engine through TRL's rollout_func.
The two sample different tokens (different random streams), so curves are compared as
distributions: per variant the mean reward of each step over the seeds, and the mean over all
steps per seed. The gap between the variants' means is printed next to the seed-to-seed standard
deviation of those per-seed means (the noise a gap must stay within). Writes every step's reward
as JSON. Extra key=value overrides apply to every run (e.g. workers.count=1 to save time).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from bench_trl import run_training
from rich.console import Console
from rich.table import Table

from tlt_cli.recipes import RECIPES_DIRECTORY

SD_OFF = ["speculative.mode=off", "plugins.enabled=[]"]
BACKENDS = {"trl": "rollout.backend=trl", "tlt": "rollout.backend=embedded"}


def curves(recipe: Path, steps: int, seeds: list[int], overrides: list[str], work_dir: Path, out: Path) -> dict:
    """variant -> seed -> the mean reward of each step; after each run, what is found so far is written to
    `out` (marked incomplete), so an interrupted comparison keeps its finished runs."""
    found: dict[str, dict[int, list[float]]] = {name: {} for name in BACKENDS}
    for seed in seeds:
        for name, backend in BACKENDS.items():
            run_overrides = [
                f"train.steps={steps}",
                f"run.seed={seed}",
                "checkpoint.every=1000",
                *SD_OFF,
                backend,
                *overrides,
            ]
            result = run_training(recipe, run_overrides, work_dir / f"{name}-seed{seed}")
            found[name][seed] = [step["mean_reward"] for step in result["steps"]]
            out.write_text(json.dumps({"complete": False, "rewards": found}, indent=2))
    return found


def render(console: Console, found: dict, steps: int) -> dict:
    table = Table(title="mean reward per step over seeds (SD off)", title_justify="left")
    for column in ("step", *BACKENDS):
        table.add_column(column, justify="right")
    for step in range(steps):
        table.add_row(
            str(step), *(f"{statistics.fmean(curve[step] for curve in found[name].values()):.3f}" for name in BACKENDS)
        )
    console.print(table)
    per_seed = {name: [statistics.fmean(curve) for curve in found[name].values()] for name in BACKENDS}
    gap = statistics.fmean(per_seed["tlt"]) - statistics.fmean(per_seed["trl"])
    noise = statistics.stdev(per_seed["trl"] + per_seed["tlt"]) if len(per_seed["trl"]) > 1 else float("nan")
    console.print(
        f"mean reward over all steps, per seed: trl {[round(value, 3) for value in per_seed['trl']]}, "
        f"tlt {[round(value, 3) for value in per_seed['tlt']]}; gap tlt - trl {gap:+.3f}, "
        f"seed-to-seed std {noise:.3f}",
        highlight=False,
    )
    return {"per_seed_mean_reward": per_seed, "gap": gap, "seed_std": noise}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPES_DIRECTORY / "trl-tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work-dir", type=Path, default=Path("runs/trl-fidelity"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/trl_fidelity.json"))
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    arguments = parser.parse_args()
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    found = curves(
        arguments.recipe, arguments.steps, arguments.seeds, arguments.overrides, arguments.work_dir, arguments.out
    )
    comparison = render(Console(), found, arguments.steps)
    arguments.out.write_text(
        json.dumps(
            {
                "complete": True,
                "recipe": str(arguments.recipe),
                "steps": arguments.steps,
                "overrides": [*SD_OFF, *arguments.overrides],
                "rewards": found,
                **comparison,
            },
            indent=2,
        )
    )
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
