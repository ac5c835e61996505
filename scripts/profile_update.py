"""Where the GRPO update's time goes, and its roofline: operations by phase against the rate torch's matrix
products reach at the update's own shapes, in float32 and bfloat16 (actor.precision).

    python scripts/profile_update.py --recipe real-cpu --max-new-tokens 128 \
        --out benchmarks/profile_update.json train.prompts_per_step=2

Each precision runs in a fresh process on the same batch (scripts/bench_memory.py's worst_case_update: one
rank holding the whole optimizer state, prompts_per_step / workers.count prompts x group_size random
responses of max_new_tokens tokens). A first update warms up (AdamW's state is made, the allocator fills);
the second, `actor.update` exactly as a worker calls it, runs under torch.profiler
(tlt_cli/training/update_profile.py: self time by category and by phase). Then, in the same process, the
products of the update's shapes are timed in each of --rate-dtypes and the roofline is built
(tlt_cli/training/update_roofline.py), both sides in CPU seconds (steadier than wall-clock on a shared
machine). Prints, per precision, the categories, the roofline by phase (the
CPU, its bfloat16/AMX flags and the load in the title), and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from bench_update import PRECISIONS, machine
from rich.console import Console
from rich.table import Table

GIGA = 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="real-cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated: fp32,bf16")
    parser.add_argument("--rate-dtypes", default=",".join(PRECISIONS), help="dtypes the products are timed in")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one precision
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_intermixed_args()
    rate_dtypes = arguments.rate_dtypes.split(",")
    if arguments.one:  # the parent's overrides, max_new_tokens among them (not this process's default again)
        print(json.dumps(profile_one_update(arguments.recipe, arguments.overrides, rate_dtypes)))
        return
    overrides = [*arguments.overrides, f"rollout.max_new_tokens={arguments.max_new_tokens}"]
    result = {"recipe": arguments.recipe, "overrides": overrides, **machine(), "profiles": {}}
    for precision in arguments.precisions.split(","):
        result["profiles"][precision] = profile_in_fresh_process(
            arguments.recipe, [*overrides, f"actor.precision={precision}"], rate_dtypes
        )
    result["load_average_after"] = os.getloadavg()
    for precision, profile in result["profiles"].items():
        render(result, precision, profile)
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {arguments.out}")


def profile_in_fresh_process(recipe: str, overrides: list[str], rate_dtypes: list[str]) -> dict:
    command = [sys.executable, __file__, "--one", "--recipe", recipe, "--rate-dtypes", ",".join(rate_dtypes)]
    finished = subprocess.run([*command, *overrides], capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"the profiled update ({' '.join(overrides)}) failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def profile_one_update(recipe_name: str, overrides: list[str], rate_dtypes: list[str]) -> dict:
    """A warm-up update, one under torch.profiler, then the products at its shapes timed: the roofline."""
    from bench_memory import worst_case_update

    from tlt_cli.training import update_roofline
    from tlt_cli.training.memory import model_shape
    from tlt_cli.training.update_profile import label_update_parts, profile_update

    recipe, precision, actor, batch = worst_case_update(recipe_name, overrides)
    actor.update(batch)
    label_update_parts(actor)
    profile = profile_update(actor, batch)
    parts = update_roofline.micro_batch_shapes(batch, recipe.actor.micro_batch_size)
    operations = update_roofline.update_operations(
        model_shape(recipe),
        parts,
        recipe.actor.gradient_checkpointing,
        ppo_epochs=recipe.actor.ppo_epochs,
        reductions_per_epoch=update_roofline.gradient_reductions(recipe.actor.zero_stage, len(parts)),
    )
    rates = update_roofline.measure_product_rates(operations.distinct_products(), rate_dtypes)
    # both sides in CPU seconds: the products' timings and the phases' shares of the update's CPU time
    report = update_roofline.roofline(
        operations, rates, profile.phases_cpu_seconds(), profile.cpu_seconds, precision.precision.value
    )
    return {
        "precision": precision.precision.value,
        "sequences": batch.size,
        "sequence_tokens": int(batch.input_ids.shape[1]),
        "micro_batches": [asdict(part) for part in parts],
        "threads": recipe.workers.threads_per_worker,
        "update_seconds_profiled": profile.seconds,
        "update_cpu_seconds_profiled": profile.cpu_seconds,
        "loss": profile.metrics.loss,
        "categories_seconds": profile.categories_seconds,
        "phases_seconds": profile.phases_seconds,
        "outside_operators_seconds": profile.outside_operators_seconds,
        "costliest_operators_seconds": profile.costliest_operators_seconds,
        "roofline": report.as_dict(),
    }


def render(result: dict, precision: str, profile: dict) -> None:
    console = Console(width=180)
    where = (
        f"{profile['sequences']} x {profile['sequence_tokens']} tokens, {profile['threads']} thread(s), "
        f"{result['cpu']}, "
        f"flags {' '.join(result['bfloat16_flags']) or 'none'}, load {result['load_average_before'][0]:.1f} -> "
        f"{result['load_average_after'][0]:.1f}"
    )
    categories = Table(title=f"{precision} update by operator category, self seconds ({where})")
    categories.add_column("category")
    categories.add_column("s", justify="right")
    categories.add_column("%", justify="right")
    total = sum(profile["categories_seconds"].values())
    for name, seconds in profile["categories_seconds"].items():
        categories.add_row(name, f"{seconds:.2f}", f"{100 * seconds / total:.1f}")
    console.print(categories)
    console.print(roofline_table(precision, profile["roofline"], where))


def roofline_table(precision: str, report: dict, where: str) -> Table:
    dtypes = list(report["bound_seconds"])
    table = Table(
        title=f"{precision} update's roofline in CPU seconds, GFLOP/s = 1e9 operations a CPU second ({where})"
    )
    for name in ("phase", "GFLOP", "CPU s", "achieved GFLOP/s"):
        table.add_column(name, justify="right")
    for dtype in dtypes:
        table.add_column(f"products {dtype} GFLOP/s", justify="right")
    table.add_column(f"achieved / {report['compute_dtype']} products", justify="right")
    for phase in report["phases"]:
        rates = [phase["product_rates"].get(dtype) for dtype in dtypes]
        fraction = phase["fraction_of_product_rate"]
        table.add_row(
            phase["phase"],
            f"{phase['operations'] / GIGA:.2f}",
            f"{phase['seconds']:.2f}",
            f"{phase['achieved_rate'] / GIGA:.2f}",
            *["-" if rate is None else f"{rate / GIGA:.2f}" for rate in rates],
            "-" if fraction is None else f"{100 * fraction:.0f}%",
        )
    table.add_section()
    bounds = [report["operations"] / report["bound_seconds"][dtype] / GIGA for dtype in dtypes]
    table.add_row(
        "whole update",
        f"{report['operations'] / GIGA:.2f}",
        f"{report['update_seconds']:.2f}",
        f"{report['achieved_rate'] / GIGA:.2f}",
        *[f"{bound:.2f}" for bound in bounds],
        f"{100 * report['fraction_of_product_rate']:.0f}%",
    )
    return table


if __name__ == "__main__":
    main()
