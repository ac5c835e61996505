"""Turn the workers' reports of one step into trace records (request, worker, step).

The driver collects one `WorkerStepReport` per rank and calls `step_records`. Times are
wall-clock seconds; the step's rollout ends when the slowest worker's shard ends, and every
other worker is idle from its own end until then.
"""

from __future__ import annotations

from typing import Any

import numpy

from tlt_cli.processes.messages import WorkerStepReport
from tlt_cli.speculative.types import DRAFT_SOURCES, accept_length


def step_records(reports: list[WorkerStepReport]) -> list[dict[str, Any]]:
    """All trace records for one step: requests, then one per worker, then the step summary."""
    reports = sorted(reports, key=lambda report: report.worker)
    requests = [record for report in reports for record in report.requests]
    rollout_start = min(report.rollout_start for report in reports)
    rollout_end = max(report.busy_end for report in reports)
    workers = [_worker_record(report, rollout_end) for report in reports]
    configurations = [
        _configuration_record(report, label, usage)
        for report in reports
        for label, usage in sorted(report.sd_usage.items())
    ]
    return requests + workers + configurations + [_step_record(reports, requests, workers, rollout_start, rollout_end)]


def _configuration_record(report: WorkerStepReport, label: str, usage: dict[str, float]) -> dict[str, Any]:
    """Time one worker spent decoding in one SD configuration ("off" = plain decoding) during the step."""
    return {"type": "sd_config", "step": report.step, "worker": report.worker, "config": label, **usage}


def _worker_record(report: WorkerStepReport, rollout_end: float) -> dict[str, Any]:
    return {
        "type": "worker",
        "step": report.step,
        "worker": report.worker,
        "busy_start": report.rollout_start,
        "busy_end": report.busy_end,
        "idle_start": report.busy_end,
        "idle_end": rollout_end,
        "idle_seconds": rollout_end - report.busy_end,
        **report.plugin_metrics,
    }


def _step_record(
    reports: list[WorkerStepReport],
    requests: list[dict[str, Any]],
    workers: list[dict[str, Any]],
    rollout_start: float,
    rollout_end: float,
) -> dict[str, Any]:
    lengths = numpy.array([record["tokens"] for record in requests], dtype=float)
    rewards = numpy.array([record["reward"] for record in requests], dtype=float)
    step_end = max(report.idle_end + report.reward_seconds + report.update_seconds for report in reports)
    verify_passes = sum(record["verify_passes"] for record in requests)
    accepted = sum(record["accepted_tokens"] for record in requests)
    update = _update_over_workers(reports)
    return {
        "type": "step",
        "step": reports[0].step,
        "rollout_start": rollout_start,
        "rollout_end": rollout_end,
        "rollout_seconds": rollout_end - rollout_start,
        "reward_seconds": max(report.reward_seconds for report in reports),
        "update_seconds": max(report.update_seconds for report in reports),
        "step_seconds": step_end - rollout_start,
        "idle_worker_seconds": sum(worker["idle_seconds"] for worker in workers),
        # from the end of the slowest shard to the last worker leaving the rollout barrier: the
        # critical-path cost of the barrier's polling and of any idle-time work that overran
        "release_delay_seconds": max(report.idle_end for report in reports) - rollout_end,
        "mean_reward": float(rewards.mean()),
        "response_length_p50": float(numpy.percentile(lengths, 50)),
        "response_length_p99": float(numpy.percentile(lengths, 99)),
        "response_length_max": float(lengths.max()),
        "response_tokens": int(lengths.sum()),
        # responses that ran to rollout.max_new_tokens (no EOS): their rewards score cut answers
        "responses_cut_share": sum(not record.get("finished_by_eos", True) for record in requests) / len(requests),
        "accept_length": accept_length(accepted, verify_passes),
        # "reset" or "off" when the drafter diverged in this step's rollout (the ranks agree on it), else None
        "drafter_divergence": reports[0].drafter_divergence,
        **{f"actor_{name}": value for name, value in update.items()},
        **_speculation_totals(reports),
        **_plugin_totals(reports),
    }


def _speculation_totals(reports: list[WorkerStepReport]) -> dict[str, float | None]:
    """Per draft source its accept length, worker-seconds decoded with SD on and off, SD's share of them, and over
    the SD configurations the cost
    model chose (mode auto), its predicted tokens per second beside the measured ones (None where nothing ran)."""
    usages = [(label, usage) for report in reports for label, usage in report.sd_usage.items()]
    on = [usage for label, usage in usages if label != "off"]
    on_seconds = sum(usage["seconds"] for usage in on)
    off_seconds = sum(usage["seconds"] for label, usage in usages if label == "off")
    predicted = [usage for usage in on if usage.get("predicted_seconds", 0) > 0]
    predicted_seconds = sum(usage["predicted_seconds"] for usage in predicted)
    measured_seconds = sum(usage["seconds"] for usage in predicted)
    return {
        # per draft source: tokens per verify pass of the passes it drafted (the drafter's learning curve)
        **{
            f"{source}_accept_length": accept_length(
                sum(usage.get(f"{source}_accepted_tokens", 0) for usage in on),
                sum(usage.get(f"{source}_verify_passes", 0) for usage in on),
            )
            for source in DRAFT_SOURCES
        },
        "sd_on_seconds": on_seconds,
        "sd_off_seconds": off_seconds,
        "sd_share": on_seconds / (on_seconds + off_seconds) if on_seconds + off_seconds > 0 else None,
        "sd_predicted_tokens_per_second": (
            sum(usage["predicted_tokens"] for usage in predicted) / predicted_seconds if predicted else None
        ),
        "sd_measured_tokens_per_second": (
            sum(usage["tokens"] for usage in predicted) / measured_seconds
            if predicted and measured_seconds > 0
            else None
        ),
    }


def _update_over_workers(reports: list[WorkerStepReport]) -> dict[str, float]:
    """The actor's update metrics over workers: names ending in _min the lowest, _max the highest, others the mean."""
    names = sorted({name for report in reports for name in report.update})
    combine = {"_min": min, "_max": max}
    merged = {}
    for name in names:
        values = [report.update[name] for report in reports if name in report.update]
        merged[name] = float(combine.get(name[-4:], numpy.mean)(values))
    return merged


def _plugin_totals(reports: list[WorkerStepReport]) -> dict[str, float]:
    """Plugin metrics over workers: counters (names ending in _steps or _seconds) summed, others averaged."""
    names = sorted({name for report in reports for name in report.plugin_metrics})
    totals = {}
    for name in names:
        values = [report.plugin_metrics[name] for report in reports if name in report.plugin_metrics]
        totals[name] = float(sum(values)) if name.endswith(("_steps", "_seconds")) else float(numpy.mean(values))
    return totals
