"""`tlt bench runs`: end-to-end `tlt train` runs of a recipe, variants x seeds, side by side.

    tlt bench runs --recipe recipes/tiny-cpu.yaml --variants off,tlt --seeds 0,1,2 --steps 60
    tlt bench runs --recipe recipes/trl-real-cpu.yaml --variants trl,tlt --steps 6 --skip 1
    tlt bench runs ... --variant-override tlt:rollout.dtype=bfloat16     # overrides of one variant only
    tlt bench runs ... --from-runs                                        # summarize the runs left, train none
    tlt bench runs --recipe real-cpu --variants "" --fidelity --steps 3 \
        --variant fp32:rollout.dtype=float32,actor.precision=fp32 \
        --variant bf16-nearest:rollout.dtype=bfloat16,actor.bfloat16_rounding=nearest   # step by step: the learner?

Every variant (VARIANTS: a name and the overrides it adds to the recipe) of every seed trains `--steps` steps in
turn, never two at once, as `python -m tlt_cli train` in a fresh run folder under --output-dir. From each run's
trace it reads every step: step, rollout and update seconds, response tokens, the median response length, the
mean reward, the rollout/learner mismatch `actor_rollout_kl_k3` and a bfloat16 learner's drift from its float32
weights `actor_precision_kl_k3`. Per variant and seed it prints their means
over the steps after the first --skip (rewards over all steps); against the first variant listed (the
baseline): the rollout and step ratios, the Amdahl bound 1 / ((1 - r) + r / s) (r: the baseline's rollout share
of a step, s: the rollout ratio) and the gap between mean rewards beside the seed-to-seed standard deviation.

--variant NAME:key=value,key=value adds a variant of its own after the --variants named. --fidelity asks whether
the rollout samples the policy being trained: its own variants start with speculation and plugins off (SD_OFF,
unless their overrides say otherwise), and it adds a table of every run's steps (response tokens, median length,
reward, the rollout/learner K3 KL, a bfloat16 learner's K3 KL from its float32 weights, step seconds) and the
fidelity guard's warnings each run's trace holds.
"""

from __future__ import annotations

import math
import shutil
import statistics
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
    named_variants,
    print_load,
    render_table,
    say,
    speed_words,
)
from tlt_cli.config import MAX_SEED
from tlt_cli.display import keeps_one_line
from tlt_cli.processes.run_directory import TRACE_FILE
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.sd_effect import sd_effect_sentence, trace_sd_effect
from tlt_cli.trace import numbered_records

SD_OFF = ("speculative.mode=off", "plugins.enabled=[]")
# variant -> the overrides it adds to the recipe (before --variant-override and the shared overrides)
VARIANTS: dict[str, tuple[str, ...]] = {
    "off": SD_OFF,  # plain decoding, no drafter trained
    "tlt": (),  # the recipe as it is
    "auto": ("speculative.mode=auto",),
    "adaptive": ("speculative.mode=adaptive", "plugins.enabled=[drafter_sidecar]"),
    "trl": ("rollout.backend=trl", *SD_OFF),  # TRL's own generation (a train.trainer trl recipe)
    "embedded": ("rollout.backend=embedded", *SD_OFF),  # tlt's engine, SD off (under TRL: its fidelity)
}
# the file each run folder this command made holds: the folders it may replace
BENCH_MARKER = ".tlt-bench-run"
# the step record's figures a run is judged on, each a mean over the timed steps
FIGURES = (
    "step_seconds",
    "rollout_seconds",
    "update_seconds",
    "response_tokens",
    "response_length_p50",
    "mean_reward",
    "actor_rollout_kl_k3",
    "actor_precision_kl_k3",
)

# the step record's figures `--fidelity` shows step by step
FIDELITY_FIGURES = (
    "response_tokens",
    "response_length_p50",
    "mean_reward",
    "actor_rollout_kl_k3",
    "actor_precision_kl_k3",
    "step_seconds",
)
# the figures that count tokens: printed as whole numbers (their means over steps are not)
COUNT_FIGURES = ("response_tokens", "response_length_p50")
# per_step's figures printed after the rate and its ratio, in the table's order
PER_STEP_FIGURES = ("drafter_accept_length", "drafter_seconds", "response_tokens", "mean_reward", "actor_rollout_kl_k3")


class TrainingRunFailed(RuntimeError):
    """A `tlt train` run of the benchmark failed (each variant's recipe was checked before any run)."""


