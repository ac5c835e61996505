"""TRL's GRPOTrainer with its own generation vs with tlt's rollout, side by side in one run.

    python scripts/bench_trl.py --steps 8 --skip 1 --out benchmarks/bench_trl.json

Runs `tlt train` on recipes/trl-tiny-cpu.yaml (or --recipe) twice at the same time (so load from
other work on the machine hits both alike; --one-at-a-time runs them in turn), with the same model,
task, batch, seeds and TRL settings, each in a fresh run directory under --work-dir:
  trl   rollout.backend=trl: TRL generates itself (transformers' generate), no SD, no drafter;
  tlt   the recipe's rollout: tlt's engine through TRL's rollout_func, speculative decoding under
        the adaptive rule table, the drafter sidecar training in the processes' wait.
Then reads both traces and prints, per variant, the mean over the steps after the first --skip
(compilation, allocator and cache warm-up): rollout seconds per step, step seconds, where the step
goes (rollout; TRL's scoring: rewards, advantages and any log-prob forwards; the update: TRL's
loss forward/backward and optimizer step), the accept length, the share of idle process-seconds
the drafter trained in, the mean reward, and response tokens per rollout second (the variants
sample different tokens, so their lengths differ); with the ratios trl / tlt (tokens/s: tlt / trl).
Then the rollout and step ratios, the Amdahl bound 1 / ((1 - r) + r / s) (r: TRL generation's
rollout share of its step, s: the rollout ratio) and the step ratio as a fraction of it, and the
per-step rewards of both (compared as scripts/trl_fidelity.py does, which runs several seeds with
SD off). Writes the per-step numbers and the means as JSON. On the real model:

    python scripts/bench_trl.py --recipe recipes/trl-real-cpu.yaml --one-at-a-time --steps 6 --skip 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from training_runs import render_rewards, render_side_by_side, reward_gap, side_by_side

from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.trace import read_trace

# TRL's own generation: no speculative decoding, no drafter to train
TRL_GENERATION = ["rollout.backend=trl", "speculative.mode=off", "plugins.enabled=[]"]
VARIANTS = {"trl": TRL_GENERATION, "tlt": []}
# per-step numbers read from each step record
STEP_KEYS = (
    "rollout_seconds",
    "reward_seconds",
    "update_seconds",
    "step_seconds",
    "idle_worker_seconds",
    "drafter_train_seconds",
    "accept_length",
    "mean_reward",
    "response_tokens",
)


def start_training(recipe: Path, overrides: list[str], output: Path) -> tuple[subprocess.Popen, list[str], float]:
    """`tlt train` started in a fresh folder `output`: (process, command, start time)."""
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)  # a run that fails early removes the folders it created: not a shared parent
    command = [sys.executable, "-m", "tlt_cli", "train", str(recipe), f"run.output_dir={output}", *overrides]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, command, time.perf_counter()


def finish_training(started: tuple[subprocess.Popen, list[str], float], output: Path) -> dict:
    """Wait for a started `tlt train`: the command, its step records and its wall seconds."""
    process, command, start = started
    log, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"tlt train failed ({' '.join(command[2:])}):\n{log[-4000:]}")
    run_directory = next(path.parent for path in output.glob("*/trace.jsonl"))
    steps = [record for record in read_trace(run_directory / "trace.jsonl") if record["type"] == "step"]
    return {
        "command": " ".join(command[2:]),
        "wall_seconds": time.perf_counter() - start,
        "steps": [{key: step.get(key) for key in ("step", *STEP_KEYS)} for step in steps],
    }


def run_training(recipe: Path, overrides: list[str], output: Path) -> dict:
    """`tlt train` in a fresh folder `output`, to its end (see finish_training)."""
    return finish_training(start_training(recipe, overrides, output), output)


def summary(steps: list[dict], skip: int) -> dict:
    """Means over the steps after the first `skip`; the drafter's share of idle process-seconds."""
    kept = steps[skip:]

    def mean(key: str) -> float | None:
        values = [step[key] for step in kept if step.get(key) is not None]
        return statistics.fmean(values) if values else None

    idle = sum(step["idle_worker_seconds"] for step in kept)
    trained = sum(step.get("drafter_train_seconds") or 0.0 for step in kept)
    tokens_per_second = sum(step["response_tokens"] for step in kept) / sum(step["rollout_seconds"] for step in kept)
    return {
        **{key: mean(key) for key in STEP_KEYS if key != "drafter_train_seconds"},
        "drafter_share_of_idle": trained / idle if idle > 0 else None,
        "rollout_tokens_per_second": tokens_per_second,
        "steps_averaged": len(kept),
    }


