"""The owned decode forward against transformers' `generate` and against the memory wall, side by side.

    python scripts/bench_owned_engine.py recipes/real-cpu.yaml --out benchmarks/bench_owned_engine.json

On the recipe's model (SmolLM2-135M-Instruct for real-cpu), one thread, interleaved over --rounds rounds
after an untimed one, CPU seconds (time.process_time: the figure least moved by other processes):
  - greedy decoding at one row of held-out prompts of the recipe's task, forced to --max-new-tokens
    tokens: transformers' `generate` (float32), the engine on the owned forward in float32 (with the
    machine's measured linear-form plan, as a worker runs it) and, with --bfloat16, in bfloat16; tokens
    compared with `generate` (bfloat16 is not exact: its first divergence is reported);
  - one plain decode step at 1 row against the memory wall: the bytes of every weight the step
    multiplies by, over the fastest streaming one thread was measured to get (a sum over buffers far beyond
    the caches, or matrix-vector products over distinct matrices, whichever is faster on this CPU);
  - a 16-token verify pass (4 rows x a 4-token chain) against a plain 4-row step over the same cache.
Prints a table and writes JSON.
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
from profile_plain_step import interleaved_cpu_seconds, streaming_bandwidth
from rich.console import Console
from rich.table import Table

from tlt_cli.config import load_recipe
from tlt_cli.drafter.warmup import encode_prompts
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.running_batch import RunningBatch
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.training import setup
from tlt_cli.tuning.linear_forms import measured_linear_plan

NEVER_EMITTED = -1  # an end-of-sequence id no token has: every response runs to max_new_tokens
VERIFY_ROWS, VERIFY_TOKENS = 4, 4


def gemv_bandwidth(megabytes: int = 512, rounds: int = 3) -> float:
    """GB/s one thread reads by matrix-vector products over distinct 1024x1024 float32 matrices (far beyond the
    caches): on some CPUs BLAS's prefetching streams faster than the plain sum streaming_bandwidth times."""
    matrices = [torch.ones(1024, 1024) for _ in range(megabytes // 4)]
    vector = torch.ones(1024)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for matrix in matrices:
            torch.mv(matrix, vector)
        best = min(best, time.perf_counter() - started)
    return megabytes * 1024 * 1024 / best / 1e9


def streamed_bytes(decode_model) -> int:
    """Bytes of the weights one decode step multiplies by (every projection of every layer, and the head)."""
    projections = [getattr(layer, name) for layer in decode_model.layers for name in ("qkv", "o", "gate_up", "down")]
    total = 0
    for projection in [*projections, decode_model.head]:
        weight = projection.transposed if projection.weight is None else projection.weight
        total += weight.numel() * weight.element_size()
    return total


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    return next((index for index, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def greedy_methods(target, engines: dict[str, EmbeddedEngine], prompts, max_new_tokens: int, rounds: int) -> dict:
    """Tokens per CPU second of `generate` and each engine over the same prompts at one row, interleaved."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)

    def run_generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            output = target.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
            )
        return output[0, ids.shape[1] :].tolist()

    def engine_method(engine: EmbeddedEngine):
        return lambda prompt: list(
            engine.generate([RolloutRequest(0, tuple(prompt))], sampling, torch.Generator())[0].response_ids
        )

    methods = {"generate (float32)": run_generate, **{name: engine_method(e) for name, e in engines.items()}}
    seconds, outputs = interleaved_cpu_seconds(methods, prompts, rounds)
    tokens = (rounds - 1) * len(prompts) * max_new_tokens
    reference = outputs["generate (float32)"]
    return {
        name: {
            "tokens_per_cpu_second": tokens / seconds[name],
            "vs_generate": seconds["generate (float32)"] / seconds[name],
            "same_tokens_as_generate": outputs[name] == reference,
            "first_divergences": [first_divergence(mine, theirs) for mine, theirs in zip(outputs[name], reference)],
        }
        for name in methods
    }


def step_milliseconds(engine: EmbeddedEngine, prompts, rows: int, max_new_tokens: int) -> float:
    """Median milliseconds of a plain decode step with `rows` running rows (CPU time)."""
    requests = [RolloutRequest(row, tuple(prompts[row % len(prompts)])) for row in range(rows)]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    steps = []
    started = [time.process_time()]

    def observe(step) -> None:
        now = time.process_time()
        steps.append(now - started[0])
        started[0] = now

    engine.generate(requests, sampling, torch.Generator(), on_decode_step=observe)
    return 1e3 * statistics.median(steps[1:])


def prefilled_batch(engine: EmbeddedEngine, prompts) -> RunningBatch:
    """A running batch of VERIFY_ROWS rows after the prefill of their prompts (cut to the shortest's length)."""
    length = min(len(prompts[row % len(prompts)]) for row in range(VERIFY_ROWS))
    tokens = torch.tensor([prompts[row % len(prompts)][:length] for row in range(VERIFY_ROWS)])
    zeros = torch.zeros(VERIFY_ROWS, dtype=torch.long)
    batch = RunningBatch(
        request_index=torch.arange(VERIFY_ROWS),
        prompt_lengths=torch.full_like(zeros, length),
        lengths=zeros.clone(),
        pending=zeros.clone(),
        generated=zeros.clone(),
        finished_by_eos=zeros.bool(),
        tokens=torch.nn.functional.pad(tokens, (0, 64)),
        cache=engine.decode_model.new_cache(VERIFY_ROWS, length + 64),
        store_hidden=True,
    )
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    hidden = engine.target.forward_block(batch, tokens, torch.arange(length).expand(VERIFY_ROWS, -1), causal)
    batch.lengths = batch.prompt_lengths.clone()
    batch.pending = engine.target.logits(hidden[:, -1]).argmax(dim=-1)
    return batch


def verify_against_plain(engine: EmbeddedEngine, prompts, repeats: int) -> dict:
    """CPU milliseconds of a 4-row x 4-token chain verify pass and of a plain 4-row step (each with its
    logits), alternated over one cache (neither commits: both write past the rows' committed lengths)."""
    target = engine.target
    timings: dict[str, list[float]] = defaultdict(list)
    with torch.no_grad():
        batch = prefilled_batch(engine, prompts)
        chain = torch.ones(VERIFY_TOKENS, VERIFY_TOKENS, dtype=torch.bool).tril()
        block = batch.pending[:, None].expand(-1, VERIFY_TOKENS).contiguous()
        positions = batch.lengths[:, None] + torch.arange(VERIFY_TOKENS)
        single = torch.ones(1, 1, dtype=torch.bool)
        for repeat in range(repeats + 1):
            for name, tokens, places, mask in (
                ("verify 4x4", block, positions, chain),
                ("plain 4 rows", batch.pending[:, None], batch.lengths[:, None], single),
            ):
                started = time.process_time()
                target.logits(target.forward_block(batch, tokens, places, mask))
                if repeat > 0:
                    timings[name].append(1e3 * (time.process_time() - started))
    verify, plain = statistics.median(timings["verify 4x4"]), statistics.median(timings["plain 4 rows"])
    return {"verify_ms": verify, "plain_ms": plain, "ratio": verify / plain}


def render(report: dict) -> None:
    console = Console()
    table = Table(title=f"greedy at 1 row, {report['model']} ({report['max_new_tokens']} tokens, CPU time)")
    for column in ("method", "tokens/CPU-s", "vs generate", "same tokens", "first divergence"):
        table.add_column(column, justify="right")
    for name, values in report["greedy"].items():
        divergences = [d for d in values["first_divergences"] if d is not None]
        table.add_row(
            name,
            f"{values['tokens_per_cpu_second']:.1f}",
            f"{values['vs_generate']:.2f}x",
            str(values["same_tokens_as_generate"]),
            f"token {min(divergences)}" if divergences else "-",
        )
    console.print(table)
    wall = Table(title="a plain step at 1 row against the memory wall; a verify pass against a plain step")
    for column in ("figure", "value"):
        wall.add_column(column, justify="right")
    for name, step in report["steps"].items():
        wall.add_row(f"{name}: step at 1 row", f"{step['step_ms']:.1f} ms")
        wall.add_row(
            f"{name}: wall ({step['streamed_mb']:.0f} MB at {report['streaming_gb_per_s']:.1f} GB/s)",
            f"{step['wall_ms']:.1f} ms",
        )
        wall.add_row(f"{name}: step / wall", f"{step['step_ms'] / step['wall_ms']:.2f}x")
        verify = step["verify"]
        wall.add_row(
            f"{name}: 16-token verify / plain 4-row step",
            f"{verify['verify_ms']:.1f} / {verify['plain_ms']:.1f} ms = {verify['ratio']:.2f}x",
        )
    console.print(wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", type=Path, nargs="?", default=Path("recipes/real-cpu.yaml"))
    parser.add_argument("--prompts", type=int, default=3, help="held-out prompts, one row each")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the greedy comparison, the first untimed")
    parser.add_argument("--bfloat16", action="store_true", help="also the engine with bfloat16 weight copies")
    parser.add_argument("--out", type=Path, default=Path("bench_owned_engine.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    target, tokenizer = setup.policy_and_tokenizer(recipe)
    plan = measured_linear_plan("auto", [target], setup.model_cache(recipe))
    held_out = range(FIRST_BENCH_PROBLEM, FIRST_BENCH_PROBLEM + max(args.prompts, VERIFY_ROWS))
    prompts = encode_prompts(tokenizer, setup.task(recipe), held_out)
    dtypes = {"owned float32": torch.float32, **({"owned bfloat16": torch.bfloat16} if args.bfloat16 else {})}
    engines = {
        name: EmbeddedEngine(
            target, NEVER_EMITTED, tokenizer.pad_token_id, decode_model=decode_model_for(target, dtype, plan)
        )
        for name, dtype in dtypes.items()
    }
    # the wall: the weights' bytes over the faster of the two ways one thread was measured to stream memory
    bandwidths = {"sum": streaming_bandwidth(), "matrix-vector": gemv_bandwidth()}
    bandwidth = max(bandwidths.values())
    steps = {}
    for name, engine in engines.items():
        wall_bytes = streamed_bytes(engine.decode_model)
        steps[name] = {
            "step_ms": step_milliseconds(engine, prompts, 1, args.max_new_tokens),
            "streamed_mb": wall_bytes / 1e6,
            "wall_ms": wall_bytes / bandwidth / 1e6,
            "verify": verify_against_plain(engine, prompts, repeats=10),
        }
    report = {
        "recipe": str(args.recipe),
        "model": recipe.model.path,
        "max_new_tokens": args.max_new_tokens,
        "streaming_gb_per_s": bandwidth,
        "streaming_gb_per_s_by_method": bandwidths,
        "decode_paths": {name: engine.decode_model.describe() for name, engine in engines.items()},
        "steps": steps,
        "greedy": greedy_methods(target, engines, prompts[: args.prompts], args.max_new_tokens, args.rounds),
    }
    render(report)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
