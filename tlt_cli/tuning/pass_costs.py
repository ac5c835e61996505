"""Measure what the passes of a speculative decode step cost on this machine, model and dtype, and cache it.

`measured_pass_costs(policy, drafter, dtype, linear_plan, cache_dir, most_rows)` is what the composition root
(tlt_cli/training/setup.py `decode_plan`) calls when the rollout chooses its SD configuration from costs
(`speculative.mode: auto`); it returns tlt_cli/speculative/costs.py's `PassCosts`. It times, with the owned decode
forward of `policy` in `dtype` and the measured linear-form plan (as the rollout decodes), the target's pass over
every point of a grid of running rows (1, 2, 4, ... up to the rows a worker decodes, at most 32) x tokens per row
(1, 2, 4, 8, 16), logits included, over a 64-token prefix (tuning/timing.py), and the drafter's forward over 1-32
entries. Each point is its stable median over interleaved rounds (tuning/timing.py `stable_medians`). The points the
dtype probe measured in this dtype (tuning/precision.py `PrecisionChoice.shared_pass_ms`: the plain steps of its
tail and its 4 x 4 verify) come in as `shared_ms` and are taken, not timed again, so the probe and the grid plan
with one figure for each pass. For SmolLM2-135M on a 2-core CPU it takes a few seconds; it is cached per machine,
model, dtype, plan, grid and shared figures (`<cache_dir>/pass_costs/<hash>.json`, tuning/cache.py) and read
back by every later run. A model the owned forward does not decode gets no costs (None): `auto` then keeps SD off.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tlt_cli.engine import decode_model_for
from tlt_cli.engine.kv_cache import SlotCache, block_attention_mask
from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.engine.llama_family import refusal
from tlt_cli.speculative.costs import PassCosts
from tlt_cli.tuning.cache import cached_record, machine_key
from tlt_cli.tuning.precision import model_key
from tlt_cli.tuning.timing import MOST_ROUNDS, block_passes, pass_timer, random_prefix, stable_medians

CACHE_FOLDER = "pass_costs"
MEASUREMENT_FORMAT = 2
ROWS = (1, 2, 4, 8, 16, 32)
TOKENS = (1, 2, 4, 8, 16)
DRAFTER_ENTRIES = (1, 2, 4, 8, 16, 32)
PREFIX_TOKENS = 64


def measured_pass_costs(
    policy: nn.Module,
    drafter: nn.Module | None,
    dtype: torch.dtype,
    linear_plan: LinearFormPlan | None,
    cache_dir: Path,
    most_rows: int,
    shared_ms: dict[tuple[int, int], float] | None = None,
) -> PassCosts | None:
    """The pass costs of decoding `policy` (and drafting with `drafter`) in `dtype` with the plan, for batches of
    up to `most_rows` rows, cached (see the module docstring); shared_ms: (rows, tokens) -> milliseconds of the
    grid's points already measured in this planning; None for a model outside the owned forward."""
    if refusal(policy) is not None:
        return None
    rows = tuple(value for value in ROWS if value <= max(1, most_rows)) or (1,)
    dtype_name = str(dtype).removeprefix("torch.")
    shared = {point: ms for point, ms in (shared_ms or {}).items() if point[0] in rows and point[1] in TOKENS}
    key = {
        "format": MEASUREMENT_FORMAT,
        **machine_key(next(policy.parameters()).device),
        "model": model_key(policy, linear_plan),
        "drafter": model_key(drafter, None) if drafter is not None else None,
        "dtype": dtype_name,
        "rows": list(rows),
        "tokens": list(TOKENS),
        "shared_ms": [[*point, ms] for point, ms in sorted(shared.items())],
    }

    def measure() -> dict:
        return measure_pass_costs(policy, drafter, dtype, linear_plan, rows, shared_ms=shared).to_dict()

    record, _ = cached_record(cache_dir, CACHE_FOLDER, key, measure, valid_record)
    return PassCosts.from_dict(record)