@dataclass(frozen=True)
class RunsSettings:
    """What `tlt bench runs` trains: variants (the first is the baseline), seeds, steps, steps left out of the
    time means, overrides of single variants ('variant:key=value'), where the runs go, and whether to train."""

    variants: str = "off,tlt"
    seeds: str = "0"
    steps: int = 20
    skip: int = 0
    variant_overrides: tuple[str, ...] = ()
    output_dir: Path = Path("runs/bench-runs")
    from_runs: bool = False
    own_variants: tuple[str, ...] = ()
    fidelity: bool = False


@dataclass(frozen=True)
class RunTraces:
    """Every run's trace, each read once (`trace_records`): `steps`, variant -> seed -> its step records (the
    tables and comparisons); `records`, run name -> every record of its trace (the run's own SD verdict, the
    fidelity guard's warnings)."""

    steps: dict[str, dict[int, list[dict]]]
    records: dict[str, list[dict]]


@dataclass(frozen=True)
class RunsPlan:
    """The settings parsed: variant -> its overrides (VARIANTS', the shared ones, then its own --variant-override:
    the last of a key wins), and the seeds."""

    variants: dict[str, list[str]]
    seeds: list[int]


def runs_plan(settings: RunsSettings, overrides: list[str]) -> RunsPlan:
    """The settings parsed and checked (a BenchError naming the option), before anything trains."""
    names = [name.strip() for name in settings.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    own = named_variants(settings.own_variants)
    if not (names or own) or unknown or set(names) & set(own):
        raise BenchError(
            f"--variants names '{settings.variants}'; use some of {', '.join(VARIANTS)} (or --variant NAME:...), "
            "each name once."
        )
    if settings.steps < 1 or not 0 <= settings.skip < settings.steps:
        raise BenchError(f"--steps {settings.steps} --skip {settings.skip}: train 1 step or more, skip fewer.")
    variants = {name: [*VARIANTS[name], *overrides] for name in names}
    start = SD_OFF if settings.fidelity else ()
    variants |= {name: [*start, *overrides, *mine] for name, mine in own.items()}
    for text in settings.variant_overrides:
        name, _, override = text.partition(":")
        if name not in variants or "=" not in override:
            raise BenchError(f"--variant-override is '{text}'; give VARIANT:key=value for one of {', '.join(names)}.")
        variants[name].append(override)
    return RunsPlan(variants, parse_seeds(settings.seeds))


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]: run.seed values (0..MAX_SEED), or a BenchError naming the option, before any run."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    seeds = [int(part) for part in parts if part.isascii() and part.isdigit()]
    if not seeds or len(seeds) != len(parts) or max(seeds) > MAX_SEED:
        raise BenchError(f"--seeds is '{text}'; give integers in 0..{MAX_SEED} separated by commas, e.g. 0,1,2.")
    return seeds


def run_name(variant: str, seed: int) -> str:
    """The run folder of one variant and seed under --output-dir."""
    return f"{variant}-seed{seed}"


def check_output_folders(plan: RunsPlan, output: Path) -> None:
    """Refuse, before anything trains, a run folder under --output-dir that this command did not make (no
    BENCH_MARKER in it): training replaces its runs' folders, and never a user's."""
    for seed in plan.seeds:
        for name in plan.variants:
            folder = output / run_name(name, seed)
            if (folder.exists() or folder.is_symlink()) and not (folder / BENCH_MARKER).is_file():
                raise BenchError(
                    f"--output-dir {output} holds {folder.name}, which tlt bench runs did not make; move it or give "
                    "another --output-dir."
                )


def train(recipe_path: Path, name: str, overrides: list[str], steps: int, output: Path) -> None:
    """`tlt train` of `recipe_path` for `steps` steps into output/name (a fresh folder), quietly; the folder gets
    BENCH_MARKER once made, so a later call replaces it (check_output_folders refused any other)."""
    shutil.rmtree(output / name, ignore_errors=True)  # this benchmark's own run from an earlier call
    command = [
        sys.executable,
        "-m",
        "tlt_cli",
        "train",
        str(recipe_path),
        *overrides,
        f"train.steps={steps}",
        f"run.name={name}",
        f"run.output_dir={output}",
        f"checkpoint.every={steps}",
    ]
    finished = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if (output / name).is_dir():
        (output / name / BENCH_MARKER).write_text("made by tlt bench runs: a later call replaces this folder\n")
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
        raise TrainingRunFailed(f"tlt train of {name} failed ({last}); run it alone with: {' '.join(command)}")


