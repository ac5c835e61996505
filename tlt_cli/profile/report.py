"""Render a `Profile` in the terminal: rich tables, a compact per-worker Gantt and a length histogram.

`render_profile(console, profile, segments, lengths, pictures)` is what `tlt profile` prints.
The Gantt shows the last few steps side by side, each as wide as its rollout took: one row per
worker, a column is the worker's state at that moment (busy, tail = 1..tail_batch requests in
flight, idle). The histogram bins response lengths linearly. Text read from the input (its path,
warnings, SD configuration labels) is escaped, never parsed as rich markup.
"""

from __future__ import annotations

from pathlib import Path

import numpy
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from tlt_cli.profile.analysis import Profile, Segment, StepProfile

GANTT_WIDTH = 72
GANTT_STEPS = 6
MIN_STEP_COLUMNS = 4
VISIBLE_STEPS = 20
HISTOGRAM_BINS = 12
HISTOGRAM_WIDTH = 40
# character and colour per state, shared with the PNG legend's wording
STATE_GLYPHS = {"busy": ("█", "blue"), "tail": ("▓", "cyan"), "idle": ("·", "red")}


def render_profile(
    console: Console, profile: Profile, segments: list[Segment], lengths: list[int], pictures: list[Path]
) -> None:
    """Print every table of the profile, the terminal Gantt and histogram, then where the PNGs went."""
    steps_word = "step" if len(profile.steps) == 1 else "steps"
    console.print(
        f"[bold]tlt profile[/] {escape(profile.source)} "
        f"({profile.kind}, {profile.workers} workers, {len(profile.steps)} {steps_word})",
        highlight=False,
    )
    for line in profile.precision:
        console.print(escape(line), highlight=False)
    console.print(_lengths_table(profile))
    console.print(_steps_table(profile))
    console.print(_idle_summary(profile), highlight=False)
    _render_speculative(console, profile)
    console.print(_drafter_summary(profile), highlight=False)
    _render_mismatch(console, profile)
    _render_projection(console, profile)
    console.print(
        Text(
            f"per-worker timeline (last steps; █ busy, ▓ tail: 1-{profile.projection.tail_batch} requests in flight, "
            "· idle)",
            style="bold",
        )
    )
    for line in terminal_gantt(segments, profile.steps, profile.workers):
        console.print(line)
    console.print(Text("response lengths (tokens)", style="bold"))
    for line in terminal_histogram(lengths):
        console.print(line, highlight=False)
    for warning in profile.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    for picture in pictures:
        console.print(f"wrote {picture}", highlight=False, markup=False)


def _lengths_table(profile: Profile) -> Table:
    lengths = profile.lengths
    table = Table(title="response lengths (tokens)", title_justify="left")
    for column in ("responses", "p50", "p90", "p99", "max", "p99/p50"):
        table.add_column(column, justify="right")
    ratio = "-" if lengths.tail_ratio is None else f"{lengths.tail_ratio:.1f}"
    table.add_row(
        str(lengths.count),
        f"{lengths.p50:.0f}",
        f"{lengths.p90:.0f}",
        f"{lengths.p99:.0f}",
        f"{lengths.max:.0f}",
        ratio,
    )
    return table


def _steps_table(profile: Profile) -> Table:
    # each header's words at most 7 letters, so rich wraps them (never cuts one) and the table fits 100 columns
    table = Table(
        title="rollout per step",
        title_justify="left",
        caption=f"tail: the slowest worker's seconds with 1-{profile.projection.tail_batch} requests in flight; "
        "proj.: the rollout the projection model predicts (below)",
        caption_justify="left",
    )
    columns = (
        "step",
        "rollout s",
        "step s",
        "idle worker s",
        "idle %",
        "<half busy %",
        "some idle %",
        "tail s",
        "proj. rollout s",
        "peak GB a worker",
    )
    for column in columns:
        table.add_column(column, justify="right")
    hidden = len(profile.steps) - VISIBLE_STEPS
    if hidden > 0:
        table.add_row(f"{hidden} earlier", *[""] * (len(columns) - 1))
    for step in profile.steps[-VISIBLE_STEPS:]:
        table.add_row(*_step_cells(step))
    step_seconds = "-" if profile.step_seconds is None else f"{profile.step_seconds:.2f}"
    table.add_row(
        "all",
        f"{profile.rollout_seconds:.2f}",
        step_seconds,
        f"{profile.idle_worker_seconds:.2f}",
        f"{100 * profile.idle_fraction:.0f}",
        f"{100 * profile.under_half_busy_share:.0f}",
        f"{100 * profile.some_idle_share:.0f}",
        f"{sum(step.tail_seconds for step in profile.steps):.2f}",
        f"{sum(step.projected_rollout_seconds for step in profile.steps):.2f}",
        _gigabytes(
            max((step.memory_peak_gb for step in profile.steps if step.memory_peak_gb is not None), default=None)
        ),
        style="bold",
    )
    return table


