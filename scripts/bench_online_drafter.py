"""Does online drafter training pay? Accept length per RL step with a frozen vs an online drafter.

    python scripts/bench_online_drafter.py --steps 20 --out bench-online.json

Runs `tlt train` on the tiny recipe four times with the same seed, one after another:
  plain          SD off, no sidecar (the baseline for step time)
  plain+sidecar  SD off, drafter sidecar on (its critical-path overhead: same rollouts as `plain`)
  frozen       SD on (fixed chain), drafter warmed up offline at step 0, then frozen
  online       SD on (fixed chain), the same warmed-up drafter trained on idle workers (sidecar)
and prints, per step, the accept length of `frozen` and `online`, then a summary: accept length
over the last 5 steps (online / frozen), step-time overhead of the sidecar with SD off, and the
share of idle worker-seconds the sidecar spent training. Writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"
VARIANTS = {
    "plain": ["speculative.mode=off"],
    "plain+sidecar": ["speculative.mode=off", "plugins.enabled=[drafter_sidecar]"],
    "frozen": ["speculative.mode=fixed"],
    "online": ["speculative.mode=fixed", "plugins.enabled=[drafter_sidecar]"],
}


def run_variant(name: str, steps: int, output: Path, extra: list[str]) -> list[dict]:
    run_name = name.replace("+", "-")
    shutil.rmtree(output / run_name, ignore_errors=True)  # this script's own scratch run from an earlier call
    command = [sys.executable, "-m", "tlt_cli", "train", str(RECIPE), f"train.steps={steps}", f"run.name={run_name}",
               f"run.output_dir={output}", f"checkpoint.every={steps}", *VARIANTS[name], *extra]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    lines = (output / run_name / "trace.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["type"] in ("step", "worker")]


def mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)


def summarize(results: dict[str, list[dict]]) -> dict:
    steps = {name: [record for record in records if record["type"] == "step"] for name, records in results.items()}
    last = {name: [record["accept_length"] or 0.0 for record in rows[-5:]] for name, rows in steps.items()}  # SD off: 0
    online_workers = [record for record in results["online"] if record["type"] == "worker"]
    idle_available = sum(record["idle_seconds"] for record in online_workers)
    idle_used = sum(record.get("drafter_train_seconds", 0.0) for record in online_workers)
    return {
        "accept_length_last5_frozen": mean(last["frozen"]),
        "accept_length_last5_online": mean(last["online"]),
        "online_over_frozen": mean(last["online"]) / max(mean(last["frozen"]), 1e-9),
        "step_seconds_plain": mean([row["step_seconds"] for row in steps["plain"]]),
        "step_seconds_plain_sidecar": mean([row["step_seconds"] for row in steps["plain+sidecar"]]),
        "sidecar_overhead": mean([row["step_seconds"] for row in steps["plain+sidecar"]]) / mean([row["step_seconds"] for row in steps["plain"]]) - 1.0,
        "idle_seconds_available": idle_available,
        "idle_seconds_training": idle_used,
        "idle_used_fraction": idle_used / max(idle_available, 1e-9),
    }


def render(results: dict[str, list[dict]], summary: dict) -> None:
    console = Console()
    table = Table(title="accept length per RL step (tokens per verify pass)")
    for column in ("step", "frozen", "online", "online drafter steps", "online drafter loss"):
        table.add_column(column, justify="right")
    frozen = [record for record in results["frozen"] if record["type"] == "step"]
    online = [record for record in results["online"] if record["type"] == "step"]
    for before, after in zip(frozen, online):
        table.add_row(str(before["step"]), f"{before['accept_length'] or 0:.2f}", f"{after['accept_length'] or 0:.2f}",
                      f"{after.get('drafter_steps', 0):.0f}", f"{after.get('drafter_loss', float('nan')):.3f}")
    console.print(table)
    console.print({key: round(value, 4) for key, value in summary.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench-online"))
    parser.add_argument("--out", type=Path, default=Path("bench-online.json"))
    parser.add_argument("overrides", nargs="*", help="extra key=value recipe overrides for every variant")
    arguments = parser.parse_args()
    arguments.output_dir.mkdir(parents=True, exist_ok=True)
    results = {name: run_variant(name, arguments.steps, arguments.output_dir, arguments.overrides) for name in VARIANTS}
    summary = summarize(results)
    render(results, summary)
    arguments.out.write_text(json.dumps({"summary": summary, "records": results}, indent=1))


if __name__ == "__main__":
    main()
