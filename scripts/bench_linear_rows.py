"""What a linear layer costs by the number of rows it multiplies: why a verify pass is dear at batch 1 on a CPU.

    python scripts/bench_linear_rows.py --out benchmarks/bench_linear_rows.json

A plain decode step at batch 1 multiplies one row through every weight matrix (a matrix-vector product);
a verify pass of k draft tokens multiplies k+1 rows (a matrix-matrix product). Times float32
`torch.nn.functional.linear` at 1..12 rows for the shapes of SmolLM2-135M (hidden 576, MLP 1536, vocabulary
49152 for the head; random weights: only the shapes matter), on --threads threads, median of --calls calls
after a warm-up, and prints each time as a multiple of the one-row time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

# (name, in_features, out_features) of SmolLM2-135M's linear layers
SHAPES = (("attention / MLP projection", 576, 1536), ("lm_head", 576, 49152))
ROWS = (1, 2, 3, 4, 5, 8, 12)


def milliseconds_per_call(rows: int, weight: torch.Tensor, calls: int) -> float:
    """Median wall milliseconds of one linear over `rows` rows, after 5 untimed calls."""
    inputs = torch.randn(rows, weight.shape[1])
    for _ in range(5):
        torch.nn.functional.linear(inputs, weight)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        torch.nn.functional.linear(inputs, weight)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench_linear_rows.json"))
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    torch.manual_seed(0)
    table = Table(title=f"float32 linear, {arguments.threads} thread(s): ms per call (x the 1-row time)")
    table.add_column("layer")
    for rows in ROWS:
        table.add_column(f"{rows} row{'s' if rows > 1 else ''}", justify="right")
    results = {}
    for name, in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features)
        calls = arguments.calls if out_features < 10_000 else max(arguments.calls // 4, 5)
        times = {rows: milliseconds_per_call(rows, weight, calls) for rows in ROWS}
        results[name] = {"shape": [in_features, out_features], "milliseconds": times}
        cells = [f"{milliseconds:.3f} ({milliseconds / times[1]:.1f}x)" for milliseconds in times.values()]
        table.add_row(f"{name} {in_features}x{out_features}", *cells)
    Console(width=160).print(table)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps({"threads": arguments.threads, "results": results}, indent=2) + "\n")
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
