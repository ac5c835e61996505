"""The training display: base columns always, SD and plugin columns once a run reports them."""

import io

from rich.console import Console

from tlt_cli.display import TrainingDisplay, render_summary
from tlt_cli.plugins import plugin_columns, plugin_idle_uses

BASE = {
    "step": 0,
    "mean_reward": 0.5,
    "response_length_p50": 14.0,
    "response_length_max": 90.0,
    "rollout_seconds": 1.0,
    "update_seconds": 0.5,
    "idle_worker_seconds": 0.4,
    "step_seconds": 1.6,
    "accept_length": None,
}


def printed_lines(records, plugins=()):
    output = io.StringIO()
    console = Console(file=output, width=400)
    with TrainingDisplay(console, "run", total_steps=len(records), plugin_columns=plugin_columns(plugins)) as display:
        for record in records:
            display.add_step(record)
    return output.getvalue().splitlines()


def test_plain_runs_show_only_the_base_columns():
    (line,) = printed_lines([BASE])
    assert "reward 0.500" in line and "idle worker-s 0.40" in line
    assert "accept len" not in line and "drafter" not in line


def test_sd_and_sidecar_metrics_appear_in_the_live_rows():
    record = {**BASE, "accept_length": 2.5, "drafter_steps": 7.0, "drafter_train_seconds": 0.3, "drafter_loss": 1.25}
    (line,) = printed_lines([record], plugins=["drafter_sidecar"])
    assert "accept len 2.50" in line and "drafter steps 7" in line
    assert "drafter train s 0.30" in line and "drafter loss 1.250" in line


def test_summary_reports_idle_time_used_by_the_drafter_and_accept_length(tmp_path):
    records = [{**BASE, "step": step, "accept_length": 2.0 + step, "drafter_train_seconds": 0.2} for step in range(6)]
    output = io.StringIO()
    render_summary(Console(file=output, width=200), records, tmp_path, plugin_idle_uses(["drafter_sidecar"]))
    text = output.getvalue()
    assert "idle worker-seconds spent training the drafter" in text
    assert "1.2 (50%)" in text  # 1.2 of 2.4 idle worker-seconds
    assert "4.00 -> 5.00" in text  # steps 0-4 vs steps 1-5


def test_a_plugin_column_shows_only_when_its_plugin_declares_it():
    record = {**BASE, "drafter_steps": 7.0}
    (line,) = printed_lines([record])
    assert "drafter" not in line


def test_a_workers_peak_memory_shows_in_the_live_rows_and_its_highest_in_the_summary(tmp_path):
    records = [{**BASE, "step": step, "memory_peak_gb": peak} for step, peak in enumerate([1.5, 2.25, 1.75])]
    lines = printed_lines(records)
    assert [line.split("peak GB/worker ")[1].split()[0] for line in lines] == ["1.50", "2.25", "1.75"]
    assert "peak GB/worker" not in printed_lines([BASE])[0]
    output = io.StringIO()
    render_summary(Console(file=output, width=200), records, tmp_path)
    assert "peak resident memory of a worker" in output.getvalue() and "2.25 GB" in output.getvalue()


def test_the_rollout_learner_mismatch_shows_in_the_live_rows_once_measured():
    measured = {**BASE, "step": 1, "actor_rollout_kl_k3": 1.5e-4, "actor_rollout_weight_max": 1.0625}
    unmeasured, line = printed_lines([BASE, measured])
    assert "rollout KL" not in unmeasured
    assert "rollout KL 1.5e-04" in line and "IS w max 1.062" in line
