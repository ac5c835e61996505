"""Whether a checkpoint's drafter sidecar state is whole: every field the sidecar restores, of the type it restores.

The drafter sidecar (drafter_sidecar.py) saves, per worker, a dict of its trainer's state (drafter weights,
optimizer, step counts), its window of collected features, the average's version and its random generator. On
`--resume` it loads the file (tlt_cli/checkpoint.py `load_checkpoint_file`, which refuses bytes that differ from
their recorded CRC-32) and asks `state_problem(saved)` whether the state is whole before keeping it: a loadable
but incomplete state (`{}`, a field of another type) is then one warning and a fresh sidecar, never a KeyError
that disables the sidecar at its first rollout. Fields added to the state later (steps_since_average,
emitted_total, vocabulary) may be absent: older checkpoints have none.
"""

from __future__ import annotations

from typing import Any

import torch

from tlt_cli.drafter.trainer import DrafterBatch

# the fields every saved state has, and the fields checkpoints of older sidecars lack
REQUIRED_FIELDS = ("trainer", "window", "version", "generator")
LATER_FIELDS = ("steps_since_average", "emitted_total", "vocabulary")
# the trainer's state (tlt_cli/drafter/trainer.py DrafterTrainer.state_dict)
TRAINER_FIELDS = ("drafter", "optimizer", "steps_taken", "steps_skipped")


def state_problem(saved: object, step_data: type) -> str | None:
    """What makes `saved` no whole sidecar state (its window a list of `step_data`, the sidecar's StepData, each
    holding DrafterBatches); None when it is whole."""
    if not isinstance(saved, dict):
        return f"it holds a {type(saved).__name__}, not the sidecar's fields"
    missing = [field for field in REQUIRED_FIELDS if field not in saved]
    if missing:
        return f"it has no {', '.join(repr(field) for field in missing)}"
    problems = (
        _trainer_problem(saved["trainer"]),
        _window_problem(saved["window"], step_data),
        None if _is_count(saved["version"]) else "'version' is not a count",
        None if _is_byte_tensor(saved["generator"]) else "'generator' is not a random generator's state",
        _later_fields_problem(saved),
    )
    return next((problem for problem in problems if problem is not None), None)


def _trainer_problem(trainer: object) -> str | None:
    if trainer is None:  # saved before the sidecar was attached to a drafter
        return None
    if not isinstance(trainer, dict) or any(field not in trainer for field in TRAINER_FIELDS):
        return f"'trainer' lacks one of {', '.join(TRAINER_FIELDS)}"
    weights = trainer["drafter"]
    if not isinstance(weights, dict) or not all(isinstance(value, torch.Tensor) for value in weights.values()):
        return "'trainer' holds drafter weights that are not tensors"
    if not isinstance(trainer["optimizer"], dict) or not all(
        _is_count(trainer[field]) for field in ("steps_taken", "steps_skipped")
    ):
        return "'trainer' holds no optimizer state or step counts"
    return None


def _window_problem(window: object, step_data: type) -> str | None:
    if not isinstance(window, list) or not all(
        isinstance(data, step_data)
        and _is_count(data.step)
        and isinstance(data.batches, list)
        and all(isinstance(batch, DrafterBatch) for batch in data.batches)
        for data in window
    ):
        return "'window' is not a list of collected steps"
    return None


def _later_fields_problem(saved: dict) -> str | None:
    if "steps_since_average" in saved and not _is_count(saved["steps_since_average"]):
        return "'steps_since_average' is not a count"
    for field in ("emitted_total", "vocabulary"):
        if saved.get(field) is not None and not isinstance(saved[field], torch.Tensor):
            return f"{field!r} is not a tensor"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_byte_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
