"""What a linear layer costs by the number of rows it multiplies, in each form, with weights streaming from memory.

    python scripts/bench_linear_rows.py --out benchmarks/bench_linear_rows.json

A plain decode step at batch 1 multiplies one row through every weight matrix; a verify pass of k draft
tokens multiplies k+1 rows. What that costs depends on the form of the product
(tlt_cli/engine/linear_forms.py: `F.linear`, `x @ W_t` with a contiguous transposed copy, weight-major
`(W @ x.T).T`) and on where the weight comes from: in a model larger than the cache each weight streams
from memory at every step, so this times, for the shapes of SmolLM2-135M (random weights), enough
distinct copies of each shape to exceed the cache (--stream-mb per shape), all shapes interleaved as in
a forward pass, with the engine's own measurement (tlt_cli/tuning/linear_forms.py, measure_plan) at 1..16 rows.
Prints microseconds per matrix (the form the engine would pick marked *) and writes them with the plan
to JSON. About a minute with the defaults on one thread of a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from tlt_cli.engine.linear_forms import FORM_NAMES, shape_key
from tlt_cli.tuning.cache import processor_name
from tlt_cli.tuning.linear_forms import MARGIN, measure_plan

# (name, out_features, in_features) of SmolLM2-135M's linear layers
SHAPES = (
    ("q/o projection", 576, 576),
    ("k/v projection", 192, 576),
    ("gate/up projection", 1536, 576),
    ("down projection", 576, 1536),
    ("lm_head", 49152, 576),
)
ROWS = tuple(range(1, 17))


def streamed_layers(stream_megabytes: int, dtype: torch.dtype) -> nn.ModuleList:
    """Distinct random nn.Linear copies of every shape, at least `stream_megabytes` (and 2 copies) per shape."""
    layers = []
    for _, out_features, in_features in SHAPES:
        megabytes = out_features * in_features * torch.finfo(dtype).bits / 8 / 2**20
        copies = max(2, math.ceil(stream_megabytes / megabytes))
        layers += [nn.Linear(in_features, out_features, bias=False, dtype=dtype) for _ in range(copies)]
    return nn.ModuleList(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--stream-mb", type=int, default=160, help="weights per shape, in MiB (beyond the cache)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the best time counts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench_linear_rows.json"))
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, arguments.dtype)
    layers = streamed_layers(arguments.stream_mb, dtype).to(arguments.device)
    copies = {}
    for layer in layers:
        copies[shape_key(layer.weight)] = copies.get(shape_key(layer.weight), 0) + 1
    started = time.perf_counter()
    plan, milliseconds = measure_plan([layers], ROWS, arguments.rounds)
    seconds = time.perf_counter() - started
    table = Table(
        title=f"{arguments.dtype} on {processor_name(layers[0].weight.device)}, {arguments.threads} thread(s): "
        "microseconds per matrix, streaming (* the form the engine picks)"
    )
    table.add_column("shape (copies)")
    table.add_column("form")
    for rows in ROWS:
        table.add_column(str(rows), justify="right")
    results = {}
    for name, out_features, in_features in SHAPES:
        key = shape_key(nn.Linear(in_features, out_features, bias=False, dtype=dtype).weight)
        per_matrix = {form: [value * 1e3 / copies[key] for value in milliseconds[key][form]] for form in FORM_NAMES}
        results[name] = {"shape": key, "copies": copies[key], "microseconds_per_matrix": per_matrix}
        for form in FORM_NAMES:
            cells = [
                f"{value:.0f}{'*' if plan.forms[key][index] == form else ''}"
                for index, value in enumerate(per_matrix[form])
            ]
            table.add_row(f"{name} {key} ({copies[key]})" if form == FORM_NAMES[0] else "", form, *cells)
    Console(width=200).print(table)
    print(f"measured in {seconds:.1f} s (another form replaces linear only when {100 * MARGIN:.0f}% faster)")
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "threads": arguments.threads,
        "dtype": arguments.dtype,
        "device": arguments.device,
        "processor": processor_name(layers[0].weight.device),
        "torch": torch.__version__,
        "stream_mb": arguments.stream_mb,
        "rows": list(ROWS),
        "results": results,
        "plan": plan.to_dict(),
        "seconds": round(seconds, 1),
    }
    arguments.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {arguments.out}")


if __name__ == "__main__":
    main()
