"""What `rollout.dtype: auto` measures, shown: a 1-row decode step and a 16-token verify in float32 and bfloat16.

    python scripts/bench_precision.py recipes/real-cpu.yaml --out benchmarks/bench_precision.json

On the recipe's model (SmolLM2-135M-Instruct for real-cpu), with the machine's linear-form plan for float32 as a
worker runs it and on `workers.threads_per_worker` threads: the owned decode forward's 1-row step and 4-row x
4-token verify, logits included, over a 64-token prefix (tlt_cli/tuning/precision.py `measure_precision`, the
very function `auto` calls), best CPU time of --rounds interleaved rounds. Prints, per dtype, the step, the
verify, the verify in steps (TLT's premise: about 1), the ratios bfloat16 / float32, what `auto` would choose,
and the CPU with its matrix-unit flags (AMX or not); writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.config import load_recipe
from tlt_cli.engine.linear_forms_measure import prepare_linear_forms
from tlt_cli.training import setup
from tlt_cli.tuning.cache import machine_key
from tlt_cli.tuning.precision import ROLLOUT_DTYPES, choose_dtype, measure_precision


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="recipes/real-cpu.yaml", help="the recipe whose model to measure")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds; the best CPU time counts")
    parser.add_argument("--out", default="bench_precision.json", help="where the JSON results go")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    recipe = load_recipe(Path(args.recipe), [])
    torch.set_num_threads(recipe.workers.threads_per_worker)
    policy, _ = setup.policy_and_tokenizer(recipe)
    forms = prepare_linear_forms(recipe.rollout.linear_forms, [policy, None], setup.model_cache(recipe))
    step_ms, verify_ms = measure_precision(policy, forms.plan if forms is not None else None, args.rounds)
    machine = machine_key(next(policy.parameters()).device)
    flags = ", ".join(machine["matrix_flags"]) or "no matrix flags"
    table = Table(title=f"{recipe.model.path} on {machine['processor']} ({flags}), {machine['threads']} thread(s)")
    for column in ("dtype", "1-row step ms", "16-token verify ms", "verify in steps"):
        table.add_column(column, justify="right")
    for name in ROLLOUT_DTYPES:
        table.add_row(name, f"{step_ms[name]:.1f}", f"{verify_ms[name]:.1f}", f"{verify_ms[name] / step_ms[name]:.2f}x")
    console = Console(width=120)
    console.print(table)
    choice = choose_dtype(step_ms, verify_ms)
    ratios = {
        "step_float32_over_bfloat16": step_ms["float32"] / step_ms["bfloat16"],
        "verify_float32_over_bfloat16": verify_ms["float32"] / verify_ms["bfloat16"],
    }
    console.print(
        f"bfloat16 step {ratios['step_float32_over_bfloat16']:.2f}x faster, verify "
        f"{ratios['verify_float32_over_bfloat16']:.2f}x faster; auto chooses {choice}"
    )
    report = {
        "command": f"python scripts/bench_precision.py {args.recipe} --rounds {args.rounds} --out {args.out}",
        "machine": machine,
        "model": recipe.model.path,
        "step_ms": step_ms,
        "verify_ms": verify_ms,
        "ratios": ratios,
        "auto_chooses": choice,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
