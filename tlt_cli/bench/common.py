"""What every `tlt bench` subcommand shares: the recipe, the machine, the run's own decode plan, grouped GRPO
requests, the JSON report and the one table renderer.

    recipe = bench_recipe("recipes/real-cpu.yaml", ["rollout.max_new_tokens=256"])
    report = BenchReport.start("tlt bench rollout", "recipes/real-cpu.yaml", overrides, settings, seeds=[0], repeats=2)
    folder = starting_drafter_folder(recipe, console)      # the recipe's drafter.init, said up front
    pair, tokenizer = model_pair(recipe, folder)            # target and starting drafter as `tlt train` loads them
    plan = run_decode_plan(recipe, folder, "bfloat16", 4)   # the plan setup makes for 4 rows (training/setup.py)
    pair = pair_with_plan(pair, plan)                       # decoding in its dtype, linear forms and pass costs
    print_load(console, report.machine["usable_cores"])  # the load average now, and a warning above the cores
    report.write(out, results, summary)            # the machine (load average at start and end) included
    render_table(console, "title", ["column", ...], [["cell", ...], ...])

Every call into the composition root (training/setup.py) a benchmark makes is in this module, so the benchmarks
decode as a run does; the only measurement a benchmark takes itself is its subject (whole rollouts, pass costs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from tlt_cli.atomic_files import write_atomically
from tlt_cli.config import FRESH_DRAFTER_STARTS, DrafterStart, Recipe, RolloutDtype, SpeculativeMode
from tlt_cli.display import keeps_one_line
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.errors import UserError, nearest_existing, writing
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.model_pair import ModelPair
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.plan import SpeculativePlan
from tlt_cli.tasks.base import Task
from tlt_cli.training import setup, step
from tlt_cli.tuning.cache import machine_key
from tlt_cli.tuning.threads import torch_threads

# the CPU flags that decide whether bfloat16 pays (a matrix unit, or AVX-512 bf16 dot products)
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


# a variant's overrides are separated by the commas before a key
OVERRIDE_SEPARATOR = re.compile(r",(?=[A-Za-z_][\w.]*=)")
# the most rows a benchmark decodes at once: a GRPO batch on one machine, far above what a CPU runs in reasonable time
MAX_BENCH_ROWS = 1024


class BenchError(UserError):
    """A benchmark option a user gave that cannot run; the message names the option."""


def check_out(out: Path) -> None:
    """Refuse, before any measurement, an --out the JSON cannot be written to: a folder, a path under a file, or
    one in a folder this user cannot write."""
    if out.is_dir():
        raise BenchError(f"--out {out} is a folder; give the JSON file to write, such as {out / 'bench.json'}.")
    existing = nearest_existing(out.parent)
    if not existing.is_dir():
        raise BenchError(f"--out {out} lies under {existing}, which is a file; give a file in a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BenchError(f"--out {out} cannot be written (no permission in {existing}); give a writable file.")


def bench_recipe(recipe_name: str, overrides: list[str]) -> Recipe:
    """The recipe (a YAML path or a shipped name) with `key=value` overrides, checked as `tlt train` checks it."""
    return load_checked_recipe(resolve_recipe_path(recipe_name), overrides)


def parse_numbers(option: str, text: str, maximum: int) -> list[int]:
    """'1,4,16' -> [1, 4, 16]: integers in 1..maximum, or a BenchError naming the option (before anything loads,
    so an absurd size is one sentence, not an allocation traceback)."""
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) < 1 or max(numbers) > maximum:
        raise BenchError(f"{option} is '{text}'; give integers in 1..{maximum} separated by commas, e.g. 1,4,16.")
    return numbers


def named_variants(texts: tuple[str, ...]) -> dict[str, list[str]]:
    """--variant 'NAME:key=value,key=value' (repeatable) -> name -> its overrides, or a BenchError naming the option;
    the overrides are split at the commas before a key (a value may hold commas: plugins.enabled=[a,b])."""
    variants: dict[str, list[str]] = {}
    for text in texts:
        name, colon, rest = text.partition(":")
        own = [part.strip() for part in OVERRIDE_SEPARATOR.split(rest) if part.strip()]
        keys = [part.partition("=")[0].strip() if "=" in part else "" for part in own]
        if not colon or not name.strip() or name.strip() in variants or not all(keys):
            raise BenchError(
                f"--variant is '{text}'; give a new NAME:key=value,key=value, e.g. on:actor.precision=bf16."
            )
        variants[name.strip()] = own
    return variants


def parse_dtypes(text: str, recipe: Recipe) -> list[str]:
    """'float32,bfloat16' -> the rollout dtypes to measure (empty: the recipe's rollout.dtype)."""
    names = [part.strip() for part in text.split(",") if part.strip()] or [recipe.rollout.dtype.value]
    known = [dtype.value for dtype in RolloutDtype]
    for name in names:
        if name not in known:
            raise BenchError(f"--dtypes names '{name}'; use {', '.join(known)}.")
    return names


def machine_description() -> dict:
    """The machine a benchmark ran on: processor, torch's CPU capability, the bfloat16 flags of /proc/cpuinfo,
    cores, threads, torch and the GPU if any (tuning/cache.py `machine_key`, which keys the measured plans)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    key = machine_key(torch.device("cpu"))
    present = set(key["matrix_flags"])
    return {
        "processor": key["processor"],
        "gpu": machine_key(device)["processor"] if device.type == "cuda" else None,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": {flag: flag in present for flag in BFLOAT16_FLAGS},
        "cores": key["cores"],
        "usable_cores": key["usable_cores"],
        "threads": key["threads"],
        "torch": key["torch"],
    }


@dataclass
class BenchReport:
    """What a benchmark's JSON holds besides its results: the command, recipe, seeds, repeats, the machine (load
    average at the start and the end: a loaded machine's timings say so) and the decode plans it ran with."""

    command: str
    recipe: str
    overrides: list[str]
    settings: dict
    seeds: list[int]
    repeats: int
    machine: dict
    decode_plans: dict[str, dict] = field(default_factory=dict)

    @classmethod
    def start(
        cls, command: str, recipe: str, overrides: list[str], settings: object, seeds: list[int], repeats: int
    ) -> BenchReport:
        """The report of a benchmark starting now; `settings`: its options (a dataclass)."""
        machine = {**machine_description(), "load_average_start": list(os.getloadavg())}
        options = json.loads(json.dumps(dataclasses.asdict(settings), default=str))
        return cls(command, recipe, list(overrides), options, list(seeds), repeats, machine)

    def write(self, out: Path, results: dict, summary: dict) -> dict:
        """Write the JSON to `out` (its folder made); returns what it wrote."""
        report = {
            **dataclasses.asdict(self),
            "machine": {**self.machine, "load_average_end": list(os.getloadavg())},
            "summary": summary,
            "results": results,
        }
        with writing(out, "give --out a writable file."):
            out.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(out, json.dumps(report, indent=1))  # whole or not at all, never through a planted link
        return report


def load_lines(load_average: float, cores: int) -> list[str]:
    """The machine's 1-minute load average against its usable cores; a second line, a warning, when it exceeds
    them (other work then shares the cores, and every timing is slower and noisier than on an idle machine)."""
    lines = [f"load average {load_average:.2f} (1 minute) on {cores} usable cores"]
    if load_average > cores:
        lines.append(
            f"warning: the load average {load_average:.2f} exceeds the {cores} cores: other work shares this machine, "
            "so these timings are slower and noisier than on an idle one"
        )
    return lines


def print_load(console: Console, cores: int) -> None:
    """Print `load_lines` for the load average now."""
    for line in load_lines(os.getloadavg()[0], cores):
        console.print(line, highlight=False, soft_wrap=keeps_one_line(console))


def print_processor(console: Console, machine: dict) -> None:
    """The CPU a benchmark runs on (its model name) and which bfloat16 flags it has (a matrix unit or AVX-512 bf16
    decides whether bfloat16 pays)."""
    flags = [flag for flag, present in machine["cpu_flags"].items() if present]
    say(console, f"CPU: {machine['processor']}; bfloat16 flags: {', '.join(flags) or 'none'}")


class Progress:
    """Lines for a log, where no spinner shows: each measurement as it starts and ends, with an estimate of what is
    left (the mean seconds of those ended, times those left). Silent on a terminal (console.status shows there).

        progress = Progress(console, total=4)
        with progress.measuring("bf16, repeat 1"):
            ...
    """

    def __init__(self, console: Console, total: int):
        self.console = console
        self.total = total
        self.ended = 0
        self.seconds = 0.0

    @contextlib.contextmanager
    def measuring(self, name: str) -> Iterator[None]:
        self._line(f"[{self.ended + 1}/{self.total}] {name}: started{self._left(self.total - self.ended)}")
        started = time.perf_counter()
        yield
        elapsed = time.perf_counter() - started
        self.ended += 1
        self.seconds += elapsed
        self._line(f"[{self.ended}/{self.total}] {name}: ended in {elapsed:.1f} s{self._left(self.total - self.ended)}")

    def _left(self, measurements: int) -> str:
        if measurements == 0:
            return ""
        if self.ended == 0:
            return f"; {measurements} to go, an estimate once the first ends"
        return f"; {measurements} to go, about {self.seconds / self.ended * measurements:.0f} s left"

    def _line(self, line: str) -> None:
        if not self.console.is_terminal:
            say(self.console, line)


def speed_words(ratio: float) -> str:
    """A speed ratio (baseline seconds / candidate seconds) in words: 1.25 -> '1.25x faster', 0.8 -> '1.25x
    slower', so a slowdown reads as one."""
    return f"{ratio:.2f}x faster" if ratio >= 1.0 else f"{1.0 / ratio:.2f}x slower"


def worker_threads(recipe: Recipe) -> contextlib.AbstractContextManager[None]:
    """Inside: torch on a worker's thread count (workers.threads_per_worker), as a run decodes and measures."""
    return torch_threads(recipe.workers.threads_per_worker)


def starting_drafter_folder(recipe: Recipe, console: Console) -> Path | None:
    """The folder of the drafter the recipe starts with (setup.py `prepare_drafter`; None: a fresh start), said up
    front: a benchmark warms up a drafter only when the recipe's drafter.init asks for one, and says so before."""
    init = recipe.drafter.init
    if init in FRESH_DRAFTER_STARTS:
        say(console, f"drafter: a fresh start (drafter.init {init}); no warm-up")
        return None
    if init == DrafterStart.warmup:
        say(console, "drafter: the recipe's warm-up (drafter.init warmup), read from the cache or warmed up now")
    folder, report = setup.prepare_drafter(recipe, setup.model_cache(recipe), needed=True)
    if report is not None:
        seconds = sum(value for name, value in report.items() if name.endswith("_seconds"))
        say(console, f"drafter: warmed up now in {seconds:.0f} s, cached in {folder}")
    else:
        say(console, f"drafter: {folder}")
    return folder


def model_pair(recipe: Recipe, drafter_folder: Path | None) -> tuple[ModelPair, PreTrainedTokenizerBase]:
    """The recipe's target and its starting drafter (from `drafter_folder`), loaded by the one loader `tlt train`'s
    setup has (setup.py `model_pair`), and the tokenizer; each measurement gives it its own plan (pair_with_plan)."""
    with worker_threads(recipe):
        return setup.model_pair(recipe, DecodePlan(), drafter_folder)


def run_decode_plan(recipe: Recipe, drafter_folder: Path | None, dtype: str, rows: int) -> DecodePlan:
    """The decode plan `tlt train` makes for `recipe` decoding in `dtype` with `rows` rows a call (setup.py
    `decode_plan`), its tail weighed as speculating and the pass costs measured (read from the cache after the
    first time)."""
    request = setup.PlanRequest(rows=rows, dtype=RolloutDtype(dtype), speculates=True, costs=True)
    return setup.decode_plan(recipe, drafter_folder, request)


def dtype_label(requested: str, plan: DecodePlan) -> str:
    """The dtype asked for, and what the plan resolved it to when they differ ('auto: bfloat16')."""
    return requested if requested == plan.dtype else f"{requested}: {plan.dtype}"


def pair_with_plan(pair: ModelPair, plan: DecodePlan) -> ModelPair:
    """`pair` decoding as `plan` says: its dtype, linear forms and pass costs."""
    return dataclasses.replace(pair, decode=plan)


def say(console: Console, line: str) -> None:
    """One line of a benchmark's own, printed as it is (no markup, no wrapping: a log keeps it whole)."""
    console.print(line, markup=False, highlight=False, soft_wrap=keeps_one_line(console))


def auto_speculative_plan(recipe: Recipe) -> SpeculativePlan:
    """The recipe's `speculative` section in mode auto (the cost model, no rule table), as setup makes it."""
    return setup.speculative_plan(dataclasses.replace(recipe.speculative, mode=SpeculativeMode.auto, rules=[]))


def task_and_sampling(recipe: Recipe) -> tuple[Task, SamplingParams]:
    """The recipe's task and its rollout sampling settings, as a run makes them."""
    return setup.task(recipe), setup.sampling(recipe)


def bench_requests(
    recipe: Recipe, tokenizer: PreTrainedTokenizerBase, task: Task, rows: int, first_prompt: int
) -> list[RolloutRequest]:
    """A benchmark's `rows` requests of the recipe's task, grouped as a GRPO step groups them (training/step.py
    `grouped_requests`): ceil(rows / group_size) prompts from problem `first_prompt` on, group_size samples each
    (fewer when rows < group_size), the samples of a prompt one group (n-gram drafts read the siblings)."""
    group_size = min(recipe.train.group_size, rows)
    problems = [task.problem(first_prompt + number) for number in range(-(-rows // group_size))]
    return step.grouped_requests(step.encoded_prompts(tokenizer, problems), group_size, rows)


def render_table(console: Console, title: str, columns: list[str], rows: list[list[str]]) -> None:
    """The one table every benchmark prints: the first column names the row, the others are right-aligned."""
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
