"""The PNG pictures of `tlt profile`, drawn with matplotlib's Agg renderer (no display, no pyplot state).

`write_plots(profile, segments, lengths, output_dir)` writes
  profile_timeline.png  per-worker Gantt over the whole run: busy, tail (1..tail_batch requests in
                        flight) and idle stretches of every step's rollout, on one time axis;
  profile_lengths.png   histogram of response lengths (log count axis) with p50, p90, p99 marked.
Each is drawn into a temporary sibling and renamed into place, so a full disk leaves the previous
picture (or none), never half of one, and is a `UserError` naming the file.
"""

from __future__ import annotations

import io
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tlt_cli.atomic_files import write_atomically
from tlt_cli.errors import writing
from tlt_cli.profile.analysis import Profile, Segment

TIMELINE_FILE = "profile_timeline.png"
LENGTHS_FILE = "profile_lengths.png"
STATE_COLOURS = {"busy": "#1f5fa8", "tail": "#5ec4e6", "idle": "#e4572e"}
DPI = 110
PLOT_ADVICE = "free some space, pass --output-dir with another folder, or --no-plots."


def write_plots(profile: Profile, segments: list[Segment], lengths: list[int], output_dir: Path) -> list[Path]:
    """Write both PNGs into output_dir (created if needed); return their paths."""
    with writing(output_dir, PLOT_ADVICE):
        output_dir.mkdir(parents=True, exist_ok=True)
    timeline = output_dir / TIMELINE_FILE
    histogram = output_dir / LENGTHS_FILE
    _plot_timeline(profile, segments, timeline)
    _plot_lengths(profile, lengths, histogram)
    return [timeline, histogram]


def _plot_timeline(profile: Profile, segments: list[Segment], path: Path) -> None:
    workers = sorted({segment.worker for segment in segments})
    origin = min((segment.start for segment in segments), default=0.0)
    figure = Figure(figsize=(11, 1.9 + 0.45 * len(workers)), dpi=DPI, layout="constrained")
    axes = figure.subplots()
    for row, worker in enumerate(workers):
        for state, colour in STATE_COLOURS.items():
            bars = [
                (segment.start - origin, segment.end - segment.start)
                for segment in segments
                if segment.worker == worker and segment.state == state
            ]
            axes.broken_barh(bars, (row - 0.4, 0.8), facecolors=colour)
    _mark_steps(axes, segments, origin)
    axes.set_yticks(range(len(workers)), [f"worker {worker}" for worker in workers])
    # worker 0 on top; room above the first row for the step labels
    axes.set_ylim(len(workers) - 0.5, -0.8)
    axes.set_xlabel(
        "seconds since the first rollout started; lines: step starts, numbered (blank: reward, update, sync)"
    )
    axes.set_title(
        f"rollout timeline: idle {profile.idle_fraction:.0%} of worker time, "
        f"projected {profile.projection.speedup_of} speedup {profile.projection.projected_speedup:.2f}x "
        "with SD in the tail"
    )
    legend = [
        Patch(color=STATE_COLOURS["busy"], label="busy"),
        Patch(color=STATE_COLOURS["tail"], label=f"tail (1-{profile.projection.tail_batch} requests in flight)"),
        Patch(color=STATE_COLOURS["idle"], label="idle (waiting for the slowest worker)"),
    ]
    figure.legend(handles=legend, loc="outside lower center", ncol=3, frameon=False)
    _save(figure, path)


def _mark_steps(axes, segments: list[Segment], origin: float) -> None:
    """A line at the start of each step's rollout, numbered where there is room for the label."""
    starts: dict[int, float] = {}
    for segment in segments:
        starts[segment.step] = min(starts.get(segment.step, segment.start), segment.start)
    span = max((segment.end for segment in segments), default=origin + 1.0) - origin
    last_label = -span
    for step, start in sorted(starts.items()):
        axes.axvline(start - origin, color="#999999", linewidth=0.6)
        # labels closer than 4% of the time axis would overlap
        if start - origin - last_label >= 0.04 * span:
            axes.text(start - origin, -0.5, f" {step}", fontsize=7, color="#555555", va="bottom")
            last_label = start - origin


def _plot_lengths(profile: Profile, lengths: list[int], path: Path) -> None:
    figure = Figure(figsize=(8, 4), dpi=DPI, layout="constrained")
    axes = figure.subplots()
    axes.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="#1f5fa8", edgecolor="white")
    axes.set_yscale("log")
    stats = profile.lengths
    for name, value, colour in (
        ("p50", stats.p50, "#2a9d3f"),
        ("p90", stats.p90, "#e9a23b"),
        ("p99", stats.p99, "#e4572e"),
    ):
        axes.axvline(value, color=colour, linewidth=1.5, label=f"{name} = {value:.0f}")
    ratio = "" if stats.tail_ratio is None else f", p99/p50 = {stats.tail_ratio:.1f}"
    axes.set_title(f"response lengths: {stats.count} responses, max {stats.max:.0f}{ratio}")
    axes.set_xlabel("response tokens")
    axes.set_ylabel("responses (log scale)")
    axes.legend()
    _save(figure, path)


def _save(figure: Figure, path: Path) -> None:
    """The picture, rendered in memory, written by the atomic layer (a new O_EXCL temporary file: a link planted
    at a predictable staging name is never written through)."""
    FigureCanvasAgg(figure)
    picture = io.BytesIO()
    figure.savefig(picture, format="png")
    with writing(path, PLOT_ADVICE):
        write_atomically(path, picture.getvalue())
