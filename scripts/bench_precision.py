"""What `rollout.dtype: auto` measures, shown: a 1-row step, a full-batch step and a 16-token verify per dtype.

    python scripts/bench_precision.py recipes/real-cpu.yaml --out benchmarks/bench_precision.json

On the recipe's model (SmolLM2-135M-Instruct for real-cpu), with the machine's linear-form plan for float32 as a
worker runs it and on `workers.threads_per_worker` threads: the owned decode forward's 1-row step, its step over a
worker's batch (the recipe's prompts per worker x group size, or --rows) and its 4-row x 4-token verify, logits
included, over a 64-token prefix (tlt_cli/tuning/precision.py `measure_precision`, the very function `auto`
calls), best CPU time of --rounds interleaved rounds. Prints, per dtype, the three passes and the verify in
steps (TLT's premise: about 1), then the rollout speed-up bfloat16 is predicted to give (with SD off and with
a speculating tail) and what `auto` would choose for each, with the CPU and its matrix-unit flags (AMX or not);
writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.config import load_recipe
from tlt_cli.rollout.decode_plan import DECODE_DTYPES
from tlt_cli.training import setup
from tlt_cli.tuning.cache import machine_key
from tlt_cli.tuning.linear_forms import measured_linear_plan
from tlt_cli.tuning.precision import RolloutWorkload, bfloat16_speedup, choose_dtype, measure_precision


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/real-cpu.yaml", help="the recipe whose model to measure")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds; the best CPU time counts")
    parser.add_argument("--rows", type=int, default=None, help="the batch step's rows (default: a worker's batch)")
    parser.add_argument("--out", default="bench_precision.json", help="where the JSON results go")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    recipe = load_recipe(Path(args.recipe), [])
    torch.set_num_threads(recipe.workers.threads_per_worker)
    policy, _ = setup.policy_and_tokenizer(recipe)
    plan = measured_linear_plan(recipe.rollout.linear_forms, [policy, None], setup.model_cache(recipe))
    rows = RolloutWorkload(args.rows or recipe.samples_per_worker).measured_rows
    step_ms, batch_step_ms, verify_ms = measure_precision(policy, plan, rows, args.rounds)
    machine = machine_key(next(policy.parameters()).device)
    flags = ", ".join(machine["matrix_flags"]) or "no matrix flags"
    table = Table(title=f"{recipe.model.path} on {machine['processor']} ({flags}), {machine['threads']} thread(s)")
    for column in ("dtype", "1-row step ms", f"{rows}-row step ms", "16-token verify ms", "verify in steps"):
        table.add_column(column, justify="right")
    for name in DECODE_DTYPES:
        table.add_row(
            name,
            f"{step_ms[name]:.1f}",
            f"{batch_step_ms[name]:.1f}",
            f"{verify_ms[name]:.1f}",
            f"{verify_ms[name] / step_ms[name]:.2f}x",
        )
    console = Console(width=120)
    console.print(table)
    ratios = {
        f"{label}_float32_over_bfloat16": figures["float32"] / figures["bfloat16"]
        for label, figures in (("step", step_ms), ("batch_step", batch_step_ms), ("verify", verify_ms))
    }
    console.print(
        f"bfloat16 is {ratios['step_float32_over_bfloat16']:.2f}x as fast at one row, "
        f"{ratios['batch_step_float32_over_bfloat16']:.2f}x at {rows} rows, "
        f"{ratios['verify_float32_over_bfloat16']:.2f}x in a verify"
    )
    predictions = {}
    for tail, speculates in (("sd_off", False), ("speculating", True)):
        speedup = bfloat16_speedup(step_ms, batch_step_ms, verify_ms, speculates)
        choice = choose_dtype(step_ms, batch_step_ms, verify_ms, speculates)
        predictions[tail] = {"predicted_bfloat16_speedup": speedup, "auto_chooses": choice}
        console.print(
            f"a {rows}-row rollout, {tail.replace('_', ' ')}: bfloat16 predicted {speedup:.2f}x; auto: {choice}"
        )
    report = {
        "command": f"python scripts/bench_precision.py {args.recipe} --rounds {args.rounds} --out {args.out}"
        + (f" --rows {args.rows}" if args.rows else ""),
        "machine": machine,
        "model": recipe.model.path,
        "rows": rows,
        "step_ms": step_ms,
        "batch_step_ms": batch_step_ms,
        "verify_ms": verify_ms,
        "ratios": ratios,
        "rollouts": predictions,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
