"""What `tlt train` shows: progress bars while it prepares, a live table with one row per step, then a summary.

The driver reports the drafter warm-up's phases to a `PhaseProgress` (one rich progress bar per
phase), then calls `TrainingDisplay.add_step(step_record)` as steps complete. By default the table
holds the few columns a user watches (it reads at 100 terminal columns) under a one-line legend;
`tlt train --columns all` adds the rest of the step record and the columns the run's plugins declare
(tlt_cli/plugins.py `plugin_columns`), by key: the display knows no plugin by name. On a terminal the
table redraws in place (rich Live); elsewhere (pipes, CI, tests) each step prints one line.
Text that comes from the user or a plugin (notes, the run's name and folder) is shown as plain
`Text`, never parsed as rich markup: a plugin error quoting gloo's `[/path/pair.cc:537]` is text.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from tlt_cli.plugins import MetricColumn

VISIBLE_STEPS = 20
# where the console is a log: a preparation's progress line at least this often (PhaseProgress)
LOG_INTERVAL_SECONDS = 10.0
# the columns a user watches, in a table that fits 100 terminal columns; `tlt train --columns all` adds the rest
WATCHED_COLUMNS = (
    ("step", "step", "{:d}"),
    ("reward", "mean_reward", "{:.3f}"),
    ("resp tok", "response_tokens", "{:.0f}"),
    ("step s", "step_seconds", "{:.2f}"),
    ("rollout s", "rollout_seconds", "{:.2f}"),
)
# shown once a run's records carry them: speculative decoding on
WATCHED_OPTIONAL_COLUMNS = (
    ("SD share", "sd_share", "{:.0%}"),
    ("accept len", "accept_length", "{:.2f}"),
)
# with --columns all: the rest of the step record (every figure is in trace.jsonl either way)
MORE_COLUMNS = (
    ("len p50", "response_length_p50", "{:.0f}"),
    ("len max", "response_length_max", "{:.0f}"),
    ("update s", "update_seconds", "{:.2f}"),
    ("idle worker-s", "idle_worker_seconds", "{:.2f}"),
)
# with --columns all, once a run's records carry them (a worker's resident peak, GB; the rollout/learner
# mismatch: K3 KL and the highest importance weight pi_old/pi_rollout, before truncation; a bfloat16 learner's
# K3 KL from its float32 weights), then the plugins' columns
MORE_OPTIONAL_COLUMNS = (
    ("peak GB/worker", "memory_peak_gb", "{:.2f}"),
    ("rollout KL", "actor_rollout_kl_k3", "{:.1e}"),
    ("bf16 KL", "actor_precision_kl_k3", "{:.1e}"),
    ("IS w max", "actor_rollout_weight_max", "{:.3f}"),
)
# what each column means: printed under the live table once, and in `tlt train --help`
LEGEND = (
    "reward: mean reward of the step's responses; resp tok: response tokens generated; step s / rollout s: "
    "seconds of the step and of its rollout; SD share: share of decode time spent speculating; accept len: "
    "tokens per verify pass while speculating."
)
MORE_LEGEND = (
    "len p50/max: response length; idle worker-s: worker-seconds waiting for the slowest shard; rollout KL: "
    "K3 KL between the rollout's and the learner's log-probs; bf16 KL: a bfloat16 learner's K3 KL from its "
    "float32 weights; IS w max: the largest importance weight pi_old/pi_rollout."
)
# before the first step's row, a progress line at most this often (workers starting, building or waiting for an op)
PROGRESS_SECONDS = 10.0
# a step where more than this share of responses ran to rollout.max_new_tokens is warned about (once a run)
CUT_SHARE_WARNING = 0.2


class PhaseProgress:
    """A progress bar per phase of a long preparation, fed as a (phase, done, total) callback.

    In a terminal, rich's bars. Where the console is a log (not a terminal), one plain line at least every
    `LOG_INTERVAL_SECONDS` (a ticker thread, so a phase whose callback is quiet, such as a long tail of
    generation, still reports): the phase, done of total, seconds so far and an estimate of what is left.

    Example:
        with PhaseProgress(console, "drafter warm-up") as progress:
            warm_up_drafter(..., progress=progress)
    """

    def __init__(self, console: Console, title: str, interval: float = LOG_INTERVAL_SECONDS):
        self.title = title
        self.console = console
        self.bars = (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
            )
            if console.is_terminal
            else None
        )
        self.phases: dict[str, Any] = {}
        self.interval = interval
        # the newest (phase, done, total) and when its phase began, for the log's lines
        self.latest: tuple[str, int, int] | None = None
        self.phase_started = time.monotonic()
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def __enter__(self) -> PhaseProgress:
        if self.bars is not None:
            self.bars.start()
        else:
            threading.Thread(target=self._tick, name="tlt-phase-progress", daemon=True).start()
        return self

    def __exit__(self, *exception: object) -> None:
        self.stopped.set()
        if self.bars is not None:
            self.bars.stop()

    def __call__(self, phase: str, done: int, total: int) -> None:
        with self.lock:
            if self.latest is None or self.latest[0] != phase:
                self.phase_started = time.monotonic()
            self.latest = (phase, done, total)
        if self.bars is None:
            return
        if phase not in self.phases:
            self.phases[phase] = self.bars.add_task(f"{self.title}: {phase}", total=total)
        self.bars.update(self.phases[phase], completed=done, total=total)

    def _tick(self) -> None:
        while not self.stopped.wait(self.interval):
            line = self.line()
            if line is not None:
                self.console.print(line, markup=False)

    def line(self) -> str | None:
        """The log's line for the newest report (None before the first)."""
        with self.lock:
            if self.latest is None:
                return None
            (phase, done, total), elapsed = self.latest, time.monotonic() - self.phase_started
        left = f", about {elapsed * (total - done) / done:.0f} s left" if 0 < done < total else ""
        return f"{self.title}: {phase} {done}/{total}, {elapsed:.0f} s{left}"


