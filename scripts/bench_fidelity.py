"""Does the rollout sample the policy being trained? `tlt train` runs, variant by variant, step by step.

    python scripts/bench_fidelity.py recipes/real-cpu.yaml --steps 3 --seeds 0 \
        --variant "fp32/fp32=rollout.dtype=float32 actor.precision=fp32" \
        --variant "bf16/fp32 nearest=rollout.dtype=bfloat16 actor.precision=fp32 actor.bfloat16_rounding=nearest" \
        --out benchmarks/fidelity.json -- train.prompts_per_step=4 rollout.max_new_tokens=128

Runs each variant (a name, `=`, its overrides) for each seed, one run at a time, with speculation and plugins off
unless the overrides say otherwise, then reads each run's trace: per step its response tokens, median response
length, mean reward, the rollout/learner K3 KL (`actor_rollout_kl_k3`), a bfloat16 learner's K3 KL from its float32
weights (`actor_precision_kl_k3`), its seconds, and the fidelity guard's warnings. Prints a table and writes JSON
(the machine named as `tlt bench` names it: tlt_cli/bench/common.py). Overrides after `--` apply to every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tlt_cli.bench.common import machine_description

COMMON = ("speculative.mode=off", "plugins.enabled=[]")
STEP_FIELDS = (
    "response_tokens",
    "response_length_p50",
    "mean_reward",
    "actor_rollout_kl_k3",
    "actor_precision_kl_k3",
    "rollout_seconds",
    "update_seconds",
    "step_seconds",
)


def run_variant(recipe: str, name: str, overrides: list[str], seed: int, steps: int, output: Path) -> dict:
    run_name = f"{name.replace('/', '-').replace(' ', '_')}-seed{seed}"
    command = [sys.executable, "-m", "tlt_cli", "train", recipe, *COMMON, *overrides]
    command += [f"run.seed={seed}", f"train.steps={steps}", f"run.output_dir={output}", f"run.name={run_name}"]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"variant {name} seed {seed} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in (output / run_name / "trace.jsonl").read_text().splitlines()]
    steps_out = [
        {"step": record["step"], **{key: record.get(key) for key in STEP_FIELDS}}
        for record in records
        if record["type"] == "step"
    ]
    warnings = [record["message"] for record in records if record.get("kind") == "fidelity"]
    return {
        "variant": name,
        "overrides": overrides,
        "seed": seed,
        "steps": steps_out,
        "fidelity_warnings": warnings,
        "wall_seconds": time.time() - started,
    }


def render(runs: list[dict]) -> None:
    table = Table(title="fidelity: per step (tokens, p50, reward, rollout KL, bf16 KL, step s)")
    for column in ("variant", "seed", "step", "tokens", "p50", "reward", "rollout KL", "bf16 KL", "step s", "guard"):
        table.add_column(column)
    for run in runs:
        for step in run["steps"]:
            cells = [run["variant"], str(run["seed"]), str(step["step"]), str(step["response_tokens"])]
            cells += [f"{step['response_length_p50']:.0f}", f"{step['mean_reward']:.3f}"]
            cells += [_scientific(step["actor_rollout_kl_k3"]), _scientific(step["actor_precision_kl_k3"])]
            cells += [
                f"{step['step_seconds']:.1f}",
                "warned" if run["fidelity_warnings"] and step is run["steps"][-1] else "",
            ]
            table.add_row(*cells)
    Console().print(table)
    for run in runs:
        for warning in run["fidelity_warnings"]:
            print(f"{run['variant']} seed {run['seed']}: {warning}")


def _scientific(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--variant", action="append", required=True, help="NAME=key=value key=value ...")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/fidelity.json"))
    arguments, common = parser.parse_known_args()
    common = [item for item in common if item != "--"]
    runs, load_at_start = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        for variant in arguments.variant:
            name, _, overrides = variant.partition("=")
            for seed in (int(seed) for seed in arguments.seeds.split(",")):
                runs.append(
                    run_variant(
                        arguments.recipe, name, [*overrides.split(), *common], seed, arguments.steps, Path(folder)
                    )
                )
    render(runs)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": machine_description(), "load_at_start": load_at_start, "load_at_end": os.getloadavg()[0]}
    report |= {"recipe": arguments.recipe, "common": common}
    arguments.out.write_text(json.dumps({**report, "runs": runs}, indent=1))
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
