"""`tlt bench rollout`: whole rollouts with SD mode auto against plain decoding and named fixed shapes, per batch
size and rollout dtype, on the recipe's model, drafter, task and sampling; whether and how much SD pays here.

    tlt bench rollout --recipe recipes/real-cpu.yaml --batch-sizes 1,4,16 --dtypes float32,bfloat16 --repeats 2

For every dtype and batch size B it takes the decode plan `tlt train` makes for B rows in that dtype
(common.run_decode_plan) and generates B rows (grouped as a GRPO step groups them) to their natural end, the
running batch shrinking as responses end, with each variant in turn (so machine load hits them alike):
  plain      plain decoding steps
  auto       mode auto's cost-model schedule over the plan's pass costs; one schedule per (dtype, B), kept across
             repeats as a worker keeps it across steps (repeat 1 starts from the priors)
  <shape>    one SD configuration at every step (--fixed: s<steps>-k<topk>-t<draft tokens>, ngram<N>, hybrids)
  generate   with --generate: transformers' `generate` on the same rows in one left-padded batch, in the policy's
             own dtype: what decoding costs without tlt's engine
A variant's rate is its response tokens over the generate call's seconds (prefill included), the median over the
repeats; variants sample different lengths, so both are shown. At temperature 0 each variant's responses are
compared with plain's token for token (lossless SD gives the same tokens, up to floating-point ties).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from transformers import PreTrainedTokenizerBase

from tlt_cli.bench.common import (
    MAX_BENCH_ROWS,
    BenchError,
    BenchReport,
    Progress,
    auto_speculative_plan,
    bench_recipe,
    bench_requests,
    dtype_label,
    model_pair,
    pair_with_plan,
    parse_dtypes,
    parse_numbers,
    print_load,
    render_table,
    run_decode_plan,
    speed_words,
    starting_drafter_folder,
    task_and_sampling,
    worker_threads,
)
from tlt_cli.bench.identity import first_divergences, same_verdict
from tlt_cli.config import Recipe
from tlt_cli.display import keeps_one_line
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.model_pair import ModelPair, fixed_decoder, shard_engine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder, speculative_decoder
from tlt_cli.speculative.rules import RuleTableError, parse_label
from tlt_cli.speculative.shapes import shape_problem
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig

PLAIN = "plain"
# a cell whose shortest variant ran less than this gets no verdict: its ratios are timer and scheduler noise
MIN_TIMED_SECONDS = 1.0
AUTO = "auto"
GENERATE = "generate"
DEFAULT_FIXED = "ngram4,s2-k1-t3,s4-k1-t5,s2-k1-t3+ngram4"
# the last task problem a rollout may start at: the tasks' generators take any index below 2^63
MAX_FIRST_PROMPT = 10**12


@dataclass(frozen=True)
class RolloutSettings:
    """What `tlt bench rollout` measures: batch sizes, dtypes (empty: the recipe's), the fixed shapes, repeats
    and the task problem the first repeat's prompts start at."""

    batch_sizes: str = "1,4,16"
    dtypes: str = ""
    fixed: str = DEFAULT_FIXED
    repeats: int = 2
    first_prompt: int = 100_000
    generate: bool = False


@dataclass(frozen=True)
class TimedRollout:
    """One variant's whole rollout: response tokens, seconds of the generate call, its decode steps, the
    responses' token ids in request order, and of its n-gram drafts, by the number of the row's finished siblings,
    [verify passes, accepted draft tokens] (speculative/ngram_proposer.py; empty without n-gram drafts)."""

    tokens: int
    seconds: float
    decode_steps: int
    responses: tuple[tuple[int, ...], ...]
    ngram_by_finished_siblings: dict[int, list[int]]


def fixed_shapes(text: str) -> dict:
    """'ngram4,s2-k1-t3' -> label -> SpeculativeConfig, or a BenchError naming the label."""
    shapes = {}
    for label in (part.strip() for part in text.split(",") if part.strip()):
        try:
            config = parse_label(label)
        except RuleTableError:
            config = None
        if config is None:
            raise BenchError(f"--fixed names '{label}'; use s<steps>-k<topk>-t<draft tokens>, ngram<N> or a hybrid.")
        problem = shape_problem(config)
        if problem is not None:
            raise BenchError(f"--fixed names '{label}': {problem}")
        shapes[label] = config
    return shapes


def timed_rollout(
    pair: ModelPair, decoder: SpeculativeDecoder, requests: list[RolloutRequest], sampling: SamplingParams, seed: int
) -> TimedRollout:
    """Generate `requests` to their natural end with `decoder` on the pair's engine, timed."""
    steps: list[DecodeStep] = []
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    start = time.perf_counter()
    completions = shard_engine(pair, decoder).generate(requests, sampling, generator, on_decode_step=steps.append)
    seconds = time.perf_counter() - start
    responses = tuple(tuple(completion.response_ids) for completion in completions)
    by_siblings = dict(decoder.by_finished_siblings)
    return TimedRollout(sum(map(len, responses)), seconds, len(steps), responses, by_siblings)


def generate_rollout(
    pair: ModelPair, requests: list[RolloutRequest], sampling: SamplingParams, seed: int
) -> TimedRollout:
    """transformers' `generate` over `requests` in one left-padded batch, in the target's own dtype and forward,
    with the rollout's sampling, each response cut after its EOS; timed."""
    longest = max(len(request.prompt_ids) for request in requests)
    input_ids = torch.full((len(requests), longest), pair.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, request in enumerate(requests):
        input_ids[row, longest - len(request.prompt_ids) :] = torch.tensor(request.prompt_ids)
        attention_mask[row, longest - len(request.prompt_ids) :] = 1
    sampled = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        output = pair.target.generate(
            input_ids.to(pair.device),
            attention_mask=attention_mask.to(pair.device),
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.greedy,
            eos_token_id=pair.eos_token_id,
            pad_token_id=pair.pad_token_id,
            **({} if sampling.greedy else sampled),
        )
    seconds = time.perf_counter() - start
    eos = pair.eos_token_id
    rows = output[:, longest:].tolist()
    responses = tuple(tuple(row[: row.index(eos) + 1] if eos in row else row) for row in rows)
    return TimedRollout(sum(map(len, responses)), seconds, output.shape[1] - longest, responses, {})


def variant_runners(
    recipe: Recipe, pair: ModelPair, grid: RolloutGrid
) -> tuple[dict[str, Callable[..., TimedRollout]], AdaptiveSpeculativeDecoder | None]:
    """(name -> runner(requests, sampling, seed) of one whole rollout, auto's decoder): auto is one schedule kept
    across repeats (None where the plan has no pass costs, a model outside the owned forward: auto decodes plainly);
    the other engine variants get a fresh decoder each rollout."""
    auto = speculative_decoder(auto_speculative_plan(recipe), pair.drafter, recipe.run.seed, pair.decode.pass_costs)
    decoders = {PLAIN: lambda: fixed_decoder(pair, None), AUTO: lambda: auto or fixed_decoder(pair, None)}
    for label, config in grid.shapes.items():
        decoders[label] = lambda config=config: fixed_decoder(pair, config)
    runners = {
        name: lambda requests, sampling, seed, make=make: timed_rollout(pair, make(), requests, sampling, seed)
        for name, make in decoders.items()
    }
    if grid.generate:
        runners[GENERATE] = lambda requests, sampling, seed: generate_rollout(pair, requests, sampling, seed)
    return runners, auto


@dataclass(frozen=True)
class RolloutGrid:
    """The settings parsed: batch sizes, dtypes, fixed shapes (label -> configuration), repeats, first prompt."""

    batch_sizes: list[int]
    dtypes: list[str]
    shapes: dict[str, SpeculativeConfig]
    repeats: int
    first_prompt: int
    generate: bool


def rollout_grid(settings: RolloutSettings, recipe: Recipe) -> RolloutGrid:
    """The settings parsed and checked (a BenchError naming the option), before any model is loaded."""
    if settings.repeats < 1:
        raise BenchError(f"--repeats is {settings.repeats}; give 1 or more.")
    if not 0 <= settings.first_prompt <= MAX_FIRST_PROMPT:
        raise BenchError(f"--first-prompt is {settings.first_prompt}; give a problem number in 0..{MAX_FIRST_PROMPT}.")
    return RolloutGrid(
        parse_numbers("--batch-sizes", settings.batch_sizes, MAX_BENCH_ROWS),
        parse_dtypes(settings.dtypes, recipe),
        fixed_shapes(settings.fixed),
        settings.repeats,
        settings.first_prompt,
        settings.generate,
    )


def bench_rollout(
    recipe: Recipe,
    drafter_folder: Path | None,
    pair: ModelPair,
    tokenizer: PreTrainedTokenizerBase,
    grid: RolloutGrid,
    report: BenchReport,
    progress: Progress,
) -> dict:
    """Every (dtype, batch size) cell, each in the decode plan a run makes for it (recorded in `report`), each
    announced to `progress` as it starts and ends."""
    cells = {}
    for dtype in grid.dtypes:
        for rows in grid.batch_sizes:
            with progress.measuring(f"{dtype} B={rows}, {grid.repeats} repeat(s) of every variant"):
                plan = run_decode_plan(recipe, drafter_folder, dtype, rows)
                key = f"{dtype_label(dtype, plan)} B={rows}"
                report.decode_plans[key] = plan.to_dict()
                cells[key] = {
                    "dtype": plan.dtype,
                    "batch_size": rows,
                    **measure_cell(recipe, pair_with_plan(pair, plan), tokenizer, grid, rows),
                }
    return cells


def measure_cell(
    recipe: Recipe, pair: ModelPair, tokenizer: PreTrainedTokenizerBase, grid: RolloutGrid, rows: int
) -> dict:
    """One cell: per variant its repeats (each repeat's fresh prompts, the variants in turn), at temperature 0
    where each variant's responses leave plain's, and the configurations auto chose."""
    task, sampling = task_and_sampling(recipe)
    runners, auto = variant_runners(recipe, pair, grid)
    runs: dict[str, list[TimedRollout]] = {name: [] for name in runners}
    divergences: dict[str, list[dict]] = {name: [] for name in runners}
    for repeat in range(grid.repeats):
        requests = bench_requests(recipe, tokenizer, task, rows, grid.first_prompt + repeat * rows)
        for name, run in runners.items():
            runs[name].append(run(requests, sampling, recipe.run.seed + repeat))
            if sampling.greedy:
                divergences[name] += _divergences(pair, requests, runs[PLAIN][-1], runs[name][-1])
    usage = auto.adaptive_schedule.take_usage() if auto is not None else {}
    return {
        "runs": runs,
        "divergences": divergences if sampling.greedy else None,
        "auto_configs": {label: value.decode_steps for label, value in usage.items()},
    }


def _divergences(pair: ModelPair, requests: list[RolloutRequest], plain: TimedRollout, run: TimedRollout) -> list[dict]:
    """Where `run`'s responses first leave plain's (identity.py), the target's logits in the decode dtype."""
    prompts = [request.prompt_ids for request in requests]
    return first_divergences(pair.target, prompts, plain.responses, run.responses, pair.decode.dtype)


def summarize(cells: dict) -> dict:
    """Per cell and variant: median tokens/s, its ratio to plain, the range of its repeats' ratios to plain's repeat
    with the same prompts, the repeats, the last repeat's response tokens, seconds and
    decode steps, and at temperature 0 the rows identical to plain's and the identity verdict (None when
    sampling)."""
    summary = {}
    for key, cell in cells.items():
        rates = {
            name: statistics.median(run.tokens / run.seconds for run in runs) for name, runs in cell["runs"].items()
        }
        divergences = cell["divergences"]
        summary[key] = {}
        for name, runs in cell["runs"].items():
            rows = sum(len(run.responses) for run in runs)
            # repeat r's rate against plain's repeat r: the same prompts and seed
            paired = [
                (run.tokens / run.seconds) / (plain.tokens / plain.seconds)
                for run, plain in zip(runs, cell["runs"][PLAIN])
            ]
            summary[key][name] = {
                "tokens_per_second": rates[name],
                "vs_plain": rates[name] / rates[PLAIN],
                "vs_plain_range": [min(paired), max(paired)],
                "repeats": len(runs),
                "response_tokens": runs[-1].tokens,
                "seconds": runs[-1].seconds,
                "decode_steps": runs[-1].decode_steps,
                "rows": rows,
                "identical_rows": rows - len(divergences[name]) if divergences is not None else None,
                "identity": same_verdict(divergences[name]) if divergences is not None else None,
            }
    return summary


def verdict(summary: dict) -> list[str]:
    """One line per cell, in words: auto and the best fixed shape against plain, and whether SD pays; no verdict
    for a cell whose shortest variant ran under MIN_TIMED_SECONDS (timer and scheduler noise would decide it)."""
    lines = []
    for key, variants in summary.items():
        shortest = min(figures["seconds"] for figures in variants.values())
        if shortest < MIN_TIMED_SECONDS:
            lines.append(
                f"{key}: no verdict: a variant ran {shortest:.2f} s, too short to time (under {MIN_TIMED_SECONDS:.0f} "
                "s); give longer responses (rollout.max_new_tokens) or larger batches"
            )
            continue
        auto = variants[AUTO]["vs_plain"]
        fixed = {name: figures["vs_plain"] for name, figures in variants.items() if name not in (PLAIN, AUTO, GENERATE)}
        best = max(fixed, key=fixed.get) if fixed else None
        fastest = max([auto, *fixed.values()])
        pays = f"SD pays here, up to {fastest:.2f}x plain's rate" if fastest > 1.0 else "SD does not pay here"
        pays += repeat_spread(variants[AUTO])
        shape = f"; the best fixed shape, {best}, {speed_words(fixed[best])}" if best is not None else ""
        engine = (
            f"; plain is {speed_words(1 / variants[GENERATE]['vs_plain'])} than generate"
            if GENERATE in variants
            else ""
        )
        lines.append(f"{key}: {pays}: auto {speed_words(auto)} than plain{shape}{engine}")
    return lines


def repeat_spread(figures: dict) -> str:
    """How far a variant's ratio to plain ranged over its repeats, in words ('' for figures without repeats)."""
    if "repeats" not in figures:
        return ""
    if figures["repeats"] == 1:
        return " (one repeat: one sample, no spread)"
    low, high = figures["vs_plain_range"]
    return f" (auto {low:.2f}x-{high:.2f}x plain over {figures['repeats']} repeats)"


def render(console: Console, cells: dict, summary: dict) -> None:
    """The table: one row per (dtype, batch size), a column per variant; then the verdict lines."""
    names = list(next(iter(summary.values())))
    rows = []
    for key, variants in summary.items():
        row = [key]
        for name in names:
            figures = variants[name]
            identity = "" if figures["identity"] is None else f", same as plain: {figures['identity']}"
            row.append(
                f"{figures['response_tokens']} tok / {figures['seconds']:.2f} s "
                f"({figures['tokens_per_second']:.1f}/s, {figures['vs_plain']:.2f}x{identity})"
            )
        row.append(", ".join(f"{label} {steps}" for label, steps in cells[key]["auto_configs"].items()) or "-")
        rows.append(row)
    title = "whole rollouts: response tokens / seconds (tokens/s median, ratio to plain), last repeat"
    render_table(console, title, ["dtype, batch", *names, "auto's decode steps by configuration"], rows)
    for line in verdict(summary):
        console.print(line, highlight=False, soft_wrap=keeps_one_line(console))


def json_results(cells: dict) -> dict:
    """The cells as plain JSON values (response ids left out: they are compared, not kept)."""
    return {
        key: {
            **{name: value for name, value in cell.items() if name != "runs"},
            "runs": {
                name: [
                    {
                        field.name: getattr(run, field.name)
                        for field in dataclasses.fields(run)
                        if field.name != "responses"
                    }
                    for run in runs
                ]
                for name, runs in cell["runs"].items()
            },
        }
        for key, cell in cells.items()
    }


def run_rollout_bench(
    recipe_name: str, overrides: list[str], settings: RolloutSettings, out: Path, console: Console
) -> dict:
    """`tlt bench rollout`: load, measure every cell, print the table and the verdict, write the JSON."""
    recipe = bench_recipe(recipe_name, overrides)
    grid = rollout_grid(settings, recipe)  # refused before minutes of loading, not after
    report = BenchReport.start(
        "tlt bench rollout",
        recipe_name,
        overrides,
        settings,
        [recipe.run.seed + repeat for repeat in range(grid.repeats)],
        grid.repeats,
    )
    print_load(console, report.machine["usable_cores"])
    folder = starting_drafter_folder(recipe, console)
    with console.status("loading the target and its starting drafter as tlt train does"):
        pair, tokenizer = model_pair(recipe, folder)
    with worker_threads(recipe), console.status("generating whole rollouts with every variant"):
        progress = Progress(console, len(grid.dtypes) * len(grid.batch_sizes))
        cells = bench_rollout(recipe, folder, pair, tokenizer, grid, report, progress)
    summary = summarize(cells)
    render(console, cells, summary)
    written = report.write(out, json_results(cells), summary)
    print_load(console, report.machine["usable_cores"])
    console.print(f"wrote {out}", highlight=False, soft_wrap=True)
    return written
