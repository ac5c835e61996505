"""The training display: the watched columns under a legend by default (100 terminal columns), the rest and the
plugins' with --columns all, SD columns once a run reports them, a warning when responses are cut."""

import io
import re

from rich.console import Console
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.display import PROGRESS_SECONDS, TrainingDisplay, render_summary
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
    "response_tokens": 212,
    "responses_cut_share": 0.0,
    "accept_length": None,
}


def printed_lines(records, plugins=(), all_columns=True, width=400):
    """The lines a non-terminal display prints for `records`, the legend line left out."""
    output = io.StringIO()
    console = Console(file=output, width=width)
    columns = plugin_columns(plugins)
    with TrainingDisplay(console, "run", len(records), columns, all_columns=all_columns) as display:
        for record in records:
            display.add_step(record)
    printed = output.getvalue()
    assert printed.startswith("reward: mean reward")
    lines = printed.splitlines()
    first_row = next((index for index, line in enumerate(lines) if line.startswith("step ")), len(lines))
    return lines[first_row:]


def test_plain_runs_show_only_the_base_columns():
    (line,) = printed_lines([BASE])
    assert "reward 0.500" in line and "idle worker-s 0.40" in line
    assert "accept len" not in line and "drafter" not in line


def test_the_default_columns_are_the_watched_ones_and_fit_100_terminal_columns():
    record = {**BASE, "accept_length": 2.5, "sd_share": 0.54, "actor_rollout_kl_k3": 1.5e-4, "drafter_steps": 7.0}
    (line,) = printed_lines([record], plugins=["drafter_sidecar"], all_columns=False)
    assert line.split("  ") == [
        "step 0",
        "reward 0.500",
        "resp tok 212",
        "step s 1.60",
        "rollout s 1.00",
        "SD share 54%",
        "accept len 2.50",
    ]
    assert len(line) <= 100
    output = io.StringIO()
    terminal = Console(file=output, width=100, force_terminal=True)
    with TrainingDisplay(terminal, "tlt train tiny-cpu", 3) as display:
        display.add_step(record)
    table = output.getvalue()
    assert "…" not in table and "0.500" in table and "54%" in table and "--columns all" in table


# what a terminal does with rich Live's output: its SGR codes, cursor up (ESC[nA), erase line (ESC[2K), \r and \n
TERMINAL_CODE = re.compile(r"\x1b\[\??([0-9;]*)([A-Za-z])|\r|\n|[^\x1b\r\n]+")


def final_screen(output: str) -> list[str]:
    """The lines a terminal shows once `output` is written to it: the live table's earlier draws erased."""
    lines, row, column = [""], 0, 0
    for match in TERMINAL_CODE.finditer(output):
        text, (argument, command) = match.group(0), match.groups()
        if text == "\r":
            column = 0
        elif text == "\n":
            row, column = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif command == "A":
            row = max(row - int(argument or 1), 0)
        elif command == "K":
            lines[row] = ""
        elif command is None:
            lines[row] = lines[row][:column].ljust(column) + text + lines[row][column + len(text) :]
            column += len(text)
    return [line.rstrip() for line in lines]


def test_every_note_stays_on_a_terminals_screen_in_order_wrapped_at_word_boundaries():
    collapse = (
        "worker 1: SD accept length of ngram drafts collapsed to 1.12: the cost model keeps it off, re-probed every "
        "64 decode steps (later collapses go to the trace only)"
    )
    recovery = "worker 1: SD accept length of ngram drafts recovered to 1.43"
    checkpoint = "checkpoint saved: runs/tiny-cpu/checkpoints/step_000003"
    output = io.StringIO()
    terminal = Console(file=output, width=100, force_terminal=True)
    with TrainingDisplay(terminal, "tlt train tiny-cpu", 3) as display:
        display.add_step(BASE)
        display.note(collapse)
        display.add_step({**BASE, "step": 1})
        display.note(recovery)
        display.add_step({**BASE, "step": 2})
        display.note(checkpoint)
    screen = final_screen(output.getvalue())
    text = " ".join(" ".join(screen).split())
    assert collapse in text and recovery in text and checkpoint in text, screen
    assert text.index(collapse) < text.index(recovery) < text.index(checkpoint)
    assert all(len(line) <= 100 for line in screen)
    assert "step 3/3" in text and all(f"│ {step} │" in text for step in (0, 1, 2))