def _cell(record: dict[str, Any], key: str, template: str) -> str:
    value = record.get(key)
    return "-" if value is None else template.format(value)


class TrainingDisplay:
    """Live per-step table for a run; a context manager. plugin_columns: what the run's plugins declare, shown
    with all_columns (`tlt train --columns all`) as the rest of the step record is; by default the watched
    columns only, so the table reads at 100 terminal columns."""

    def __init__(
        self,
        console: Console,
        title: str,
        total_steps: int,
        plugin_columns: tuple[MetricColumn, ...] = (),
        all_columns: bool = False,
        start_step: int = 0,
    ):
        # start_step: the first step this process runs (a resume's), so the count reads "step 4/6" on step 3
        self.console, self.title, self.total_steps, self.start_step = console, title, total_steps, start_step
        plugin_cells = tuple((column.title, column.key, column.template) for column in plugin_columns)
        self.base_columns = WATCHED_COLUMNS + (MORE_COLUMNS if all_columns else ())
        self.optional_columns = WATCHED_OPTIONAL_COLUMNS + (MORE_OPTIONAL_COLUMNS + plugin_cells if all_columns else ())
        self.legend = LEGEND + (f" {MORE_LEGEND}" if all_columns else " More columns: tlt train --columns all.")
        self.records: list[dict[str, Any]] = []
        self.warned_cut = False
        self.started = self.last_progress = time.monotonic()
        self._live = Live(self._table(), console=console, auto_refresh=False) if console.is_terminal else None

    def __enter__(self) -> TrainingDisplay:
        self.console.print(Text(self.legend, style="dim"))
        if self._live is not None:
            self._live.__enter__()
        return self

    def __exit__(self, *exception: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exception)

    def note(self, message: str) -> None:
        """A one-time message (a warning, a checkpoint) as plain text: in a terminal printed above the live table, so
        every note stays on the screen in order (a collapse before its recovery), wrapped at word boundaries."""
        self.console.print(Text(message), soft_wrap=keeps_one_line(self.console))

    def progress(self, message: str) -> None:
        """A progress line of the run's preparation, printed above the table."""
        self.console.print(Text(message), soft_wrap=keeps_one_line(self.console))

    def before_first_step(self, activity: str | None) -> None:
        """Until the first step's row, a line every PROGRESS_SECONDS: the seconds since launch and what the workers
        last said they do (None: nothing yet, they are starting)."""
        now = time.monotonic()
        if self.records or now - self.last_progress < PROGRESS_SECONDS:
            return
        self.last_progress = now
        doing = activity or "workers starting (importing torch and DeepSpeed, loading the model)"
        self.progress(f"{now - self.started:.0f} s, waiting for the first step: {doing}")

    def add_step(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if self._live is None:
            cells = "  ".join(f"{name} {_cell(record, key, template)}" for name, key, template in self._columns())
            self.console.print(cells, highlight=False, soft_wrap=True)
        else:
            self._live.update(self._table(), refresh=True)
        self._warn_cut(record)

    def _warn_cut(self, record: dict[str, Any]) -> None:
        """Once a run: a note when more than CUT_SHARE_WARNING of a step's responses ran to max_new_tokens."""
        share = record.get("responses_cut_share")
        if self.warned_cut or share is None or share <= CUT_SHARE_WARNING:
            return
        self.warned_cut = True
        self.note(
            f"warning: step {record.get('step')}: {share:.0%} of the responses ran to rollout.max_new_tokens "
            "without ending, so their rewards score cut answers; raise rollout.max_new_tokens."
        )

    def _columns(self) -> tuple[tuple[str, str, str], ...]:
        """The base columns, then each optional one some record has a value for."""
        present = tuple(
            column
            for column in self.optional_columns
            if any(record.get(column[1]) is not None for record in self.records)
        )
        return self.base_columns + present

    def _table(self) -> Table:
        done = self.start_step + len(self.records)
        table = Table(title=Text(f"{self.title}: step {done}/{self.total_steps}"), title_justify="left")
        columns = self._columns()
        for name, _, _ in columns:
            table.add_column(name, justify="right")
        for record in self.records[-VISIBLE_STEPS:]:
            table.add_row(*(_cell(record, key, template) for _, key, template in columns))
        return table


def keeps_one_line(console: Console) -> bool:
    """`soft_wrap` for tlt's own lines: in a terminal rich wraps them at word boundaries at its width (a soft-wrapped
    line was cut mid-word by the terminal at 100 columns); in a log or a pipe each stays one line, for grep."""
    return not console.is_terminal


# the steps the summary averages at a run's start and at its end; a run of fewer than twice as many shows each step
SUMMARY_WINDOW = 5


def render_summary(
    console: Console,
    records: list[dict[str, Any]],
    run_directory: Path,
    idle_uses: tuple[tuple[str, str], ...] = (),
    sd_effect: str | None = None,
) -> None:
    """The end-of-run table: first vs last steps, totals, and where the run lives; then SD's measured effect.

    idle_uses: (what, record key) of the idle worker-seconds plugins used (`idle_seconds_used`). sd_effect: the
    sentence tlt_cli/sd_effect.py makes of the run's trace (None: the run did not speculate).
    """
    table = Table(title="run summary", title_justify="left", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("steps run", str(len(records)))
    rewards = [row["mean_reward"] for row in records]
    if len(rewards) >= 2 * SUMMARY_WINDOW:
        table.add_row(f"mean reward, first {SUMMARY_WINDOW} steps", f"{mean_of(rewards[:SUMMARY_WINDOW]):.3f}")
        table.add_row(f"mean reward, last {SUMMARY_WINDOW} steps", f"{mean_of(rewards[-SUMMARY_WINDOW:]):.3f}")
    else:
        table.add_row("mean reward of each step", ", ".join(f"{reward:.3f}" for reward in rewards))
    table.add_row("mean step seconds", f"{mean_of([row['step_seconds'] for row in records]):.2f}")
    table.add_row(
        "rollout share of step time",
        f"{sum(r['rollout_seconds'] for r in records) / max(sum(r['step_seconds'] for r in records), 1e-9):.0%}",
    )
    idle_seconds = sum(r["idle_worker_seconds"] for r in records)
    table.add_row("idle worker-seconds in rollouts", f"{idle_seconds:.1f}")
    for what, key in idle_uses:
        if any(r.get(key) is not None for r in records):
            used = sum(r.get(key) or 0.0 for r in records)
            table.add_row(f"idle worker-seconds spent {what}", f"{used:.1f} ({used / max(idle_seconds, 1e-9):.0%})")
    accept_lengths = [r["accept_length"] for r in records if r.get("accept_length") is not None]
    if len(accept_lengths) >= 2 * SUMMARY_WINDOW:
        table.add_row(
            f"accept length, first {SUMMARY_WINDOW} -> last {SUMMARY_WINDOW} SD steps",
            f"{mean_of(accept_lengths[:SUMMARY_WINDOW]):.2f} -> {mean_of(accept_lengths[-SUMMARY_WINDOW:]):.2f}",
        )
    elif accept_lengths:  # too few steps for two windows that do not overlap: each step once
        table.add_row("accept length of each SD step", ", ".join(f"{length:.2f}" for length in accept_lengths))
    on_seconds = sum(r.get("sd_on_seconds") or 0.0 for r in records)
    off_seconds = sum(r.get("sd_off_seconds") or 0.0 for r in records)
    if on_seconds + off_seconds > 0:
        table.add_row("SD share of rollout decode time", f"{on_seconds / (on_seconds + off_seconds):.0%}")
    memory_peaks = [r["memory_peak_gb"] for r in records if r.get("memory_peak_gb") is not None]
    if memory_peaks:
        table.add_row("peak resident memory of a worker", f"{max(memory_peaks):.2f} GB")
    table.add_row("run directory", Text(str(run_directory)))
    console.print(table)
    if sd_effect is not None:
        console.print(Text(sd_effect))


def mean_of(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