def compare(results: dict) -> dict:
    """tlt against TRL's generation: side_by_side of their means, and their reward curves (one seed)."""
    rewards = {name: {0: [step["mean_reward"] for step in results[name]["steps"]]} for name in VARIANTS}
    return {
        "side_by_side": side_by_side(results["trl"]["summary"], results["tlt"]["summary"]),
        "rewards": rewards,
        "reward_gap": reward_gap(rewards, "trl", "tlt"),
    }


def render(console: Console, results: dict) -> None:
    table = Table(title="TRL GRPOTrainer: its own generation (trl) vs tlt's rollout (tlt)", title_justify="left")
    for column in ("per step (mean)", "trl", "tlt", "trl / tlt"):
        table.add_column(column, justify="right")
    rows = (
        ("rollout s", "rollout_seconds"),
        ("scoring s (rewards, advantages)", "reward_seconds"),
        ("update s (TRL loss + optimizer)", "update_seconds"),
        ("step s", "step_seconds"),
        ("idle process-s", "idle_worker_seconds"),
        ("accept length", "accept_length"),
        ("drafter share of idle", "drafter_share_of_idle"),
        ("mean reward", "mean_reward"),
        ("response tokens", "response_tokens"),
        ("rollout tokens/s", "rollout_tokens_per_second"),
    )
    trl, tlt = results["trl"]["summary"], results["tlt"]["summary"]
    for label, key in rows:
        ratio = trl[key] / tlt[key] if trl.get(key) and tlt.get(key) and key.endswith("seconds") else None
        if key == "rollout_tokens_per_second":
            ratio = tlt[key] / trl[key]
        table.add_row(label, _cell(trl.get(key)), _cell(tlt.get(key)), "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    for name in ("trl", "tlt"):
        share = {
            key: results[name]["summary"][key] / results[name]["summary"]["step_seconds"]
            for key in ("rollout_seconds", "reward_seconds", "update_seconds")
        }
        console.print(
            f"{name}: step time = rollout {share['rollout_seconds']:.0%}, scoring "
            f"{share['reward_seconds']:.0%}, update {share['update_seconds']:.0%}",
            highlight=False,
        )


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=RECIPES_DIRECTORY / "trl-tiny-cpu.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the means")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/bench-trl"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench_trl.json"))
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run the variants one after the other (default: at once, so machine load hits both alike)",
    )
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to both variants")
    arguments = parser.parse_args()
    overrides = [f"train.steps={arguments.steps}", "checkpoint.every=1000", *arguments.overrides]
    results, started = {}, {}
    for name, variant in VARIANTS.items():
        started[name] = start_training(arguments.recipe, [*overrides, *variant], arguments.work_dir / name)
        if arguments.one_at_a_time:
            results[name] = finish_training(started.pop(name), arguments.work_dir / name)
    for name in started:
        results[name] = finish_training(started[name], arguments.work_dir / name)
    for result in results.values():
        result["summary"] = summary(result["steps"], arguments.skip)
    comparison = compare(results)
    console = Console()
    render(console, results)
    render_side_by_side(console, comparison["side_by_side"], "trl", "tlt")
    render_rewards(console, comparison["rewards"], comparison["reward_gap"])
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(
        json.dumps(
            {
                "recipe": str(arguments.recipe),
                "overrides": overrides,
                "skip": arguments.skip,
                "variants": results,
                **comparison,
            },
            indent=2,
        )
    )
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
