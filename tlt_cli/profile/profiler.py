"""What `tlt profile SOURCE` does, in one call: read or record the records, analyse them, draw the PNGs.

`profile_source(source, overrides, ...)` decides what SOURCE is: a recipe (a .yaml/.yml file or a
shipped recipe name: a fresh rollout is recorded, see tlt_cli/profile/recording.py), otherwise a
run directory, a trace, or a CSV/JSONL of per-request records (tlt_cli/profile/records.py). PNGs go
to `output_dir`, else the run directory, the input file's folder, or for a recipe
`<run.output_dir>/<run.name>-profile/` (which also receives the recorded `rollout_trace.jsonl`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from tlt_cli.config import load_recipe
from tlt_cli.profile.analysis import DEFAULT_TAIL_BATCH, Profile, Segment, analyse, worker_segments
from tlt_cli.profile.plots import write_plots
from tlt_cli.profile.records import ProfileInputError, ProfileRecords, load_records
from tlt_cli.recipes import resolve_recipe_path

RECIPE_SUFFIXES = (".yaml", ".yml")
RECORDED_TRACE_FILE = "rollout_trace.jsonl"


@dataclass(frozen=True)
class ProfileResult:
    profile: Profile
    segments: list[Segment]
    # response lengths in tokens, one per request
    lengths: list[int]
    pictures: list[Path]


def profile_source(
    source: str,
    overrides: list[str] | None = None,
    steps: int = 2,
    output_dir: Path | None = None,
    tail_batch: int = DEFAULT_TAIL_BATCH,
    sd_speedup: float | None = None,
    pictures: bool = True,
) -> ProfileResult:
    """Profile SOURCE (see the module docstring); overrides and steps apply to a recipe only."""
    recipe_path = _recipe_path(source)
    if recipe_path is None and overrides:
        raise ProfileInputError(
            f"key=value overrides ({' '.join(overrides)}) apply to a recipe, and {source} is not one."
        )
    if tail_batch < 1:
        raise ProfileInputError(f"--tail-batch is {tail_batch}; set it to at least 1 (requests in flight).")
    if sd_speedup is not None and not 1.0 <= sd_speedup < math.inf:
        raise ProfileInputError(f"--sd-speedup is {sd_speedup}; give a finite factor of at least 1.0.")
    if recipe_path is not None:
        records, default_dir = _record(recipe_path, list(overrides or []), steps, output_dir)
    else:
        records = load_records(Path(source))
        default_dir = Path(source) if Path(source).is_dir() else Path(source).parent
    profile = analyse(records, tail_batch=tail_batch, sd_speedup=sd_speedup)
    segments = worker_segments(records, tail_batch)
    lengths = [request.tokens for request in records.requests]
    written = write_plots(profile, segments, lengths, output_dir or default_dir) if pictures else []
    return ProfileResult(profile=profile, segments=segments, lengths=lengths, pictures=written)


def _recipe_path(source: str) -> Path | None:
    """The recipe file SOURCE names, or None when SOURCE is not a recipe."""
    if Path(source).suffix.lower() in RECIPE_SUFFIXES:
        return Path(source)
    resolved = resolve_recipe_path(source)
    return resolved if resolved.suffix.lower() in RECIPE_SUFFIXES and resolved.is_file() else None


def _record(
    recipe_path: Path, overrides: list[str], steps: int, output_dir: Path | None
) -> tuple[ProfileRecords, Path]:
    from tlt_cli.preflight import check_recipe
    from tlt_cli.profile.recording import record_rollout  # loads torch and transformers: only when recording

    if steps < 1:
        raise ProfileInputError(f"--steps is {steps}; record at least 1 step.")
    recipe = load_recipe(recipe_path, overrides)
    check_recipe(recipe)
    directory = output_dir or Path(recipe.run.output_dir) / f"{recipe.run.name}-profile"
    return record_rollout(recipe, steps, directory / RECORDED_TRACE_FILE), directory