def test_a_step_that_cuts_more_than_a_fifth_of_its_responses_is_warned_about_once():
    records = [
        {**BASE, "step": 0, "responses_cut_share": 0.2},
        *({**BASE, "step": step, "responses_cut_share": 0.6} for step in (1, 2)),
    ]
    lines = printed_lines(records, all_columns=False)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert warnings == [
        "warning: step 1: 60% of the responses ran to rollout.max_new_tokens without ending, so their rewards score "
        "cut answers; raise rollout.max_new_tokens."
    ]


def test_sd_and_sidecar_metrics_appear_in_the_live_rows():
    record = {**BASE, "accept_length": 2.5, "drafter_steps": 7.0, "drafter_train_seconds": 0.3, "drafter_loss": 1.25}
    (line,) = printed_lines([record], plugins=["drafter_sidecar"])
    assert "accept len 2.50" in line and "drafter steps 7" in line
    assert "drafter train s 0.30" in line and "drafter loss 1.250" in line


def test_summary_reports_idle_time_used_by_the_drafter_and_accept_length(tmp_path):
    records = [{**BASE, "step": step, "accept_length": 2.0 + step, "drafter_train_seconds": 0.2} for step in range(10)]
    output = io.StringIO()
    render_summary(Console(file=output, width=200), records, tmp_path, plugin_idle_uses(["drafter_sidecar"]))
    text = output.getvalue()
    assert "idle worker-seconds spent training the drafter" in text
    assert "2.0 (50%)" in text  # 2.0 of 4.0 idle worker-seconds
    assert "accept length, first 5 -> last 5 SD steps" in text and "4.00 -> 9.00" in text  # steps 0-4 vs 5-9


def test_a_summary_of_fewer_steps_than_two_windows_shows_each_step_once(tmp_path):
    records = [{**BASE, "step": step, "mean_reward": 0.5 + step / 10, "accept_length": 2.0 + step} for step in (0, 1)]
    output = io.StringIO()
    render_summary(Console(file=output, width=100), records, tmp_path)
    text = output.getvalue()
    assert "first" not in text and "last" not in text, text
    assert "mean reward of each step" in text and "0.500, 0.600" in text
    assert "accept length of each SD step" in text and "2.00, 3.00" in text


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


def test_before_the_first_step_a_progress_line_names_what_the_workers_do():
    output = io.StringIO()
    with TrainingDisplay(Console(file=output, width=100), "run", 2, all_columns=False) as display:
        display.before_first_step(None)  # the first line comes PROGRESS_SECONDS after launch, not at once
        display.last_progress -= PROGRESS_SECONDS
        display.before_first_step(None)
        display.last_progress -= PROGRESS_SECONDS
        display.before_first_step("worker 0 at step 0: rollout")
        display.add_step(BASE)
        display.last_progress -= PROGRESS_SECONDS
        display.before_first_step("worker 0 at step 1: rollout")  # a row is shown: no more progress lines
    waiting = [line for line in output.getvalue().splitlines() if "waiting for the first step" in line]
    assert len(waiting) == 2
    assert waiting[0].endswith("workers starting (importing torch and DeepSpeed, loading the model)")
    assert waiting[1].endswith("worker 0 at step 0: rollout")


def test_train_help_carries_the_legend_and_the_columns_flag():
    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    help_text = " ".join(result.output.replace("│", " ").split())
    assert "--columns" in help_text and "resp tok: response tokens generated" in help_text
