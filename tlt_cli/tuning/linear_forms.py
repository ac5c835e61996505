"""Measure which linear form (tlt_cli/engine/linear_forms.py) is fastest per weight shape and row count, and cache it.

`measured_linear_plan` is what the composition root (tlt_cli/training/setup.py `decode_plan_for`) calls for the
policy and drafter: `off` gives None (plain
F.linear everywhere), `auto` the plan cached for this machine and these shapes, measured and cached first
if there is none. The plan goes to whoever decodes (`decode_model_for`, the engine's drafter copy); nothing
here changes a module.

The measurement (`measure_plan`) runs the model's own weights, grouped by shape, the way a decode step
meets them: for each row count (1..16, 24, 32, 64) and form it runs every group in turn, so between two
visits of one group all the others have streamed through the cache, as in a forward pass over the
model (a model that fits in the cache stays in it, as it would while decoding). Each group is timed
on its own (synchronized on a GPU), over `rounds` interleaved rounds with the order of forms rotated;
the best time counts; after the first round a form HOPELESS times slower than the best is dropped.
Each form is timed as the decode copies call it (`linear` as a plain nn.Linear computes, the others through
FormedLinear), so where a layer takes microseconds the Python around a form counts against it.
A form other than `linear` replaces it only if it is at least MARGIN faster. It costs about 2 rounds
x 3 forms of a pass over every weight at each of 1..16, 24, 32 and 64 rows: 33 s for SmolLM2-135M
and its drafter on one thread of a heavily loaded 2-core CPU (estimated 10-15 s idle; it holds a
transposed copy of every weight meanwhile), about 2 s for the built-in tiny model (each timing repeats
a tiny pass to last 0.5 ms), once per machine and model.

Cache (tlt_cli/tuning/cache.py): `<cache_dir>/linear_forms/<hash>.json`, keyed by the machine
(`machine_key`) and the model's shapes (each shape's dtype and count); a changed key measures again.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tlt_cli.config import LinearForms
from tlt_cli.engine.linear_forms import FORM_NAMES, LINEAR, FormedLinear, LinearFormPlan, linear_layers, shape_key
from tlt_cli.tuning.cache import cached_record, machine_key

ROW_BUCKETS = (*range(1, 17), 24, 32, 64)
ROUNDS = 2
# a form other than F.linear must be this much faster to be picked (timing noise must not cost memory)
MARGIN = 0.1
# after the first round, a form this many times slower than the best at a (shape, rows) is not timed again
HOPELESS = 1.5
# a group's timed call repeats its pass until it lasts about this long (tiny models' passes take microseconds)
SHORTEST_TIMING_SECONDS = 5e-4
PLAN_FORMAT = 2
# the most rows a stored plan's bucket may name (each decode copy holds a form per row count up to its largest)
MAX_ROWS = 4096
CACHE_FOLDER = "linear_forms"


def measured_linear_plan(
    mode: LinearForms | str, modules: Sequence[nn.Module | None], cache_dir: Path
) -> LinearFormPlan | None:
    """`off`: None. `auto`: the cached (or now measured) plan of this machine for the linear layers of `modules`."""
    if LinearForms.of(mode, "rollout.linear_forms") == LinearForms.off:
        return None
    plan, _ = cached_plan(modules, cache_dir)
    return plan


def cached_plan(
    modules: Sequence[nn.Module | None],
    cache_dir: Path,
    row_buckets: Sequence[int] = ROW_BUCKETS,
    rounds: int = ROUNDS,
) -> tuple[LinearFormPlan, Path | None]:
    """The plan for these modules on this machine, and its file: read from the cache, or measured (see
    measure_plan) and written there first."""

    def measure() -> dict:
        plan, milliseconds = measure_plan(modules, row_buckets, rounds)
        rounded = {
            shape: {form: [round(value, 4) for value in values] for form, values in forms.items()}
            for shape, forms in milliseconds.items()
        }
        return {"plan": plan.to_dict(), "milliseconds": rounded}

    record, path = cached_record(cache_dir, CACHE_FOLDER, plan_key(modules, row_buckets), measure, valid_record)
    return LinearFormPlan.from_dict(record["plan"]), path


def valid_record(record: dict) -> bool:
    """Whether a stored record holds a plan of this shape (tlt_cli/tuning/cache.py): ascending row buckets within
    1..MAX_ROWS, and per weight shape one known form per bucket."""
    plan = record.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("forms"), dict):
        return False
    buckets = plan.get("row_buckets")
    if not isinstance(buckets, list) or not buckets:
        return False
    if not all(type(rows) is int and 1 <= rows <= MAX_ROWS for rows in buckets) or buckets != sorted(set(buckets)):
        return False
    return all(
        isinstance(forms, list) and len(forms) == len(buckets) and all(form in FORM_NAMES for form in forms)
        for forms in plan["forms"].values()
    )


def plan_key(modules: Sequence[nn.Module | None], row_buckets: Sequence[int] = ROW_BUCKETS) -> dict:
    """What a plan depends on: this machine, torch, and how many weights of each shape the modules hold."""
    layers = linear_layers(modules)
    device = layers[0].weight.device if layers else torch.device("cpu")
    return {
        "format": PLAN_FORMAT,
        **machine_key(device),
        "shapes": dict(sorted(Counter(shape_key(layer.weight) for layer in layers).items())),
        "row_buckets": list(row_buckets),
    }


def measure_plan(
    modules: Sequence[nn.Module | None], row_buckets: Sequence[int] = ROW_BUCKETS, rounds: int = ROUNDS
) -> tuple[LinearFormPlan, dict[str, dict[str, list[float]]]]:
    """The fastest form per (shape, row bucket), and the best milliseconds of every form (see the module docstring)."""
    groups: dict[str, list[nn.Linear]] = {}
    for layer in linear_layers(modules):
        groups.setdefault(shape_key(layer.weight), []).append(layer)
    best = {key: {form: [math.inf] * len(row_buckets) for form in FORM_NAMES} for key in groups}
    with torch.no_grad():
        calls = {key: _calls_by_form(layers, max(row_buckets)) for key, layers in groups.items()}
        repeats = {key: _repeats(calls[key], layers[0]) for key, layers in groups.items()}
        for round_index in range(rounds):
            for bucket, rows in enumerate(row_buckets):
                shift = (round_index + bucket) % len(FORM_NAMES)
                for form in FORM_NAMES[shift:] + FORM_NAMES[:shift]:
                    for key, layers in groups.items():
                        times = [best[key][name][bucket] for name in FORM_NAMES]
                        if round_index > 0 and times[FORM_NAMES.index(form)] > HOPELESS * min(times):
                            continue
                        seconds = _time_pass(calls[key][form], layers[0], rows, repeats[key])
                        best[key][form][bucket] = min(best[key][form][bucket], seconds * 1e3)
    plan = LinearFormPlan(tuple(row_buckets), {key: _fastest(times) for key, times in best.items()})
    return plan, best


def _calls_by_form(layers: list[nn.Linear], most_rows: int) -> dict[str, list[Callable]]:
    """Per form, one call per layer as the engine makes it: `linear` as a plain nn.Linear computes, the
    others through FormedLinear.forward (their bookkeeping and the copy's freshness check included)."""
    calls = {LINEAR: [functools.partial(_plain_linear, layer) for layer in layers]}
    for form in FORM_NAMES:
        if form != LINEAR:
            calls[form] = [FormedLinear(layer, (form,) * (most_rows + 1)).forward for layer in layers]
    return calls


def _plain_linear(layer: nn.Linear, inputs: torch.Tensor) -> torch.Tensor:
    return F.linear(inputs, layer.weight, layer.bias)


def _fastest(milliseconds: dict[str, list[float]]) -> tuple[str, ...]:
    """Per bucket, the fastest form; `linear` unless another beats it by MARGIN."""
    chosen = []
    for bucket, linear_time in enumerate(milliseconds[LINEAR]):
        form = min(FORM_NAMES, key=lambda name: milliseconds[name][bucket])
        chosen.append(form if milliseconds[form][bucket] < (1 - MARGIN) * linear_time else LINEAR)
    return tuple(chosen)


def _repeats(calls: dict[str, list[Callable]], layer: nn.Linear) -> int:
    """Passes per timing of this group so one lasts SHORTEST_TIMING_SECONDS (after a warm-up of every form)."""
    for form_calls in calls.values():
        _time_pass(form_calls, layer, 1, 1)
    seconds = _time_pass(calls[LINEAR], layer, 1, 1)
    return max(1, math.ceil(SHORTEST_TIMING_SECONDS / max(seconds, 1e-9)))


def _time_pass(calls: list[Callable], layer: nn.Linear, rows: int, repeats: int) -> float:
    """Seconds per pass of `calls` (one per layer of a group shaped like `layer`) at `rows` rows
    (synchronized on a GPU)."""
    weight = layer.weight
    inputs = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    _synchronize(inputs.device)
    started = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call(inputs)
    _synchronize(inputs.device)
    return (time.perf_counter() - started) / repeats


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
