"""Collapse auto-off: a drafter corrupted mid-run, and how fast the adaptive engine stops using it.

    python scripts/bench_collapse.py --steps 20 --out benchmarks/bench_collapse.json

Runs the tiny recipe three times with the same seed, back to back:
  off       speculative.mode=off
  adaptive  speculative.mode=adaptive (the recipe's rule table), drafter intact
  fault     adaptive, and at the start of step 10 every worker's drafter is overwritten with noise
            (scripts/drafter_faults.py, as after a broken weight sync); no sidecar, so nothing repairs it
and prints per step the step time of each, the accept length and SD decode steps of `fault`, the
collapse warnings it wrote, and after the fault: the mean step time relative to SD off, the
rollout seconds per token of each step's longest response relative to SD off (each run samples
its own responses, so raw step times mostly compare the lengths of their longest responses; the
goal is within 5%), and the worker-seconds the fault run still decoded with SD (re-probes). Writes JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

from drafter_faults import FAULT_STEP
from rich.console import Console
from rich.table import Table
from training_runs import benchmark_parser, mean, run_variants, step_rows

SCRIPTS = Path(__file__).resolve().parent
VARIANTS = {
    "off": ["speculative.mode=off", "plugins.enabled=[]"],
    "adaptive": ["speculative.mode=adaptive", "plugins.enabled=[]"],
    "fault": ["speculative.mode=adaptive", "plugins.enabled=[drafter_faults:CorruptDrafter]"],
}


def sd_decode_steps(records: list[dict], step: int) -> int:
    """Decode steps the run spent in an SD configuration during `step`, over all workers."""
    return sum(
        record["decode_steps"]
        for record in records
        if record["type"] == "sd_config" and record["step"] == step and record["config"] != "off"
    )


def summarize(results: dict[str, list[dict]]) -> dict:
    steps = {name: step_rows(records) for name, records in results.items()}
    after = slice(FAULT_STEP + 1, None)  # the fault step itself holds the detection
    seconds_after = {name: mean([row["step_seconds"] for row in rows[after]]) for name, rows in steps.items()}
    # each run samples its own responses, so one step's rollout time mostly says how long its longest
    # response was: rollout seconds per token of the longest response compares decoding speed itself
    per_tail_token = {
        name: mean([row["rollout_seconds"] / row["response_length_max"] for row in rows[after]])
        for name, rows in steps.items()
    }
    return {
        "fault_step": FAULT_STEP,
        "step_seconds_after_fault": seconds_after,
        "rollout_seconds_per_tail_token_after_fault": per_tail_token,
        "fault_over_off_per_tail_token": per_tail_token["fault"] / per_tail_token["off"],
        "adaptive_over_off_per_tail_token": per_tail_token["adaptive"] / per_tail_token["off"],
        "sd_seconds_per_step_after_fault": mean([row["sd_on_seconds"] for row in steps["fault"][after]]),
        "sd_seconds_per_step_before_fault": mean([row["sd_on_seconds"] for row in steps["fault"][:FAULT_STEP]]),
        "fault_over_off_after_fault": seconds_after["fault"] / seconds_after["off"],
        "adaptive_over_off_after_fault": seconds_after["adaptive"] / seconds_after["off"],
        "sd_decode_steps_in_fault_step": sd_decode_steps(results["fault"], FAULT_STEP),
        "sd_decode_steps_per_step_after_fault": mean(
            [sd_decode_steps(results["fault"], row["step"]) for row in steps["fault"][after]]
        ),
        "warnings": [record for record in results["fault"] if record["type"] == "warning"],
    }


def render(results: dict[str, list[dict]], summary: dict) -> None:
    console = Console()
    table = Table(title=f"step time (s) with a drafter corrupted at step {FAULT_STEP}")
    for column in ("step", "off", "adaptive", "fault", "fault accept len", "fault SD decode steps"):
        table.add_column(column, justify="right")
    steps = {name: step_rows(records) for name, records in results.items()}
    for off, adaptive, fault in zip(steps["off"], steps["adaptive"], steps["fault"]):
        accept = "-" if fault["accept_length"] is None else f"{fault['accept_length']:.2f}"
        table.add_row(
            str(off["step"]),
            f"{off['step_seconds']:.2f}",
            f"{adaptive['step_seconds']:.2f}",
            f"{fault['step_seconds']:.2f}",
            accept,
            str(sd_decode_steps(results["fault"], fault["step"])),
        )
    console.print(table)
    for warning in summary["warnings"]:
        console.print(f"warning at step {warning['step']} (worker {warning['worker']}): {warning['message']}")
    console.print({key: value for key, value in summary.items() if key != "warnings"})


def main() -> None:
    parser = benchmark_parser(__doc__.splitlines()[0], "bench-collapse")
    arguments = parser.parse_args()
    if arguments.steps <= FAULT_STEP + 2:
        parser.error(f"--steps must exceed {FAULT_STEP + 2}: the fault hits step {FAULT_STEP}.")
    results = run_variants(VARIANTS, arguments.overrides, arguments.steps, arguments.output_dir, SCRIPTS)
    summary = summarize(results)
    render(results, summary)
    arguments.out.write_text(json.dumps({"summary": summary, "records": results}, indent=1))


if __name__ == "__main__":
    main()
