"""End to end: step time and reward of a recipe with tlt on vs SD off, over several seeds.

    python scripts/bench_end_to_end.py --steps 60 --seeds 0 1 2 --out benchmarks/bench_end_to_end.json
    python scripts/bench_end_to_end.py --recipe recipes/real-cpu.yaml --steps 6 --skip 1 --seeds 0
    python scripts/bench_end_to_end.py --recipe recipes/real-cpu.yaml --skip 1 --seeds 0 1 --from-runs  # re-summarize
    python scripts/bench_end_to_end.py --steps 30 --off-overrides rollout.dtype=float32 \
        --tlt-overrides rollout.dtype=bfloat16   # tlt decoding in bfloat16, SD off in float32

For every seed it runs `tlt train <recipe>` (recipes/tiny-cpu.yaml by default) twice, one after
the other (never at once, so neither slows the other):
  off   speculative.mode=off, no plugins (plain decoding)
  tlt   speculative.mode=adaptive (the recipe's rule table) and the drafter sidecar
then prints per seed the mean step time of each and their ratio, the mean reward over the first
and last 5 steps, and whether the tlt run's per-step reward stays within the band the SD-off
seeds span (sampled SD is lossless in distribution, not sample for sample, so curves differ by
sampling noise only). Over all seeds (the first --skip steps of each run left out): the rollout
and step ratios off / tlt, the Amdahl bound 1 / ((1 - r) + r / s) (r: the SD-off rollout share of
a step, s: the rollout ratio) and the step ratio as a fraction of it; the mean reward of each step
over the seeds per variant, and the gap between the variants' mean rewards next to the seed-to-seed
standard deviation (as scripts/trl_fidelity.py compares curves). The breakdown of a step (rollout,
reward, actor update, idle, release delay) says what bounds the ratio: speculative decoding only
shortens the rollout. Writes JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table
from training_runs import (
    RECIPE,
    benchmark_parser,
    mean,
    render_rewards,
    render_side_by_side,
    reward_gap,
    run_training,
    side_by_side,
    step_rows,
    trace_records,
)

VARIANTS = {
    "off": ["speculative.mode=off", "plugins.enabled=[]"],
    "tlt": ["speculative.mode=adaptive", "plugins.enabled=[drafter_sidecar]"],
}
BREAKDOWN = ("rollout_seconds", "reward_seconds", "update_seconds", "idle_worker_seconds", "release_delay_seconds")


def run_name(variant: str, seed: int) -> str:
    """The run folder of one variant and seed under --output-dir."""
    return f"{variant}-seed{seed}"


def run_seeds(
    recipe: Path, seeds: list[int], steps: int, output: Path, extra: list[str], own: dict[str, list[str]]
) -> dict[str, dict[int, list[dict]]]:
    """Every variant of every seed; `own`: more overrides of one variant (e.g. tlt's rollout.dtype)."""
    results: dict[str, dict[int, list[dict]]] = {name: {} for name in VARIANTS}
    for seed in seeds:
        for name, variant in VARIANTS.items():
            overrides = [*variant, f"run.seed={seed}", *extra, *own.get(name, [])]
            results[name][seed] = step_rows(run_training(run_name(name, seed), overrides, steps, output, recipe=recipe))
    return results


def read_seeds(seeds: list[int], output: Path) -> dict[str, dict[int, list[dict]]]:
    """The step records of runs an earlier call left under `output` (`run_name`), not run again."""
    runs = {name: {seed: output / run_name(name, seed) for seed in seeds} for name in VARIANTS}
    missing = [str(run) for by_seed in runs.values() for run in by_seed.values() if not (run / "trace.jsonl").is_file()]
    if missing:
        raise SystemExit(f"no trace.jsonl in {', '.join(missing)}: give the --output-dir and --seeds of the runs.")
    return {
        name: {seed: step_rows(trace_records(run)) for seed, run in by_seed.items()} for name, by_seed in runs.items()
    }


def summarize(results: dict[str, dict[int, list[dict]]], skip: int) -> dict:
    """Per seed and over all seeds (each run's first `skip` steps left out of the time means)."""
    timed = {name: {seed: rows[skip:] for seed, rows in runs.items()} for name, runs in results.items()}
    pooled = {
        name: {key: mean([row[key] for rows in runs.values() for row in rows]) for key in BREAKDOWN + ("step_seconds",)}
        for name, runs in timed.items()
    }
    curves = {
        name: {seed: [row["mean_reward"] for row in rows] for seed, rows in runs.items()}
        for name, runs in results.items()
    }
    per_seed = {}
    for seed, off_rows in timed["off"].items():
        tlt_rows = timed["tlt"][seed]
        off_time, tlt_time = (
            mean([row["step_seconds"] for row in off_rows]),
            mean([row["step_seconds"] for row in tlt_rows]),
        )
        per_seed[seed] = {
            "step_seconds_off": off_time,
            "step_seconds_tlt": tlt_time,
            "speedup": off_time / tlt_time,
            "rollout_seconds_off": mean([row["rollout_seconds"] for row in off_rows]),
            "rollout_seconds_tlt": mean([row["rollout_seconds"] for row in tlt_rows]),
            **{f"reward_{name}_first5": mean(curves[name][seed][:5]) for name in VARIANTS},
            **{f"reward_{name}_last5": mean(curves[name][seed][-5:]) for name in VARIANTS},
            "accept_length_tlt": mean([row["accept_length"] for row in tlt_rows if row["accept_length"] is not None]),
        }
    return {
        "per_seed": per_seed,
        "side_by_side": side_by_side(pooled["off"], pooled["tlt"]),
        "rewards": curves,
        "reward_gap": reward_gap(curves, "off", "tlt"),
        "reward_band": reward_band(results),
        "breakdown": {name: {key: values[key] for key in BREAKDOWN} for name, values in pooled.items()},
    }


def reward_band(results: dict[str, dict[int, list[dict]]]) -> dict:
    """Share of steps where each tlt run's mean reward lies within [min, max] of the SD-off seeds, and the
    same for a 5-step moving average (per-step rewards are noisy)."""
    off_curves = [[row["mean_reward"] for row in rows] for rows in results["off"].values()]
    band = {}
    for seed, rows in results["tlt"].items():
        curve = [row["mean_reward"] for row in rows]
        band[seed] = {
            "per_step": _inside(curve, off_curves),
            "moving_average_5": _inside(_smooth(curve), [_smooth(c) for c in off_curves]),
        }
    return band


def _smooth(curve: list[float], window: int = 5) -> list[float]:
    return [mean(curve[max(0, index - window + 1) : index + 1]) for index in range(len(curve))]


def _inside(curve: list[float], references: list[list[float]]) -> float:
    steps = range(min(len(curve), *(len(reference) for reference in references)))
    hits = [
        min(reference[step] for reference in references)
        <= curve[step]
        <= max(reference[step] for reference in references)
        for step in steps
    ]
    return sum(hits) / max(len(hits), 1)


def render(summary: dict, recipe: Path) -> None:
    console = Console()
    table = Table(title=f"tlt on vs SD off, {recipe.name} (means over steps)")
    columns = (
        "seed",
        "step s off",
        "step s tlt",
        "speedup",
        "rollout s off",
        "rollout s tlt",
        "accept len",
        "reward off first5->last5",
        "reward tlt first5->last5",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for seed, row in summary["per_seed"].items():
        table.add_row(
            str(seed),
            f"{row['step_seconds_off']:.2f}",
            f"{row['step_seconds_tlt']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{row['rollout_seconds_off']:.2f}",
            f"{row['rollout_seconds_tlt']:.2f}",
            f"{row['accept_length_tlt']:.2f}",
            f"{row['reward_off_first5']:.3f} -> {row['reward_off_last5']:.3f}",
            f"{row['reward_tlt_first5']:.3f} -> {row['reward_tlt_last5']:.3f}",
        )
    console.print(table)
    breakdown = Table(title="where a step's time goes (seconds, mean per step)")
    breakdown.add_column("variant")
    for key in BREAKDOWN:
        breakdown.add_column(key.removesuffix("_seconds"), justify="right")
    for name, values in summary["breakdown"].items():
        breakdown.add_row(name, *(f"{values[key]:.2f}" for key in BREAKDOWN))
    console.print(breakdown)
    render_side_by_side(console, summary["side_by_side"], "off", "tlt")
    render_rewards(console, summary["rewards"], summary["reward_gap"])
    console.print({"tlt reward inside the SD-off seeds' band": summary["reward_band"]})


def main() -> None:
    parser = benchmark_parser(__doc__.splitlines()[0], "bench-end-to-end")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--skip", type=int, default=0, help="first steps of each run left out of the time means")
    for name in VARIANTS:
        parser.add_argument(
            f"--{name}-overrides", nargs="+", default=[], help=f"key=value overrides of the {name} runs only"
        )
    parser.add_argument(
        "--from-runs",
        action="store_true",
        help="summarize the runs an earlier call left in --output-dir instead of training again",
    )
    arguments = parser.parse_args()
    if arguments.from_runs:
        results = read_seeds(arguments.seeds, arguments.output_dir)
    else:
        results = run_seeds(
            arguments.recipe,
            arguments.seeds,
            arguments.steps,
            arguments.output_dir,
            arguments.overrides,
            {name: getattr(arguments, f"{name}_overrides") for name in VARIANTS},
        )
    summary = summarize(results, arguments.skip)
    render(summary, arguments.recipe)
    report = {"recipe": str(arguments.recipe), "skip": arguments.skip, "summary": summary, "steps": results}
    arguments.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
