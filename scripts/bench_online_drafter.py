"""Does online drafter training pay? Accept length per RL step with a frozen vs an online drafter.

    python scripts/bench_online_drafter.py --steps 20 --out bench-online.json

Runs `tlt train` on the tiny recipe four times with the same seed, one after another:
  plain          SD off, no sidecar (the baseline for step time)
  plain+sidecar  SD off, drafter sidecar on (its critical-path overhead: same rollouts as `plain`)
  frozen       SD on (fixed chain), drafter warmed up offline at step 0, then frozen
  online       SD on (fixed chain), the same warmed-up drafter trained on idle workers (sidecar)
and prints, per step, the accept length of `frozen` and `online`, then a summary: accept length
over the last 5 steps (online / frozen), step-time overhead of the sidecar with SD off, and the
share of idle worker-seconds the sidecar spent training. The sidecar's overhead is given two ways:
the step-time ratio of `plain+sidecar` over `plain` (same rollouts; noisy on a shared machine) and
its direct critical-path cost, measured inside the run: time in its critical-path hooks (feature
collection, averaging; two workers run them in parallel) plus the extra delay between the end of
the slowest shard and the last worker leaving the rollout barrier (an overrunning drafter step).
Writes everything as JSON.
"""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table
from training_runs import benchmark_parser, mean, run_variants

VARIANTS = {
    "plain": ["speculative.mode=off"],
    "plain+sidecar": ["speculative.mode=off", "plugins.enabled=[drafter_sidecar]"],
    "frozen": ["speculative.mode=fixed"],
    "online": ["speculative.mode=fixed", "plugins.enabled=[drafter_sidecar]"],
}


def summarize(results: dict[str, list[dict]]) -> dict:
    steps = {name: [record for record in records if record["type"] == "step"] for name, records in results.items()}
    accept = {name: [record["accept_length"] or 0.0 for record in rows] for name, rows in steps.items()}  # SD off: 0
    online_workers = [record for record in results["online"] if record["type"] == "worker"]
    idle_available = sum(record["idle_seconds"] for record in online_workers)
    idle_used = sum(record.get("drafter_train_seconds", 0.0) for record in online_workers)
    summary = {
        "accept_length_first5_online": mean(accept["online"][:5]),
        "accept_length_last5_frozen": mean(accept["frozen"][-5:]),
        "accept_length_last5_online": mean(accept["online"][-5:]),
        "online_over_frozen": mean(accept["online"][-5:]) / max(mean(accept["frozen"][-5:]), 1e-9),
        "idle_seconds_available": idle_available,
        "idle_seconds_training": idle_used,
        "idle_used_fraction": idle_used / max(idle_available, 1e-9),
    }
    if "plain" in steps:
        summary.update(sidecar_overhead(steps["plain"], steps["plain+sidecar"]))
    return summary


def sidecar_overhead(plain: list[dict], sidecar: list[dict]) -> dict:
    """Step time with the sidecar vs without (SD off in both), as a ratio and as a direct measurement.

    The direct cost: the sidecar's critical-path hooks (two workers run them in parallel, so half
    their sum) plus the extra delay in leaving the rollout barrier.
    """
    plain_seconds = mean([row["step_seconds"] for row in plain])
    direct = mean(
        [row.get("drafter_critical_seconds", 0.0) / 2 + row["release_delay_seconds"] for row in sidecar]
    ) - mean([row["release_delay_seconds"] for row in plain])
    return {
        "step_seconds_plain": plain_seconds,
        "step_seconds_plain_sidecar": mean([row["step_seconds"] for row in sidecar]),
        "sidecar_overhead_step_time": mean([row["step_seconds"] for row in sidecar]) / plain_seconds - 1.0,
        "sidecar_critical_seconds_per_step": direct,
        "sidecar_overhead_direct": direct / plain_seconds,
    }


def render(results: dict[str, list[dict]], summary: dict) -> None:
    console = Console()
    table = Table(title="accept length per RL step (tokens per verify pass)")
    for column in ("step", "frozen", "online", "online drafter steps", "online drafter loss"):
        table.add_column(column, justify="right")
    frozen = [record for record in results["frozen"] if record["type"] == "step"]
    online = [record for record in results["online"] if record["type"] == "step"]
    for before, after in zip(frozen, online):
        table.add_row(
            str(before["step"]),
            f"{before['accept_length'] or 0:.2f}",
            f"{after['accept_length'] or 0:.2f}",
            f"{after.get('drafter_steps', 0):.0f}",
            f"{after.get('drafter_loss', float('nan')):.3f}",
        )
    console.print(table)
    console.print({key: round(value, 4) for key, value in summary.items()})


def main() -> None:
    parser = benchmark_parser(__doc__.splitlines()[0], "bench-online")
    parser.add_argument(
        "--accept-only",
        action="store_true",
        help="run only `frozen` and `online` (accept lengths and idle use; no overhead numbers)",
    )
    arguments = parser.parse_args()
    names = ["frozen", "online"] if arguments.accept_only else list(VARIANTS)
    results = run_variants(
        {name: VARIANTS[name] for name in names}, arguments.overrides, arguments.steps, arguments.output_dir
    )
    summary = summarize(results)
    render(results, summary)
    arguments.out.write_text(json.dumps({"summary": summary, "records": results}, indent=1))


if __name__ == "__main__":
    main()