def valid_record(record: dict) -> bool:
    """Whether a stored record holds the grid its key names, in its key's dtype, with a time in range at every
    point (PassCosts.from_dict's checks); anything it raises on counts as damage too (tlt_cli/tuning/cache.py)."""
    costs = PassCosts.from_dict(record)
    key = record["key"]
    drafter_entries = DRAFTER_ENTRIES if key.get("drafter") is not None else ()
    return (
        list(costs.rows) == key.get("rows")
        and list(costs.tokens) == key.get("tokens")
        and costs.drafter_entries == drafter_entries
        and costs.dtype == key.get("dtype")
    )


def measure_pass_costs(
    policy: nn.Module,
    drafter: nn.Module | None,
    dtype: torch.dtype,
    linear_plan: LinearFormPlan | None,
    rows: tuple[int, ...] = ROWS,
    tokens: tuple[int, ...] = TOKENS,
    most_rounds: int = MOST_ROUNDS,
    shared_ms: dict[tuple[int, int], float] | None = None,
) -> PassCosts:
    """Time the grid (see the module docstring), each point's stable median of at most `most_rounds` rounds; the
    points of `shared_ms` ((rows, tokens) -> milliseconds) are taken as they are."""
    shared_ms = shared_ms or {}
    device = next(policy.parameters()).device
    model = decode_model_for(policy, dtype=dtype, linear_plan=linear_plan)
    prefix = random_prefix(policy, max(rows), PREFIX_TOKENS)
    timers = {
        (row_count, token_count): pass_timer(run, device)
        for row_count in rows
        for token_count, run in _unshared_passes(model, prefix, row_count, tokens, shared_ms).items()
    }
    entries = DRAFTER_ENTRIES if drafter is not None else ()
    timers |= {("drafter", count): pass_timer(_drafter_pass(drafter, count), device) for count in entries}
    medians, _ = stable_medians(timers, most_rounds=most_rounds)
    model.release()
    figures = {point: round(ms, 4) for point, ms in medians.items()} | shared_ms
    target_ms = tuple(tuple(figures[row_count, token_count] for token_count in tokens) for row_count in rows)
    drafter_ms = tuple(figures["drafter", count] for count in entries)
    return PassCosts(rows, tokens, target_ms, entries, drafter_ms, str(dtype).removeprefix("torch."))


def _unshared_passes(
    model, prefix: torch.Tensor, rows: int, tokens: tuple[int, ...], shared_ms: dict[tuple[int, int], float]
) -> dict[int, Callable[[], None]]:
    """The target's passes at `rows` rows for each of `tokens` not in `shared_ms`, over one prefill (timing.py)."""
    unshared = tuple(token_count for token_count in tokens if (rows, token_count) not in shared_ms)
    return block_passes(model, prefix, rows, unshared) if unshared else {}


def _drafter_pass(drafter: nn.Module, entries: int):
    """One drafter forward over `entries` rows of one entry each, past a PREFIX_TOKENS prefix in its own cache."""
    parameter = next(drafter.parameters())
    device, dtype = parameter.device, parameter.dtype
    hidden_size = drafter.config.hidden_size
    cache = SlotCache(entries, PREFIX_TOKENS + 1)
    lengths = torch.full((entries,), PREFIX_TOKENS, dtype=torch.long, device=device)
    with torch.no_grad():
        prefix_positions = torch.arange(PREFIX_TOKENS, device=device).expand(entries, PREFIX_TOKENS)
        cache.prepare(prefix_positions, PREFIX_TOKENS)
        causal = torch.ones(PREFIX_TOKENS, PREFIX_TOKENS, dtype=torch.bool, device=device).tril()
        drafter(
            torch.zeros(entries, PREFIX_TOKENS, dtype=torch.long, device=device),
            torch.zeros(entries, PREFIX_TOKENS, hidden_size, dtype=dtype, device=device),
            prefix_positions,
            block_attention_mask(torch.zeros_like(lengths), causal, PREFIX_TOKENS),
            cache,
        )
    token_ids = torch.zeros(entries, 1, dtype=torch.long, device=device)
    target_hidden = torch.zeros(entries, 1, hidden_size, dtype=dtype, device=device)
    positions = lengths[:, None]
    mask = block_attention_mask(lengths, torch.ones(1, 1, dtype=torch.bool, device=device), PREFIX_TOKENS + 1)

    def run() -> None:
        with torch.no_grad():
            cache.prepare(positions, PREFIX_TOKENS + 1)
            drafter(token_ids, target_hidden, positions, mask, cache)

    return run