def trace_records(run_directory: Path) -> list[dict]:
    """Every record of a run's trace, read by the trace reader `tlt profile` uses (tlt_cli/trace.py); a BenchError
    naming the run when it left no trace or a damaged one."""
    trace = run_directory / TRACE_FILE
    if not trace.is_file():
        raise BenchError(
            f"no {TRACE_FILE} in {run_directory}: give the --output-dir, --variants and --seeds of the runs."
        )
    records = []
    for number, record in numbered_records(trace, BenchError):
        if not isinstance(record.get("type"), str):
            raise BenchError(f"{trace} line {number} has no 'type'; a tlt trace has a type on every line.")
        records.append(record)
    return records


def step_records(run_directory: Path, records: list[dict]) -> list[dict]:
    """The step records of a complete run from its trace's `records` (`trace_records`); a BenchError naming the
    run when it has fewer steps than it was to train."""
    trace = run_directory / TRACE_FILE
    planned = [record.get("steps") for record in records if record["type"] == "run"]
    steps = [record for record in records if record["type"] == "step"]
    if not planned or not isinstance(planned[-1], int) or isinstance(planned[-1], bool):
        raise BenchError(f"{trace} has no run record with its steps; it is not a complete tlt trace.")
    numbered = {record["step"] for record in steps if type(record.get("step")) is int}
    if len(steps) != planned[-1] or numbered != set(range(planned[-1])):
        raise BenchError(
            f"{run_directory} is incomplete: its trace has {len(steps)} of its {planned[-1]} steps (the run was "
            "stopped or failed); train it again without --from-runs."
        )
    for record in steps:
        check_figures(record, f"{trace} step {record['step']}")
    return steps


def check_figures(record: dict, where: str) -> None:
    """A step record's FIGURES are finite numbers (or absent), its step and rollout seconds above 0 (they divide)."""
    for figure in FIGURES:
        value = record.get(figure)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not number or (figure in ("step_seconds", "rollout_seconds") and value <= 0):
            raise BenchError(f"{where}: '{figure}' is {value!r}; the run's trace is damaged.")


def run_all(recipe_path: Path, plan: RunsPlan, settings: RunsSettings, console: Console) -> RunTraces:
    """Every run's trace and its step records: trained in turn now, or read from the runs an earlier call left."""
    traces = RunTraces({name: {} for name in plan.variants}, {})
    if not settings.from_runs:
        check_output_folders(plan, settings.output_dir)
    progress = Progress(console, len(plan.seeds) * len(plan.variants))
    for seed in plan.seeds:
        for name, variant in plan.variants.items():
            folder = run_name(name, seed)
            if not settings.from_runs:
                training = f"training {folder} ({settings.steps} steps)"
                with console.status(training), progress.measuring(training):
                    train(
                        recipe_path,
                        folder,
                        [*variant, f"run.seed={seed}"],
                        settings.steps,
                        settings.output_dir,
                    )
            records = trace_records(settings.output_dir / folder)
            traces.steps[name][seed] = step_records(settings.output_dir / folder, records)
            traces.records[folder] = records
    return traces


def fidelity_warnings(records: list[dict]) -> list[str]:
    """The fidelity guard's warnings in a run's trace `records` (records of kind 'fidelity'), in order."""
    return [str(record.get("message")) for record in records if record.get("kind") == "fidelity"]


def render_fidelity(console: Console, steps: dict[str, dict[int, list[dict]]], warnings: dict[str, list[str]]) -> None:
    """Every run's steps: response tokens, median length, reward, both K3 KLs, step seconds; then the guard's
    warnings by run."""
    rows = [
        [
            run_name(name, seed),
            str(record["step"]),
            *(_figure(record.get(figure), figure) for figure in FIDELITY_FIGURES),
        ]
        for name, by_seed in steps.items()
        for seed, records in by_seed.items()
        for record in records
    ]
    columns = ["run", "step", "tokens", "median length", "reward", "rollout KL k3", "bf16 KL k3", "step s"]
    render_table(console, "fidelity: does the rollout sample the policy being trained? (per step)", columns, rows)
    for run, lines in warnings.items():
        for line in lines:
            say(console, f"{run}: {line}")


def mean(values: list[float]) -> float | None:
    """The mean of the values that are there (None: no value, e.g. no KL logged)."""
    present = [value for value in values if value is not None]
    return statistics.fmean(present) if present else None


