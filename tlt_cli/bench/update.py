"""`tlt bench update`: one worker's GRPO update, variant against variant, each measurement in a fresh process.

    tlt bench update --recipe real-cpu --variant off:actor.share_prompt=false,actor.micro_batch_tokens=0 \
        --variant on:actor.share_prompt=true --repeats 2 rollout.max_new_tokens=128
    tlt bench update --recipe real-cpu --variant fp32:actor.precision=fp32 --variant bf16:actor.precision=bf16
    tlt bench update --recipe tiny-cpu --profile        # the update by operator category and its roofline by phase
    tlt bench update --recipe tiny-cpu --steps 30 speculative.mode=off   # a worker's peaks, step after step

A variant is a name and the overrides it adds to the recipe (NAME:key=value,key=value, after the shared overrides; no
--variant: the recipe as it is, named 'recipe'), so a lever is measured on and off in one run whatever keys it has.
Every repeat runs each variant once, the order alternating (A B, B A, ...) so a machine's load drifts over all alike,
each as its own process (update_worker.py: one rank, one worker's actor and its batch: every response max_new_tokens
long, the worst case, or --response-tokens long on average, long-tailed). Per variant, the best of its repeats: the
update's seconds beside its response tokens, seconds per 1,000 response tokens, the share of torch's product rate it
reached (the roofline, update_roofline.py: the update's matrix products at its own shapes timed in its dtype, against
its CPU seconds), the worker's peak memory in the update (the highest of the repeats) against tlt's estimate, and each
later variant's speed against the first. The CPU (its model name and bfloat16/AMX flags) and the load average are
named; the JSON holds every repeat.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from tlt_cli.bench.common import (
    BenchError,
    BenchReport,
    Progress,
    bench_recipe,
    check_out,
    named_variants,
    print_load,
    print_processor,
    render_table,
    say,
    speed_words,
)
from tlt_cli.memory_hygiene import worker_environment

# the variant of a benchmark given none: the recipe as it is
RECIPE_VARIANT = "recipe"
# the most rollout-and-update steps a measurement runs (--steps), and the most repeats of each variant (--repeats)
MAX_STEPS = 1000
MAX_REPEATS = 100
GIGA = 1e9


class MeasurementFailed(RuntimeError):
    """A measurement's process failed (each variant's recipe was checked before any ran)."""


@dataclass(frozen=True)
class UpdateSettings:
    """What `tlt bench update` measures: variants ('NAME:key=value,...'), repeats, whether the update is profiled,
    and the rollout-and-update steps after it (0: none)."""

    variants: tuple[str, ...] = ()
    repeats: int = 2
    profile: bool = False
    steps: int = 0
    # mean response length of the measured batch (update_worker.py `measured_batch`); 0: the worst case
    response_tokens: int = 0


def parse_variants(texts: tuple[str, ...], overrides: list[str]) -> dict[str, list[str]]:
    """'NAME:key=value,key=value' -> name -> the shared overrides then the variant's (common.named_variants)."""
    if not texts:
        return {RECIPE_VARIANT: list(overrides)}
    return {name: [*overrides, *own] for name, own in named_variants(texts).items()}


def check_settings(settings: UpdateSettings, out: Path) -> None:
    """Refuse, before anything is measured, options out of range and an --out that cannot be written."""
    if not 1 <= settings.repeats <= MAX_REPEATS:
        raise BenchError(f"--repeats is {settings.repeats}; give 1..{MAX_REPEATS} repeats of each variant.")
    if not 0 <= settings.steps <= MAX_STEPS:
        raise BenchError(f"--steps is {settings.steps}; give 0..{MAX_STEPS} rollout-and-update steps.")
    if settings.response_tokens < 0:
        raise BenchError(
            f"--response-tokens is {settings.response_tokens}; give a mean length, or 0 for the worst case."
        )
    check_out(out)


