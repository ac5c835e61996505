"""The GRPO update in float32 against bfloat16 (actor.precision), interleaved, on one worker's batch.

    python scripts/bench_update.py --recipe real-cpu --max-new-tokens 128 --repeats 2 \
        --out benchmarks/update_precision.json train.prompts_per_step=2

Each run is a fresh process (scripts/bench_memory.py's `one-update`: one rank holding the whole
optimizer state, prompts_per_step / workers.count prompts x group_size responses, every response
max_new_tokens long, the same random tokens and advantages for both precisions), alternating fp32,
bf16, fp32, bf16, ... so a machine's load drifts over both alike. It reports per run the update's
seconds (wall-clock, and CPU time of all the process's threads: steadier on a shared machine), the
worker's peak resident memory (VmHWM) and its growth in the update, tlt's estimate of the peak
(tlt_cli/training/memory.py) and the loss; then each precision's best and the bf16 / fp32 ratios.
Prints a table (with the CPU's model name and bfloat16/AMX flags and the load average), writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path

from bench_memory import update_in_fresh_process
from rich.console import Console
from rich.table import Table

PRECISIONS = ("fp32", "bf16")
# the /proc/cpuinfo flags that say how fast bfloat16 products can be (AMX tiles, AVX-512 BF16)
BFLOAT16_FLAGS = re.compile(r"\b(amx_\w+|avx512_bf16)\b")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="real-cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each precision, interleaved")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_intermixed_args()
    result = {"recipe": arguments.recipe, "overrides": arguments.overrides, **machine(), "runs": []}
    for repeat in range(arguments.repeats):
        for precision in PRECISIONS if repeat % 2 == 0 else PRECISIONS[::-1]:
            overrides = [*arguments.overrides, f"actor.precision={precision}"]
            row = update_in_fresh_process(arguments.recipe, overrides, arguments.max_new_tokens)
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    result["best"] = best_per_precision(result["runs"])
    result["load_average_after"] = os.getloadavg()
    render(result)
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {arguments.out}")


def machine() -> dict:
    """The CPU's model name, its bfloat16/AMX flags, cores, and the load average before the runs."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    names = [line.partition(":")[2].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    return {
        "cpu": names[0] if names else platform.processor(),
        "bfloat16_flags": sorted(set(BFLOAT16_FLAGS.findall(cpuinfo))),
        "cores": os.cpu_count(),
        "load_average_before": os.getloadavg(),
    }


def best_per_precision(runs: list[dict]) -> dict:
    """Each precision's fastest wall and CPU seconds and lowest peak, and bf16's speed-ups over fp32."""
    best = {}
    for precision in PRECISIONS:
        rows = [row for row in runs if row["precision"] == precision]
        best[precision] = {
            "update_seconds": min(row["update_seconds"] for row in rows),
            "update_cpu_seconds": min(row["update_cpu_seconds"] for row in rows),
            "update_peak_gb": min(row["update_peak_gb"] for row in rows),
        }
    best["bf16_speedup_wall"] = best["fp32"]["update_seconds"] / best["bf16"]["update_seconds"]
    best["bf16_speedup_cpu"] = best["fp32"]["update_cpu_seconds"] / best["bf16"]["update_cpu_seconds"]
    return best


def render(result: dict) -> None:
    title = (
        f"GRPO update, fp32 vs bf16, one rank ({result['cpu']}, flags {' '.join(result['bfloat16_flags']) or 'none'}, "
        f"load {result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f}; GB = 1e9 bytes)"
    )
    table = Table(title=title)
    for name in ("precision", "sequences", "tokens/seq", "update s", "CPU s", "peak GB", "growth GB", "estimate GB"):
        table.add_column(name, justify="right")
    table.add_column("loss", justify="right")
    for row in result["runs"]:
        table.add_row(
            row["precision"],
            str(row["sequences"]),
            str(row["sequence_tokens"]),
            f"{row['update_seconds']:.1f}",
            f"{row['update_cpu_seconds']:.1f}",
            f"{row['update_peak_gb']:.2f}",
            f"{row['update_growth_gb']:.2f}",
            f"{row['estimate_gb']:.2f}",
            f"{row['loss']:.6f}",
        )
    Console(width=160).print(table)
    best = result["best"]
    print(
        f"bf16 / fp32 (best of each): {best['bf16_speedup_wall']:.2f}x wall, {best['bf16_speedup_cpu']:.2f}x CPU time; "
        f"peak {best['fp32']['update_peak_gb']:.2f} -> {best['bf16']['update_peak_gb']:.2f} GB"
    )


if __name__ == "__main__":
    main()