def amdahl_bound(rollout_share: float, rollout_ratio: float) -> float:
    """The most a step can speed up when only its rollout, `rollout_share` of the step, runs `rollout_ratio` times
    faster: 1 / ((1 - r) + r / s)."""
    return 1.0 / ((1.0 - rollout_share) + rollout_share / rollout_ratio)


def side_by_side(baseline: dict, candidate: dict) -> dict:
    """Speed of `candidate` against `baseline`, each given by its mean rollout_seconds and step_seconds: the rollout
    and step ratios (baseline / candidate), the baseline's rollout share of a step, the Amdahl bound those allow and
    the step ratio as a fraction of that bound."""
    rollout_ratio = baseline["rollout_seconds"] / candidate["rollout_seconds"]
    step_ratio = baseline["step_seconds"] / candidate["step_seconds"]
    rollout_share = baseline["rollout_seconds"] / baseline["step_seconds"]
    bound = amdahl_bound(rollout_share, rollout_ratio)
    return {
        "rollout_ratio": rollout_ratio,
        "step_ratio": step_ratio,
        "baseline_rollout_share": rollout_share,
        "amdahl_bound": bound,
        "step_ratio_of_bound": step_ratio / bound,
    }


def reward_gap(per_seed_rewards: dict[str, list[float]], baseline: str, candidate: str) -> dict:
    """Mean rewards per seed of two variants compared as distributions: the gap candidate - baseline of their means
    and the seed-to-seed standard deviation of the per-seed means (the noise a gap must stay within; None with one
    seed: there is no noise estimate)."""
    pooled = per_seed_rewards[baseline] + per_seed_rewards[candidate]
    return {
        "gap": statistics.fmean(per_seed_rewards[candidate]) - statistics.fmean(per_seed_rewards[baseline]),
        "seed_std": statistics.stdev(pooled) if len(per_seed_rewards[baseline]) > 1 else None,
    }


def paired_spread(baseline: dict[int, list[dict]], candidate: dict[int, list[dict]], skip: int) -> dict:
    """The spread of the comparison over the timed steps (after `skip`) of each seed, step s of the candidate
    against step s of the baseline with the same seed: the lowest and highest rollout ratio (response tokens per
    second) and step ratio (step seconds per response token), and how many such pairs there were (none where a
    record has no token count)."""
    rollout, step = [], []
    for seed, records in candidate.items():
        for base, cand in list(zip(baseline.get(seed, []), records))[skip:]:
            if not (base.get("response_tokens") and cand.get("response_tokens")):
                continue
            rollout.append(
                (cand["response_tokens"] / cand["rollout_seconds"])
                / (base["response_tokens"] / base["rollout_seconds"])
            )
            step.append(
                (base["step_seconds"] / base["response_tokens"]) / (cand["step_seconds"] / cand["response_tokens"])
            )
    if not rollout:
        return {"paired_steps": 0}
    return {
        "paired_steps": len(rollout),
        "rollout_ratio_range": [min(rollout), max(rollout)],
        "step_ratio_range": [min(step), max(step)],
    }


def summarize(steps: dict[str, dict[int, list[dict]]], skip: int) -> dict:
    """Per variant and seed the FIGURES' means (times over the steps after `skip`, the rest over all); per variant
    pooled over seeds; each later variant against the first."""
    per_run = {
        name: {seed: _run_means(records, skip) for seed, records in by_seed.items()} for name, by_seed in steps.items()
    }
    pooled = {
        name: {figure: mean([means[figure] for means in by_seed.values()]) for figure in FIGURES}
        for name, by_seed in per_run.items()
    }
    rewards = {name: [means["mean_reward"] for means in by_seed.values()] for name, by_seed in per_run.items()}
    baseline, *candidates = list(steps)
    comparisons = {
        name: {
            **side_by_side(pooled[baseline], pooled[name]),
            **paired_spread(steps[baseline], steps[name], skip),
            **reward_gap(rewards, baseline, name),
        }
        for name in candidates
    }
    return {
        "baseline": baseline,
        "per_run": per_run,
        "pooled": pooled,
        "against_baseline": comparisons,
        "per_step": per_step(steps),
    }


