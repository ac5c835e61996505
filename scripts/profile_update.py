"""Where the GRPO update's time goes, by operator category, in float32 and bfloat16 (actor.precision).

    python scripts/profile_update.py --recipe real-cpu --max-new-tokens 128 \
        --out benchmarks/profile_update.json train.prompts_per_step=2

Each precision runs in a fresh process on the same batch (scripts/bench_memory.py's worst_case_update:
one rank holding the whole optimizer state, prompts_per_step / workers.count prompts x group_size
random responses of max_new_tokens tokens). A first update warms up (AdamW's state is made, the
allocator fills) and is not profiled; the second, `actor.update` exactly as a worker calls it, runs
under torch.profiler. Every operator's self time (time not spent in the operators it calls) is put
in one category: AdamW's step, the rest of DeepSpeed's step (gradient norm, clipping, ZeRO's
partition copies), all-reduce, the log-prob head's products over the vocabulary and its
log-softmax (tlt_cli/training/logprobs.py), matrix products, attention, dtype casts and copies, the
other operators (norms, activations, elementwise), and Python and dispatch (self time of the autograd
engine's nodes and of this script's labels, and what the profiled update's wall-clock has outside
every operator). Apart, the same time split by phase: forward, backward, the decoder layers'
recomputation in backward (gradient checkpointing), the optimizer step. Prints a table of both
precisions side by side (with the CPU, its bfloat16/AMX flags and the load) and writes JSON with the
categories, the phases and each precision's 25 costliest operators.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from bench_update import PRECISIONS, machine
from rich.console import Console
from rich.table import Table

CATEGORIES = (
    "matrix products",
    "log-prob head: products over the vocabulary",
    "log-prob head: log-softmax over the vocabulary",
    "attention",
    "dtype casts and copies",
    "other operators (norms, activations, elementwise)",
    "optimizer step (AdamW)",
    "DeepSpeed step (gradient norm, clipping, ZeRO copies)",
    "all-reduce",
    "Python and dispatch",
)
PHASES = ("forward", "backward", "recomputation", "optimizer step")
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"}
# labels this script puts around the update's parts (instance attributes wrapped, no tlt code changed)
BACKWARD_LABEL = "profile: backward"
STEP_LABEL = "profile: DeepSpeed step"
LAYER_LABEL = "profile: decoder layer"
HEAD_NAMES = ("ChunkedHeadLogprobs",)
TOP_OPERATORS = 25
MICROSECONDS = 1e-6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="real-cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated: fp32,bf16")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the child process: one precision
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_intermixed_args()
    overrides = [*arguments.overrides, f"rollout.max_new_tokens={arguments.max_new_tokens}"]
    if arguments.one:
        print(json.dumps(profile_one_update(arguments.recipe, overrides)))
        return
    result = {"recipe": arguments.recipe, "overrides": overrides, **machine(), "profiles": {}}
    for precision in arguments.precisions.split(","):
        result["profiles"][precision] = profile_in_fresh_process(
            arguments.recipe, [*overrides, f"actor.precision={precision}"]
        )
    result["load_average_after"] = os.getloadavg()
    render(result)
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {arguments.out}")


def profile_in_fresh_process(recipe: str, overrides: list[str]) -> dict:
    command = [sys.executable, __file__, "--one", "--recipe", recipe, *overrides]
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"the profiled update ({' '.join(overrides)}) failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def profile_one_update(recipe_name: str, overrides: list[str]) -> dict:
    """A warm-up update, then one under torch.profiler: its categories, phases and costliest operators."""
    from bench_memory import worst_case_update
    from torch.profiler import ProfilerActivity, profile

    recipe, precision, actor, batch = worst_case_update(recipe_name, overrides)
    actor.update(batch)
    label_update_parts(actor)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started, started_cpu = time.perf_counter(), time.process_time()
        metrics = actor.update(batch)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    breakdown = categorise(profiler.events(), seconds)
    return {
        "precision": precision.precision,
        "sequences": batch.size,
        "sequence_tokens": int(batch.input_ids.shape[1]),
        "response_tokens": batch.response_token_count,
        "threads": recipe.workers.threads_per_worker,
        "update_seconds_profiled": seconds,
        "update_cpu_seconds_profiled": cpu_seconds,
        "loss": metrics.loss,
        **breakdown,
    }


def label_update_parts(actor) -> None:
    """Wrap the engine's backward and step, and each decoder layer's forward, in profiler labels; a layer's
    forward inside the engine's backward is its recomputation (gradient checkpointing)."""
    from torch.profiler import record_function

    engine = actor.engine
    for name, label in (("backward", BACKWARD_LABEL), ("step", STEP_LABEL)):
        method = getattr(engine, name)

        def labelled(*arguments, _method=method, _label=label, **keywords):
            with record_function(_label):
                return _method(*arguments, **keywords)

        setattr(engine, name, labelled)
    for layer in actor.policy.get_decoder().layers:
        layer.forward = labelled_forward(layer.forward, record_function)