def schedule(variants: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, variant) in the order they run: every variant once a repeat, the order reversed every other one."""
    return [(repeat, name) for repeat in range(repeats) for name in (variants if repeat % 2 == 0 else variants[::-1])]


def measure_in_fresh_process(recipe_name: str, overrides: list[str], settings: UpdateSettings) -> dict:
    """One measurement (update_worker.py) in its own process; its JSON result."""
    request = {
        "recipe": recipe_name,
        "overrides": overrides,
        "profile": settings.profile,
        "steps": settings.steps,
        "response_tokens": settings.response_tokens,
        # the measuring process exits with this one (killed or stopped), as tlt train's workers do
        "parent": os.getpid(),
    }
    command = [sys.executable, "-m", "tlt_cli.bench.update_worker", json.dumps(request)]
    # with the kernel caches bounded as in tlt train's workers (memory_hygiene.py), so its peaks are theirs
    environment = {**os.environ, **worker_environment()}
    finished = subprocess.run(command, capture_output=True, text=True, check=False, env=environment)
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
        raise MeasurementFailed(f"the update with {' '.join(overrides) or 'the recipe as it is'} failed ({last}).")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def measure_all(
    recipe_name: str, variants: dict[str, list[str]], settings: UpdateSettings, console: Console
) -> list[dict]:
    """Every repeat of every variant, in `schedule`'s order, each announced as it starts and ends."""
    order = schedule(list(variants), settings.repeats)
    progress = Progress(console, len(order))
    runs = []
    for repeat, name in order:
        with progress.measuring(f"{name}, repeat {repeat + 1}"):
            result = measure_in_fresh_process(recipe_name, variants[name], settings)
        runs.append({"variant": name, "repeat": repeat, **result})
    return runs


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant its best repeat's figures and highest peaks; each later variant's speed against the first."""
    best = {}
    for name in variants:
        mine = [run for run in runs if run["variant"] == name]
        fastest = min(mine, key=lambda run: run["update_seconds"])
        tokens = fastest["response_tokens"]
        best[name] = {
            "precision": fastest["precision"],
            "update_seconds": fastest["update_seconds"],
            "update_cpu_seconds": min(run["update_cpu_seconds"] for run in mine),
            "response_tokens": tokens,
            "seconds_per_1000_tokens": 1000 * fastest["update_seconds"] / tokens if tokens else None,
            "product_rate_share": fastest["roofline"]["fraction_of_product_rate"],
            "update_peak_gb": max(run["update_peak_gb"] for run in mine),
            "estimate_gb": fastest["estimate_gb"],
            "step_peak_gb": step_peak(mine),
            "loss": fastest["loss"],
        }
    first = variants[0]
    against = {name: best[first]["update_seconds"] / best[name]["update_seconds"] for name in variants[1:]}
    return {"first": first, "variants": best, "speed_against_first": against}


def step_peak(runs: list[dict]) -> float | None:
    """The highest resident peak of any rollout or update step of `runs` (None: no steps were run)."""
    peaks = [max(step["rollout_peak_gb"], step["update_peak_gb"]) for run in runs for step in run.get("steps", [])]
    return max(peaks) if peaks else None


def render(console: Console, runs: list[dict], summary: dict, settings: UpdateSettings) -> None:
    """The table of variants, the speed lines; the steps' and the profiles' tables when they ran."""
    rows = [
        [
            name,
            figures["precision"],
            f"{figures['update_seconds']:.2f}",
            str(figures["response_tokens"]),
            f"{figures['update_cpu_seconds']:.2f}",
            "-" if figures["seconds_per_1000_tokens"] is None else f"{figures['seconds_per_1000_tokens']:.3f}",
            f"{100 * figures['product_rate_share']:.0f}%",
            f"{figures['update_peak_gb']:.2f} ({figures['estimate_gb']:.2f})",
            "-" if figures["step_peak_gb"] is None else f"{figures['step_peak_gb']:.2f}",
            f"{figures['loss']:.6f}",
        ]
        for name, figures in summary["variants"].items()
    ]
    columns = [
        "variant",
        "precision",
        "update s",
        "tokens",
        "CPU s",
        "s / 1k tokens",
        "of product rate",
        "peak GB (estimate)",
        "step peak GB",
        "loss",
    ]
    batch = "worst-case batch"
    if settings.response_tokens:
        batch = f"response lengths long-tailed around {settings.response_tokens} tokens, each at most max_new_tokens"
    render_table(console, f"one worker's GRPO update, {batch} (GB = 1e9 bytes)", columns, rows)
    for name, ratio in summary["speed_against_first"].items():
        say(console, f"{name} vs {summary['first']}: update {speed_words(ratio)}")
    if any(run.get("steps") for run in runs):
        render_steps(console, runs)
    for run in runs:
        if "profile" in run:
            render_profile(console, run)


def render_steps(console: Console, runs: list[dict]) -> None:
    rows = [
        [
            f"{run['variant']} #{run['repeat'] + 1}",
            str(step["step"]),
            str(step["response_tokens"]),
            str(step["longest_response"]),
            f"{step['update_seconds']:.2f}",
            f"{step['rollout_peak_gb']:.2f}",
            f"{step['update_peak_gb']:.2f}",
            f"{step['resident_after_gb']:.2f}",
        ]
        for run in runs
        for step in run.get("steps", [])
    ]
    columns = ["variant", "step", "tokens", "longest", "update s", "rollout peak GB", "update peak GB", "after GB"]
    render_table(console, "rollout and update, step after step (one rank)", columns, rows)


def render_profile(console: Console, run: dict) -> None:
    """One profiled update: self seconds by operator category, then its roofline by phase (CPU seconds)."""
    profile, where = run["profile"], f"{run['variant']} #{run['repeat'] + 1}"
    total = sum(profile["categories_seconds"].values()) or 1.0
    categories = [
        [name, f"{seconds:.2f}", f"{100 * seconds / total:.1f}"]
        for name, seconds in profile["categories_seconds"].items()
    ]
    render_table(console, f"{where}: the update by operator category, self seconds", ["category", "s", "%"], categories)
    report = profile["roofline"]
    dtypes = list(report["bound_seconds"])
    rows = []
    for phase in report["phases"]:
        fraction = phase["fraction_of_product_rate"]
        rows.append(
            [
                phase["phase"],
                f"{phase['operations'] / GIGA:.2f}",
                f"{phase['seconds']:.2f}",
                f"{phase['achieved_rate'] / GIGA:.2f}",
                *(
                    "-" if phase["product_rates"].get(dtype) is None else f"{phase['product_rates'][dtype] / GIGA:.2f}"
                    for dtype in dtypes
                ),
                "-" if fraction is None else f"{100 * fraction:.0f}%",
            ]
        )
    columns = [
        "phase",
        "GFLOP",
        "CPU s",
        "achieved GFLOP/s",
        *(f"products {dtype} GFLOP/s" for dtype in dtypes),
        f"of {report['compute_dtype']} products",
    ]
    render_table(console, f"{where}: the update's roofline by phase, GFLOP/s a CPU second", columns, rows)


def run_update_bench(
    recipe_name: str, overrides: list[str], settings: UpdateSettings, out: Path, console: Console
) -> dict:
    """`tlt bench update`: check every variant, measure each repeat in a fresh process, print, write the JSON."""
    check_settings(settings, out)
    variants = parse_variants(settings.variants, overrides)
    for variant_overrides in variants.values():  # a variant tlt train would refuse is refused before any runs
        bench_recipe(recipe_name, variant_overrides)
    report = BenchReport.start("tlt bench update", recipe_name, overrides, settings, [], settings.repeats)
    print_processor(console, report.machine)
    print_load(console, report.machine["usable_cores"])
    runs = measure_all(recipe_name, variants, settings, console)
    summary = summarize(runs, list(variants))
    render(console, runs, summary, settings)
    written = report.write(out, {"variants": variants, "runs": runs}, summary)
    print_load(console, report.machine["usable_cores"])
    say(console, f"wrote {out}")
    return written
