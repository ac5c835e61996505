"""Print a calibration (batch size x configuration table, the chosen rules) and write its JSON and YAML fragment.

`render_calibration(console, result)` prints one row per batch size and one column per
configuration (tokens/s, ratio vs off, accept length, spread of the shards), then the
YAML fragment. `write_calibration(result)` writes every measurement to `result.output` and the
fragment next to it (same name, `.yaml`), each atomically (a failed write leaves the file as it was),
and returns both paths.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.atomic_files import write_atomically
from tlt_cli.calibration.calibrate import CalibrationResult, fragment_path
from tlt_cli.calibration.measure import Cell
from tlt_cli.calibration.rules import fragment_text
from tlt_cli.calibration.settings import CalibrationError
from tlt_cli.errors import writing
from tlt_cli.speculative.types import OFF


def cell_for(result: CalibrationResult, batch_size: int, label: str) -> Cell:
    return next(cell for cell in result.cells if cell.batch_size == batch_size and cell.label == label)


def render_calibration(console: Console, result: CalibrationResult) -> None:
    settings = result.settings
    table = Table(
        title=f"decode throughput by running batch size over {settings.repeats} whole worker shards per "
        f"configuration, {result.threads} thread(s) on {result.device}, "
        f"{result.rollout_precision['dtype']} ({result.rollout_precision['reason']})"
    )
    table.add_column("batch", justify="right")
    for label in result.labels:
        table.add_column(label, justify="right")
    table.add_column("choice")
    if result.model_choices:
        table.add_column("cost model's choice")
    for choice in result.choices:
        off = cell_for(result, choice.batch_size, OFF).tokens_per_second
        cells = [_cell_text(cell_for(result, choice.batch_size, label), off) for label in result.labels]
        model = [result.model_choices[choice.batch_size]] if result.model_choices else []
        table.add_row(str(choice.batch_size), *cells, _choice_text(choice.use, choice.candidates), *model)
    console.print(table)
    console.print(
        "batch b: decode steps whose running batch was b up to the next row's b; cell: tokens/s, ratio vs off / "
        "accept length (tokens per row per step), ± half the range of the shards' own rates; "
        f"SD is chosen where it beats off by more than {settings.margin:.0%}; the cost model's choice is what "
        "speculative.mode auto (the default) predicts best from this machine's pass costs and these accept lengths",
        highlight=False,
    )
    console.print(fragment_text(result.rules, result.command), highlight=False, markup=False, soft_wrap=True)


def _cell_text(cell: Cell, off_tokens_per_second: float) -> str:
    ratio = cell.tokens_per_second / off_tokens_per_second
    return f"{cell.tokens_per_second:.0f} {ratio:.2f}x\n{cell.accept_length:.2f} ±{cell.spread / 2:.0%}"


def _choice_text(use: str, candidates: tuple[str, ...]) -> str:
    return use + (f"\n(+{', '.join(candidates)})" if candidates else "")


def write_calibration(result: CalibrationResult) -> tuple[Path, Path]:
    """Write the measurements (JSON) and the recipe fragment (YAML, next to it), each atomically; return both
    paths. A write the disk refuses is a CalibrationError naming the file."""
    json_path, yaml_path = result.output, fragment_path(result.output)
    with writing(json_path.parent, "choose another --output.", CalibrationError):
        json_path.parent.mkdir(parents=True, exist_ok=True)
    with writing(json_path, "choose another --output.", CalibrationError):
        write_atomically(json_path, json.dumps(calibration_json(result), indent=2) + "\n")
    with writing(yaml_path, "choose another --output.", CalibrationError):
        write_atomically(yaml_path, fragment_text(result.rules, result.command))
    return json_path, yaml_path


def calibration_json(result: CalibrationResult) -> dict:
    recipe = result.recipe
    return {
        "command": result.command,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": torch.__version__,
            "device": result.device,
            "threads": result.threads,
        },
        "rollout_precision": result.rollout_precision,
        "model": recipe.model.path,
        "drafter": result.drafter,
        "task": recipe.task.name,
        "sampling": {
            "temperature": recipe.rollout.temperature,
            "top_p": recipe.rollout.top_p,
            "top_k": recipe.rollout.top_k,
        },
        "settings": {
            "batch_sizes": result.batch_sizes,
            "configs": result.labels,
            "repeats": result.settings.repeats,
            "margin": result.settings.margin,
            "candidates": result.settings.candidates,
        },
        "measurements": [_cell_json(result, cell) for cell in result.cells],
        "choices": [
            {"batch_size": choice.batch_size, "use": choice.use, "candidates": list(choice.candidates)}
            for choice in result.choices
        ],
        "rules": result.rules,
        "cost_model_choices": {str(size): label for size, label in result.model_choices.items()},
    }


def _cell_json(result: CalibrationResult, cell: Cell) -> dict:
    off = cell_for(result, cell.batch_size, OFF).tokens_per_second
    return {
        "batch_size": cell.batch_size,
        "config": cell.label,
        "tokens_per_second": cell.tokens_per_second,
        "ratio_vs_off": cell.tokens_per_second / off,
        "accept_length": cell.accept_length,
        "spread": cell.spread,
        "shards": [
            {
                "decode_steps": shard.decode_steps,
                "row_steps": shard.row_steps,
                "tokens": shard.tokens,
                "seconds": shard.seconds,
            }
            for shard in cell.shards
        ],
    }
