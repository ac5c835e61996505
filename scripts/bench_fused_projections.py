"""Measure whether fusing q/k/v into one weight and gate/up into one weight speeds a whole decode step.

One decode step of a real model (default SmolLM2-135M-Instruct under tlt's cache) at 1 and 4 rows, one
thread, over a KV cache of --context tokens, the weights streaming from memory as in a real step (the
model is larger than the cache, and every step reads all of it). Four variants of every decoder layer's
projections, timed in interleaved rounds (the variants' order rotating), best step time of each kept:

- `linear`: the model as transformers builds it (F.linear per projection);
- `linear-fused`: q/k/v as one F.linear over the concatenated weight, gate/up likewise;
- `transposed`: every projection as `x @ W_t` with a contiguous transposed copy (tlt's linear form at few rows);
- `transposed-fused`: the same with the fused weights.

The fused variants compute the three (two) products in the first projection's call and hand the others
their slices, so the step is transformers' own forward otherwise. Reports ms per step and the fused/unfused
ratio per form and row count; integrate fusing only if it gains >= 3% a step.

    python scripts/bench_fused_projections.py --rounds 5 --steps 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from tlt_cli.models.loading import load_policy

DEFAULT_MODEL = Path.home() / ".cache" / "tlt" / "models" / "SmolLM2-135M-Instruct"
VARIANTS = ("linear", "linear-fused", "transposed", "transposed-fused")


class Transposed(nn.Module):
    """x @ W_t with a contiguous transposed copy of the weight."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = linear.weight.detach().t().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t


class FusedFirst(nn.Module):
    """The first of a group of projections of the same input: computes all of them in one product and
    leaves the others' slices to their `FusedSlice`s."""

    def __init__(self, linears: list[nn.Linear], transposed: bool):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
        self.transposed = transposed
        self.weight = weight.t().contiguous() if transposed else weight
        self.sizes = [linear.out_features for linear in linears]
        self.slices: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = x @ self.weight if self.transposed else F.linear(x, self.weight)
        first, *self.slices = output.split(self.sizes, dim=-1)
        return first


class FusedSlice(nn.Module):
    """A later projection of a fused group: returns its slice of the first one's product."""

    def __init__(self, first: FusedFirst):
        super().__init__()
        self.first = [first]  # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first[0].slices.pop(0)


def variant_modules(layer, variant: str) -> dict[tuple[str, str], nn.Module]:
    """(block name, projection name) -> the module to install for `variant` in one decoder layer."""
    attention, mlp = layer.self_attn, layer.mlp
    groups = {"self_attn": (attention, ["q_proj", "k_proj", "v_proj"]), "mlp": (mlp, ["gate_proj", "up_proj"])}
    modules = {}
    for block_name, (block, names) in groups.items():
        linears = [getattr(block, name) for name in names]
        if variant.endswith("fused"):
            first = FusedFirst(linears, transposed=variant.startswith("transposed"))
            modules[(block_name, names[0])] = first
            for name in names[1:]:
                modules[(block_name, name)] = FusedSlice(first)
        else:
            for name, linear in zip(names, linears):
                modules[(block_name, name)] = Transposed(linear) if variant == "transposed" else linear
    others = {"self_attn": (attention, ["o_proj"]), "mlp": (mlp, ["down_proj"])}
    for block_name, (block, names) in others.items():
        for name in names:
            linear = getattr(block, name)
            modules[(block_name, name)] = Transposed(linear) if variant.startswith("transposed") else linear
    return modules


def install(model, installed: list[dict]) -> None:
    for layer, modules in zip(model.model.layers, installed):
        for (block_name, name), module in modules.items():
            setattr(getattr(layer, block_name), name, module)


def time_steps(model, rows: int, context: int, steps: int, generator: torch.Generator) -> tuple[float, torch.Tensor]:
    """Best seconds of one decode step (one token per row over a cache of `context` tokens), and the logits."""
    vocab_size = model.config.vocab_size
    prompt = torch.randint(0, vocab_size, (rows, context), generator=generator)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        token = torch.randint(0, vocab_size, (rows, 1), generator=generator)
        best, logits = float("inf"), None
        for _ in range(steps):
            started = time.perf_counter()
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits
            best = min(best, time.perf_counter() - started)
            cache.crop(-1)  # drop the step's entry: every step reads the same `context` tokens
    return best, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per variant and round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/bench_fused_projections.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_policy(args.model)
    model.eval()
    installed = {variant: [variant_modules(layer, variant) for layer in model.model.layers] for variant in VARIANTS}
    best: dict[tuple[str, int], float] = {}
    reference: dict[int, torch.Tensor] = {}
    max_difference: dict[str, float] = {}
    for round_index in range(args.rounds):
        order = VARIANTS[round_index % len(VARIANTS) :] + VARIANTS[: round_index % len(VARIANTS)]
        for rows in [int(part) for part in args.rows.split(",")]:
            for variant in order:
                install(model, installed[variant])
                seconds, logits = time_steps(model, rows, args.context, args.steps, torch.Generator().manual_seed(rows))
                best[(variant, rows)] = min(best.get((variant, rows), float("inf")), seconds)
                if variant == "linear":
                    reference[rows] = logits
                elif rows in reference:
                    difference = float((logits - reference[rows]).abs().max())
                    max_difference[variant] = max(max_difference.get(variant, 0.0), difference)
    install(model, installed["linear"])
    results = []
    for rows in [int(part) for part in args.rows.split(",")]:
        for form in ("linear", "transposed"):
            unfused, fused = best[(form, rows)], best[(f"{form}-fused", rows)]
            results.append(
                {
                    "rows": rows,
                    "form": form,
                    "unfused_ms": 1e3 * unfused,
                    "fused_ms": 1e3 * fused,
                    "speedup": unfused / fused,
                }
            )
            print(
                f"rows {rows} {form:10s}: unfused {1e3 * unfused:7.2f} ms  fused {1e3 * fused:7.2f} ms  "
                f"fused speedup {unfused / fused:.3f}x"
            )
    print(f"max |logit difference| against the model as built: {max_difference}")
    output = {"args": vars(args), "results": results, "max_logit_difference": max_difference}
    Path(args.out).write_text(json.dumps(output, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