def per_step(steps: dict[str, dict[int, list[dict]]]) -> dict[str, list[dict]]:
    """Per variant, step by step over the seeds: rollout tokens per second (tokens over seconds, pooled) and its
    ratio to the baseline's at that step, the drafter's accept length, its training seconds (idle and in the
    update), response tokens, reward and rollout KL (means over seeds)."""
    baseline = next(iter(steps))
    rates = {name: _step_rates(by_seed) for name, by_seed in steps.items()}
    table = {}
    for name, by_seed in steps.items():
        rows = []
        for step, records in enumerate(zip(*by_seed.values())):
            rows.append(
                {
                    "step": step,
                    "tokens_per_second": rates[name][step],
                    "vs_baseline": _ratio(rates[name][step], rates[baseline][step]),
                    "drafter_accept_length": mean([record.get("drafter_accept_length") for record in records]),
                    "drafter_seconds": mean([_drafter_seconds(record) for record in records]),
                    "response_tokens": mean([record.get("response_tokens") for record in records]),
                    "mean_reward": mean([record.get("mean_reward") for record in records]),
                    "actor_rollout_kl_k3": mean([record.get("actor_rollout_kl_k3") for record in records]),
                }
            )
        table[name] = rows
    return table


def _step_rates(by_seed: dict[int, list[dict]]) -> list[float | None]:
    """Rollout response tokens per second at each step, pooled over the seeds (tokens over seconds); None where a
    record has no token count (a trace from before tlt counted them)."""
    rates = []
    for records in zip(*by_seed.values()):
        tokens = [record.get("response_tokens") for record in records]
        seconds = sum(record["rollout_seconds"] for record in records)
        rates.append(None if None in tokens else sum(tokens) / seconds)
    return rates


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return None if value is None or baseline is None else value / baseline


def _drafter_seconds(record: dict) -> float | None:
    """Seconds the workers spent training the drafter in a step (idle and in the update), None without a sidecar."""
    parts = [record.get("drafter_train_seconds"), record.get("drafter_update_seconds")]
    return sum(part for part in parts if part is not None) if any(part is not None for part in parts) else None


def _run_means(records: list[dict], skip: int) -> dict:
    timed = records[skip:]
    return {
        figure: mean([record.get(figure) for record in (timed if figure.endswith("_seconds") else records)])
        for figure in FIGURES
    }


def own_verdicts(plan: RunsPlan, records: dict[str, list[dict]], summary: dict) -> dict[str, dict]:
    """Run name -> what each later variant's run says of SD by its own measure (tlt_cli/sd_effect.py, the sentence
    its summary printed) and whether that agrees in direction with the A/B: SD's decode against all of it plain,
    beside the variant's rollout ratio to the baseline, from each run's trace `records` (run name -> its
    records). Runs that did not speculate are left out."""
    verdicts = {}
    for name, figures in summary["against_baseline"].items():
        for seed in plan.seeds:
            effect = trace_sd_effect(records[run_name(name, seed)])
            if effect is None:
                continue
            verdicts[run_name(name, seed)] = {
                "sentence": sd_effect_sentence(effect),
                "decode_speedup": effect.decode_speedup,
                "rollout_ratio": figures["rollout_ratio"],
                "agrees": (effect.decode_speedup >= 1.0) == (figures["rollout_ratio"] >= 1.0),
            }
    return verdicts


def verdict_line(run: str, baseline: str, verdict: dict) -> str:
    """A run's own verdict beside the A/B's rollout ratio, and whether the two point the same way."""
    agreement = "agrees with" if verdict["agrees"] else "does NOT agree with"
    return (
        f"{run} by its own measure: {verdict['sentence']} Its whole decode at {verdict['decode_speedup']:.2f}x "
        f"{agreement} the rollout against {baseline} ({verdict['rollout_ratio']:.2f}x)."
    )


def render(console: Console, summary: dict) -> None:
    """One row per run, a column per figure; then a line per variant against the baseline."""
    rows = [
        [run_name(name, seed), *(_figure(means[figure], figure) for figure in FIGURES)]
        for name, by_seed in summary["per_run"].items()
        for seed, means in by_seed.items()
    ]
    columns = [
        "run",
        "step s",
        "rollout s",
        "update s",
        "response tokens",
        "median length",
        "reward",
        "rollout KL k3",
        "bf16 KL k3",
    ]
    render_table(console, "end-to-end runs (means per step; times after the skipped steps)", columns, rows)
    step_columns = ["variant", "step", "tokens/s", "vs first", "drafter accept", "drafter s", "tokens", "reward", "KL"]
    step_rows = [
        [
            name,
            str(row["step"]),
            "-" if row["tokens_per_second"] is None else f"{row['tokens_per_second']:.1f}",
            "-" if row["vs_baseline"] is None else f"{row['vs_baseline']:.2f}x",
            *(_figure(row[figure], figure) for figure in PER_STEP_FIGURES),
        ]
        for name, rows_of_variant in summary["per_step"].items()
        for row in rows_of_variant
    ]
    render_table(console, "rollout by step (over the seeds)", step_columns, step_rows)
    baseline = summary["baseline"]
    for name, figures in summary["against_baseline"].items():
        console.print(comparison_line(name, baseline, figures), highlight=False, soft_wrap=keeps_one_line(console))