def _step_cells(step: StepProfile) -> list[str]:
    step_seconds = "-" if step.step_seconds is None else f"{step.step_seconds:.2f}"
    return [
        str(step.step),
        f"{step.rollout_seconds:.2f}",
        step_seconds,
        f"{step.idle_worker_seconds:.2f}",
        f"{100 * step.idle_fraction:.0f}",
        f"{100 * step.under_half_busy_share:.0f}",
        f"{100 * step.some_idle_share:.0f}",
        f"{step.tail_seconds:.2f}",
        f"{step.projected_rollout_seconds:.2f}",
        _gigabytes(step.memory_peak_gb),
    ]


def _gigabytes(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _idle_summary(profile: Profile) -> str:
    share = (
        "" if profile.step_seconds is None else f" ({profile.rollout_seconds / profile.step_seconds:.0%} of step time)"
    )
    return (
        f"rollout {profile.rollout_seconds:.2f} s{share}; idle {profile.idle_worker_seconds:.2f} worker-s = "
        f"{profile.idle_fraction:.0%} of worker time; "
        f"fewer than half the workers busy {profile.under_half_busy_share:.0%} "
        f"of rollout, at least one idle {profile.some_idle_share:.0%}"
    )


def _batch_range(batch_range: tuple[int, int] | None) -> str:
    if batch_range is None:
        return ""
    low, high = batch_range
    return str(low) if low == high else f"{low}-{high}"


def _rates(measured: float | None, predicted: float | None) -> str:
    """Measured tokens per second, and the cost model's prediction in brackets where it made one."""
    if measured is None:
        return ""
    return f"{measured:.1f}" + (f" ({predicted:.1f})" if predicted is not None else "")


def _render_speculative(console: Console, profile: Profile) -> None:
    if profile.sd_time:
        table = Table(title="decoding time by SD configuration", title_justify="left")
        # the labels at their full width (s2-k1-t3+ngram8 was cut at 100 columns); the other columns wrap instead
        table.add_column("config", no_wrap=True, min_width=max(len(entry.config) for entry in profile.sd_time))
        columns = (
            "seconds",
            "share %",
            "decode steps",
            "batch sizes",
            "tokens/s (predicted)",
            "accept length by source",
        )
        for column in columns:
            table.add_column(column, justify="right")
        for entry in profile.sd_time:
            table.add_row(
                Text(entry.config),
                f"{entry.seconds:.2f}",
                f"{100 * entry.share:.0f}",
                str(entry.decode_steps),
                _batch_range(entry.batch_range),
                _rates(entry.tokens_per_second, entry.predicted_tokens_per_second),
                _by_source(entry.accept_length_by_source),
            )
        table.add_row(
            "SD on / off",
            f"{profile.sd_on_seconds:.2f} / {profile.sd_off_seconds:.2f}",
            *[""] * (len(columns) - 1),
            style="bold",
        )
        console.print(table)
    else:
        console.print("SD on/off time: not recorded in the input (no sd_config records)")
    if profile.accept_length is None:
        console.print("accept length: SD did not run (no verify passes)")
        return
    console.print(f"accept length {profile.accept_length:.2f} tokens per verify pass", highlight=False)
    console.print(profile.sd_effect, highlight=False, markup=False)
    if profile.accept_length_by_source:
        console.print(
            f"accept length by draft source (its own drafts only): {_by_source(profile.accept_length_by_source)}",
            highlight=False,
        )
    if profile.accept_by_depth:
        table = Table(title="acceptance per draft depth", title_justify="left")
        for column in ("depth", "drafted", "accepted", "rate %", "adds to accept length"):
            table.add_column(column, justify="right")
        for depth in profile.accept_by_depth:
            if depth.proposed == 0:  # a depth no verify pass drafted: a row of zeros
                continue
            table.add_row(
                str(depth.depth),
                str(depth.proposed),
                str(depth.accepted),
                f"{100 * depth.rate:.0f}",
                f"{depth.accept_length_share:.2f}",
            )
        console.print(table)


def _by_source(lengths: dict[str, float]) -> str:
    """'drafter 1.62, ngram 1.45' ('' when no source drafted)."""
    return ", ".join(f"{source} {length:.2f}" for source, length in lengths.items())


def _render_mismatch(console: Console, profile: Profile) -> None:
    """Per step: K3 KL between the rollout's and the learner's log-probs, and the importance weights' spread."""
    measured = [step for step in profile.steps if step.mismatch is not None]
    if not measured:
        console.print("rollout/learner mismatch: not measured in the input")
        return
    table = Table(title="rollout/learner mismatch (weights pi_old/pi_rollout before truncation)", title_justify="left")
    for column in ("step", "K3 KL", "weight mean", "weight min", "weight max", "truncated %"):
        table.add_column(column, justify="right")
    for step in measured[-VISIBLE_STEPS:]:
        mismatch = step.mismatch
        table.add_row(
            str(step.step),
            f"{mismatch.kl_k3:.2e}",
            f"{mismatch.weight_mean:.4f}",
            f"{mismatch.weight_min:.4f}",
            f"{mismatch.weight_max:.4f}",
            f"{100 * mismatch.weight_truncated:.2f}",
        )
    console.print(table)


def _drafter_summary(profile: Profile) -> str:
    if profile.drafter_steps == 0 and profile.drafter_train_seconds == 0.0:
        return "drafter training: none recorded"
    return (
        f"drafter training: {profile.drafter_train_seconds:.2f} s, {profile.drafter_steps} steps "
        f"({profile.drafter_idle_share:.0%} of idle worker-seconds)"
    )


def _render_projection(console: Console, profile: Profile) -> None:
    projection = profile.projection
    console.print(
        f"[bold]reclaimable[/] {projection.reclaimable_seconds:.2f} s of {profile.rollout_seconds:.2f} s rollout "
        f"-> projected {projection.speedup_of} speedup [bold]{projection.projected_speedup:.2f}x[/]",
        highlight=False,
    )
    console.print(f"  model: {projection.model}", highlight=False)


def terminal_gantt(
    segments: list[Segment], steps: list[StepProfile], workers: int, width: int = GANTT_WIDTH
) -> list[Text]:
    """One line per worker over the last GANTT_STEPS steps, each step as wide as its share of their rollout time."""
    shown = steps[-GANTT_STEPS:]
    total = sum(step.rollout_seconds for step in shown) or 1.0
    columns = [max(MIN_STEP_COLUMNS, round(width * step.rollout_seconds / total)) for step in shown]
    step_numbers = {step.step for step in shown}
    windows = _step_windows(segments, step_numbers)
    worker_ids = sorted({segment.worker for segment in segments if segment.step in step_numbers}) or list(
        range(workers)
    )
    lines = [
        Text(
            "step ".rjust(6) + "|".join(f"{step.step:<{count}}"[:count] for step, count in zip(shown, columns)),
            style="dim",
        )
    ]
    for worker in worker_ids:
        line = Text(f"w{worker}".rjust(5) + " ")
        for index, (step, count) in enumerate(zip(shown, columns)):
            if index:
                line.append("|", style="dim")
            own = [segment for segment in segments if segment.step == step.step and segment.worker == worker]
            start, end = windows.get(step.step, (0.0, 1.0))
            for column in range(count):
                # the worker's state at the middle of this column's time slice
                moment = start + (column + 0.5) * (end - start) / count
                state = next((segment.state for segment in own if segment.start <= moment < segment.end), None)
                glyph, colour = STATE_GLYPHS.get(state, (" ", "default"))
                line.append(glyph, style=colour)
        lines.append(line)
    return lines


def _step_windows(segments: list[Segment], step_numbers: set[int]) -> dict[int, tuple[float, float]]:
    windows: dict[int, tuple[float, float]] = {}
    for segment in segments:
        if segment.step in step_numbers:
            start, end = windows.get(segment.step, (segment.start, segment.end))
            windows[segment.step] = (min(start, segment.start), max(end, segment.end))
    return windows


def terminal_histogram(lengths: list[int], bins: int = HISTOGRAM_BINS, width: int = HISTOGRAM_WIDTH) -> list[str]:
    """Lines "  lo-hi  ####### count" over linear bins of the lengths."""
    counts, edges = numpy.histogram(numpy.asarray(lengths, dtype=float), bins=bins)
    largest = max(int(counts.max()), 1)
    label_width = len(f"{edges[-1]:.0f}")
    lines = []
    for count, low, high in zip(counts, edges, edges[1:]):
        # a non-empty bin gets at least one mark, so single long responses stay visible
        bar = "#" * max(int(count > 0), round(width * count / largest))
        lines.append(f"  {low:>{label_width}.0f}-{high:<{label_width}.0f} {bar:<{width}} {count}")
    return lines