def labelled_forward(forward, record_function):
    def run(*arguments, **keywords):
        with record_function(LAYER_LABEL):
            return forward(*arguments, **keywords)

    return run


def categorise(events, wall_seconds: float) -> dict:
    """Self seconds per category and per phase, and the costliest operators (module docstring)."""
    categories: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    operators: dict[str, float] = defaultdict(float)
    top_level = 0.0
    for event in events:
        seconds = event.self_cpu_time_total * MICROSECONDS
        ancestors = ancestor_names(event)
        if event.cpu_parent is None:
            top_level += event.cpu_time_total * MICROSECONDS
        categories[category(event.name, ancestors)] += seconds
        phases[phase(ancestors | {event.name})] += seconds
        if event.name.startswith("aten::") or "all_reduce" in event.name:
            operators[event.name] += seconds
    outside = max(wall_seconds - top_level, 0.0)
    categories["Python and dispatch"] += outside
    costliest = sorted(operators.items(), key=lambda item: -item[1])[:TOP_OPERATORS]
    return {
        "categories_seconds": {name: categories.get(name, 0.0) for name in CATEGORIES},
        "phases_seconds": {name: phases.get(name, 0.0) for name in PHASES},
        "outside_operators_seconds": outside,
        "costliest_operators_seconds": dict(costliest),
    }


def ancestor_names(event) -> set[str]:
    names = set()
    parent = event.cpu_parent
    while parent is not None:
        names.add(parent.name)
        parent = parent.cpu_parent
    return names


def category(name: str, ancestors: set[str]) -> str:
    """The category of an event's self time, given the names of the events it runs inside."""
    if "all_reduce" in name or "allreduce" in name:
        return "all-reduce"
    if any(ancestor.startswith("Optimizer.") for ancestor in ancestors | {name}):
        return "optimizer step (AdamW)"
    if not name.startswith("aten::"):
        return "Python and dispatch"
    if STEP_LABEL in ancestors:
        return "DeepSpeed step (gradient norm, clipping, ZeRO copies)"
    in_head = any(ancestor.startswith(HEAD_NAMES) for ancestor in ancestors)
    if in_head:
        if name in PRODUCTS:
            return "log-prob head: products over the vocabulary"
        if name not in CASTS:
            return "log-prob head: log-softmax over the vocabulary"
    if name in PRODUCTS:
        return "matrix products"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in CASTS:
        return "dtype casts and copies"
    return "other operators (norms, activations, elementwise)"


def phase(names: set[str]) -> str:
    if STEP_LABEL in names:
        return "optimizer step"
    if BACKWARD_LABEL in names:
        return "recomputation" if LAYER_LABEL in names else "backward"
    return "forward"


def render(result: dict) -> None:
    profiles = result["profiles"]
    first = next(iter(profiles.values()))
    title = (
        f"GRPO update by operator category, one rank, {first['sequences']} x {first['sequence_tokens']} tokens, "
        f"{first['threads']} thread(s) ({result['cpu']}, flags {' '.join(result['bfloat16_flags']) or 'none'}, "
        f"load {result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f}); seconds of self time"
    )
    table = Table(title=title)
    table.add_column("category")
    for precision in profiles:
        table.add_column(f"{precision} s", justify="right")
        table.add_column(f"{precision} %", justify="right")
    if set(profiles) == set(PRECISIONS):
        table.add_column("fp32 / bf16", justify="right")
    for group, key in (("categories_seconds", CATEGORIES), ("phases_seconds", PHASES)):
        for name in key:
            cells = []
            for profile in profiles.values():
                total = sum(profile[group].values())
                cells += [f"{profile[group][name]:.2f}", f"{100 * profile[group][name] / total:.1f}"]
            if set(profiles) == set(PRECISIONS):
                bf16 = profiles["bf16"][group][name]
                cells.append(f"{profiles['fp32'][group][name] / bf16:.2f}" if bf16 > 0 else "-")
            table.add_row(name if group == "categories_seconds" else f"phase: {name}", *cells)
        table.add_section()
    cells = []
    for profile in profiles.values():
        cells += [f"{profile['update_seconds_profiled']:.2f}", f"CPU {profile['update_cpu_seconds_profiled']:.2f}"]
    table.add_row("update under the profiler (wall, CPU)", *cells)
    Console(width=180).print(table)


if __name__ == "__main__":
    main()
