"""Where a plain decode step's time goes on a real model, and how far it is from the memory wall.

Plain decoding at a few rows streams every weight once per step, so a step cannot be faster than
the model's bytes over the memory bandwidth one core gets. This script measures that bandwidth (a
sum over buffers far larger than the caches), then runs the embedded engine with linear forms on
(as a worker does) on the recipe's model and held-out prompts of its task, and splits one decode
step by torch.profiler into the matrix products by weight shape (with the bandwidth each reaches),
attention, and the rest of the model's forward (norms, rotary embedding, residual adds, cache
writes, the Python of the modules). Then it times, interleaved over --rounds rounds after an untimed
one, tokens per CPU second of the engine with and without the forms and of transformers' greedy
`generate` with and without them (forced to --max-new-tokens tokens, so all four decode the same
number), and checks the tokens are the same.

    python scripts/profile_plain_step.py recipes/real-cpu.yaml --batch-size 1 --out benchmarks/profile_plain_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from bench_rollout import FIRST_BENCH_PROBLEM
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from tlt_cli.config import load_recipe
from tlt_cli.drafter.warmup import encode_prompts
from tlt_cli.engine.linear_forms import FormedCopy
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.training import setup
from tlt_cli.tuning.linear_forms import measured_linear_plan

NEVER_EMITTED = -1  # an end-of-sequence id no token has: every response runs to max_new_tokens
MATRIX_PRODUCTS = ("aten::mm", "aten::addmm")


def streaming_bandwidth(megabytes: int = 512, rounds: int = 3) -> float:
    """GB/s one thread reads from memory: the best of `rounds` sums over buffers of `megabytes` in all."""
    buffers = [torch.ones(4 * 1024 * 1024 // 4) for _ in range(megabytes // 4)]
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for buffer in buffers:
            buffer.sum()
        best = min(best, time.perf_counter() - started)
    return megabytes * 1024 * 1024 / best / 1e9


def decode_breakdown(engine: EmbeddedEngine, requests, sampling) -> dict:
    """Milliseconds per decode step: matrix products by weight shape, attention, the rest (prefill left out)."""
    rows = len(requests)
    steps: list = []
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        engine.generate(requests, sampling, torch.Generator().manual_seed(0), on_decode_step=steps.append)
    decode_steps = len(steps)
    step_ms = 1e3 * sum(step.seconds for step in steps) / decode_steps
    by_shape: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    attention_ms = 0.0
    for event in profiler.key_averages(group_by_input_shape=True):
        shapes = event.input_shapes
        if event.key in MATRIX_PRODUCTS:
            key, weight_elements = _weight_of(shapes[-2], shapes[-1], rows)
            if key is None:  # a product of the prefill, or not of a weight
                continue
            by_shape[key][0] += event.self_cpu_time_total / 1e3 / decode_steps
            by_shape[key][1] += event.count * weight_elements * 4 / decode_steps
        elif "attention" in event.key and shapes and shapes[0] and shapes[0][2] <= 16:
            attention_ms += event.self_cpu_time_total / 1e3 / decode_steps
    products = {
        key: {"ms": ms, "megabytes": nbytes / 1e6, "gb_per_s": nbytes / ms / 1e6}
        for key, (ms, nbytes) in by_shape.items()
    }
    matrix_ms = sum(product["ms"] for product in products.values())
    return {
        "decode_steps": decode_steps,
        "step_ms_under_profiler": step_ms,
        "matrix_products": products,
        "matrix_ms": matrix_ms,
        "attention_ms": attention_ms,
        "rest_ms": step_ms - matrix_ms - attention_ms,
        "weight_megabytes": sum(product["megabytes"] for product in products.values()),
    }


def _weight_of(first: list[int], second: list[int], rows: int) -> tuple[str | None, int]:
    """The weight of a product `first @ second` named out x in, and its element count; None for the
    prefill's and for any that is not two matrices. The forms multiply x [rows, in] @ W^T [in, out]
    (linear, transposed) or W [out, in] @ x^T [in, rows] (weight-major): the weight is the larger operand."""
    if len(first) != 2 or len(second) != 2:
        return None, 0
    weight_first = first[0] * first[1] > second[0] * second[1]
    weight, activations = (first, second) if weight_first else (second, first)
    if rows not in activations:
        return None, 0
    out_features, in_features = (weight[0], weight[1]) if weight_first else (weight[1], weight[0])
    return f"{out_features}x{in_features}", out_features * in_features


def interleaved_cpu_seconds(methods: dict, prompts, rounds: int) -> tuple[dict[str, float], dict[str, list]]:
    """Each method on each prompt, interleaved, `rounds` times; CPU seconds and outputs per method, the first
    round left out (first-call costs)."""
    seconds: dict[str, float] = defaultdict(float)
    outputs: dict[str, list] = defaultdict(list)
    for round_index in range(rounds):
        for prompt in prompts:
            for name, method in methods.items():
                started = time.process_time()
                tokens = method(prompt)
                if round_index > 0:
                    seconds[name] += time.process_time() - started
                    outputs[name].append(tokens)
    return seconds, outputs


def timed_methods(target, tokenizer, plan, prompts, max_new_tokens: int, rounds: int) -> dict:
    """Tokens per CPU second of four greedy decoders over the same prompts, interleaved; tokens compared."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    engines = {
        "engine+forms": EmbeddedEngine(target, NEVER_EMITTED, tokenizer.pad_token_id, linear_plan=plan),
        "engine": EmbeddedEngine(target, NEVER_EMITTED, tokenizer.pad_token_id),
    }

    def run_engine(name: str, prompt: list[int]) -> list[int]:
        request = [RolloutRequest(0, tuple(prompt), group=0)]
        return list(engines[name].generate(request, sampling, torch.Generator())[0].response_ids)

    # transformers' generate on a decode-time copy of the target whose linear layers compute in the plan's forms
    formed_target = FormedCopy(target, plan).module

    def run_generate(with_forms: bool, prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        arguments = {"max_new_tokens": max_new_tokens, "min_new_tokens": max_new_tokens, "do_sample": False}
        model = formed_target if with_forms else target
        with torch.no_grad():
            output = model.generate(ids, attention_mask=torch.ones_like(ids), eos_token_id=None, **arguments)
        return output[0, ids.shape[1] :].tolist()

    methods = {
        "engine+forms": lambda prompt: run_engine("engine+forms", prompt),
        "engine": lambda prompt: run_engine("engine", prompt),
        "generate": lambda prompt: run_generate(False, prompt),
        "generate+forms": lambda prompt: run_generate(True, prompt),
    }
    seconds, outputs = interleaved_cpu_seconds(methods, prompts, rounds)
    tokens = (rounds - 1) * len(prompts) * max_new_tokens
    return {
        name: {
            "tokens_per_cpu_second": tokens / seconds[name],
            "vs_generate": seconds["generate"] / seconds[name],
            "same_tokens_as_generate": outputs[name] == outputs["generate"],
        }
        for name in methods
    }


def render(report: dict) -> None:
    console = Console()
    breakdown = report["breakdown"]
    table = Table(title=f"one plain decode step at {report['batch_size']} row(s), ms (linear forms on)")
    for column in ("part", "ms", "MB read", "GB/s"):
        table.add_column(column, justify="right")
    for key, product in sorted(breakdown["matrix_products"].items(), key=lambda item: -item[1]["ms"]):
        table.add_row(
            f"products {key}", f"{product['ms']:.1f}", f"{product['megabytes']:.0f}", f"{product['gb_per_s']:.1f}"
        )
    wall_ms = breakdown["weight_megabytes"] / report["streaming_gb_per_s"]
    table.add_row("all products", f"{breakdown['matrix_ms']:.1f}", f"{breakdown['weight_megabytes']:.0f}", "")
    table.add_row("memory wall (weights / streaming)", f"{wall_ms:.1f}", "", f"{report['streaming_gb_per_s']:.1f}")
    table.add_row("attention", f"{breakdown['attention_ms']:.1f}", "", "")
    table.add_row("rest of the forward", f"{breakdown['rest_ms']:.1f}", "", "")
    table.add_row("step (under the profiler)", f"{breakdown['step_ms_under_profiler']:.1f}", "", "")
    console.print(table)
    methods = Table(title="greedy, tokens per CPU second (same prompts, same token count)")
    for column in ("method", "tokens/CPU-s", "vs generate", "same tokens as generate"):
        methods.add_column(column, justify="right")
    for name, values in report["methods"].items():
        methods.add_row(
            name,
            f"{values['tokens_per_cpu_second']:.1f}",
            f"{values['vs_generate']:.2f}x",
            str(values["same_tokens_as_generate"]),
        )
    console.print(methods)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, nargs="?", default=Path("recipes/real-cpu.yaml"))
    parser.add_argument("--batch-size", type=int, default=1, help="rows of the profiled decode step")
    parser.add_argument("--prompts", type=int, default=4, help="prompts of the timed comparison (one row each)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the timed comparison, the first untimed")
    parser.add_argument("--out", type=Path, default=Path("profile_plain_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    target, tokenizer = setup.policy_and_tokenizer(recipe)
    plan = measured_linear_plan("auto", [target], setup.model_cache(recipe))
    held_out = range(FIRST_BENCH_PROBLEM, FIRST_BENCH_PROBLEM + max(args.prompts, args.batch_size))
    prompts = encode_prompts(tokenizer, setup.task(recipe), held_out)
    engine = EmbeddedEngine(target, NEVER_EMITTED, tokenizer.pad_token_id, linear_plan=plan)
    requests = [RolloutRequest(row, tuple(prompts[row]), group=row) for row in range(args.batch_size)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    engine.generate(requests, sampling, torch.Generator())  # untimed: first-call costs
    unprofiled: list = []
    engine.generate(requests, sampling, torch.Generator(), on_decode_step=unprofiled.append)
    report = {
        "recipe": str(args.recipe),
        "model": recipe.model.path,
        "batch_size": args.batch_size,
        "streaming_gb_per_s": streaming_bandwidth(),
        "step_ms": 1e3 * statistics.median(step.seconds for step in unprofiled),
        "breakdown": decode_breakdown(engine, requests, sampling),
        "methods": timed_methods(target, tokenizer, plan, prompts[: args.prompts], args.max_new_tokens, args.rounds),
    }
    render(report)
    Console().print(f"decode step without the profiler: {report['step_ms']:.1f} ms (median)")
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