def comparison_line(name: str, baseline: str, figures: dict) -> str:
    """One variant against the baseline in words: speeds as 'faster' or 'slower', the Amdahl bound only where the
    rollout got faster, and the reward gap beside the seed-to-seed noise (or 'one seed: no noise estimate')."""
    rollout, step = speed_words(figures["rollout_ratio"]), speed_words(figures["step_ratio"])
    speeds = f"{name} vs {baseline}: rollout {rollout}, step {step}{spread_words(figures)}"
    share = f"{baseline}'s rollout is {figures['baseline_rollout_share']:.0%} of its step"
    if figures["rollout_ratio"] <= 1.0:
        bound = f"; {share}, and SD did not speed it up, so there is no speed-up to bound"
    elif figures["step_ratio"] <= 1.0:
        bound = f"; {share}, so the Amdahl bound is {figures['amdahl_bound']:.2f}x, but the step got slower instead"
    else:
        bound = (
            f"; {share}, so the Amdahl bound is {figures['amdahl_bound']:.2f}x and the step got "
            f"{figures['step_ratio_of_bound']:.0%} of it"
        )
    noise = (
        "one seed: no noise estimate"
        if figures["seed_std"] is None
        else f"against a seed-to-seed std of {figures['seed_std']:.3f}"
    )
    return f"{speeds}{bound}; reward gap {figures['gap']:+.3f} ({noise})"


def spread_words(figures: dict) -> str:
    """The comparison's spread over its paired steps in words ('' where there were none to pair)."""
    pairs = figures.get("paired_steps", 0)
    if not pairs:
        return ""
    (rollout_low, rollout_high), (step_low, step_high) = figures["rollout_ratio_range"], figures["step_ratio_range"]
    sample = "one step: one sample, no spread" if pairs == 1 else f"over {pairs} steps x seeds"
    return (
        f" (step by step: rollout {rollout_low:.2f}x-{rollout_high:.2f}x, step {step_low:.2f}x-{step_high:.2f}x "
        f"the baseline's speed; {sample})"
    )


def _figure(value: float | None, figure: str) -> str:
    if value is None:
        return "-"
    if figure in COUNT_FIGURES:
        return f"{value:.0f}"
    return f"{value:.2e}" if 0 < abs(value) < 1e-2 else f"{value:.3f}"


def run_runs_bench(recipe_name: str, overrides: list[str], settings: RunsSettings, out: Path, console: Console) -> dict:
    """`tlt bench runs`: train (or read) every run, print the table and the comparisons, write the JSON."""
    plan = runs_plan(settings, overrides)
    for variant in plan.variants.values():  # a variant's recipe tlt train would refuse is refused before any run
        bench_recipe(recipe_name, variant)
    report = BenchReport.start("tlt bench runs", recipe_name, overrides, settings, plan.seeds, 1)
    if not settings.from_runs:  # the load while training; runs read back were timed under another
        print_load(console, report.machine["usable_cores"])
    traces = run_all(resolve_recipe_path(recipe_name), plan, settings, console)
    summary = summarize(traces.steps, settings.skip)
    render(console, summary)
    summary["own_verdicts"] = own_verdicts(plan, traces.records, summary)
    for run, verdict in summary["own_verdicts"].items():
        console.print(
            verdict_line(run, summary["baseline"], verdict), highlight=False, soft_wrap=keeps_one_line(console)
        )
    results = {"variants": plan.variants, "steps": traces.steps}
    if settings.fidelity:
        results["fidelity_warnings"] = {
            run_name(name, seed): fidelity_warnings(traces.records[run_name(name, seed)])
            for seed in plan.seeds
            for name in plan.variants
        }
        render_fidelity(console, traces.steps, results["fidelity_warnings"])
    written = report.write(out, results, summary)
    if not settings.from_runs:
        print_load(console, report.machine["usable_cores"])
    console.print(f"wrote {out}", highlight=False, soft_wrap=True)
    return written
