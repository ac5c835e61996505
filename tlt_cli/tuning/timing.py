"""Timing the decode model's passes the way a rollout makes them, for the per-machine measurements of tuning/.

`block_passes(model, prefix, rows, token_counts)` prefills `rows` rows of `prefix` once into a fresh cache of the
decode model (tlt_cli/engine) and returns, per count of `token_counts`, a call that runs one pass of that many tokens
per row past it, logits included (a plain decode step at 1 token, a verify pass above); repeating a call measures
the same pass, since it writes past the prefix each time. `milliseconds(run, repeats)` is the process CPU time of
one call (time this process computed, not time it waited for a core on a loaded machine), `repeats_for(run)` how
many back-to-back calls last about SHORTEST_TIMING_MS. `stable_medians(timers)` repeats a set of timings in
interleaved rounds, each one until its median over its rounds so far agrees with its median a round earlier within
STABLE_TOLERANCE (at least LEAST_ROUNDS rounds, at most MOST_ROUNDS): a figure is measured until it stops moving,
not a fixed number of times, and one that settled is not timed on while others settle (figures compared with each
other settle together).
tuning/precision.py (float32 against bfloat16) and tuning/pass_costs.py (the adaptive engine's grid of rows x
tokens) time with these.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TypeVar

import torch

# each timing repeats its pass until it lasts about this long (CPU milliseconds)
SHORTEST_TIMING_MS = 20.0
CPU = torch.device("cpu")
# a figure is stable when its median over its rounds moved by at most this share in its latest round
STABLE_TOLERANCE = 0.03
# the rounds every figure is timed at least (a median of two is their mean) and at most (a machine never settling)
LEAST_ROUNDS = 3
MOST_ROUNDS = 9

Key = TypeVar("Key", bound=Hashable)


def random_prefix(policy: torch.nn.Module, rows: int, tokens: int) -> torch.Tensor:
    """[rows, tokens] random token ids of `policy`'s vocabulary on its device (seeded: every measurement alike)."""
    device = next(policy.parameters()).device
    vocabulary = policy.get_input_embeddings().weight.shape[0]
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randint(vocabulary, (rows, tokens), generator=generator, device=device)


def block_passes(
    model, prefix: torch.Tensor, rows: int, token_counts: tuple[int, ...]
) -> dict[int, Callable[[], None]]:
    """Per count in `token_counts`, one pass of that many tokens for each of `rows` rows over one prefilled prefix
    (see the module docstring): the prefix is prefilled once, into a cache that holds the longest block past it;
    prefix: [at least rows, prefix tokens] token ids."""
    device = prefix.device
    prefix_tokens = prefix.shape[1]
    cache = model.new_cache(rows, prefix_tokens + max(token_counts))
    positions = torch.arange(prefix_tokens, device=device).expand(rows, prefix_tokens)
    causal = torch.ones(prefix_tokens, prefix_tokens, dtype=torch.bool, device=device).tril()
    with torch.no_grad():
        model.forward_block(cache, prefix[:rows], positions, positions, prefix_tokens, causal.expand(rows, 1, -1, -1))
    return {tokens: _pass_past_prefix(model, cache, prefix[:rows], tokens) for tokens in token_counts}


def _pass_past_prefix(model, cache, prefix: torch.Tensor, tokens: int) -> Callable[[], None]:
    """One pass of `tokens` tokens per row of `cache`, written past its prefilled `prefix` ([rows, prefix tokens])
    and attending to it; each call writes the same slots, so it measures the same pass."""
    device = prefix.device
    rows, prefix_tokens = prefix.shape
    kv_length = prefix_tokens + tokens
    visible = torch.ones(tokens, kv_length, dtype=torch.bool, device=device)
    visible[:, prefix_tokens:] = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    visible = visible.expand(rows, 1, -1, -1)
    block_positions = (prefix_tokens + torch.arange(tokens, device=device)).expand(rows, tokens)
    block_ids = prefix[:, :tokens]

    def run() -> None:
        with torch.no_grad():
            hidden = model.forward_block(cache, block_ids, block_positions, block_positions, kv_length, visible)
            model.logits(hidden)

    return run


def milliseconds(run: Callable[[], None], repeats: int, device: torch.device = CPU) -> float:
    """Milliseconds of one `run()`, averaged over `repeats` back-to-back calls: process CPU time on a CPU, wall
    time between synchronisations on a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - started) * 1e3 / repeats
    started = time.process_time()
    for _ in range(repeats):
        run()
    return (time.process_time() - started) * 1e3 / repeats


def repeats_for(run: Callable[[], None], device: torch.device = CPU) -> int:
    """How many back-to-back calls of `run` last about SHORTEST_TIMING_MS (tiny models' passes take microseconds)."""
    once = milliseconds(run, 1, device)
    return max(1, math.ceil(SHORTEST_TIMING_MS / max(once, 1e-3)))


def pass_timer(run: Callable[[], None], device: torch.device = CPU) -> Callable[[], float]:
    """A timer of `run` for `stable_medians`: the milliseconds of one call, over `repeats_for(run)` calls."""
    repeats = repeats_for(run, device)
    return lambda: milliseconds(run, repeats, device)


def stable_medians(
    timers: Mapping[Key, Callable[[], float]],
    tolerance: float = STABLE_TOLERANCE,
    least_rounds: int = LEAST_ROUNDS,
    most_rounds: int = MOST_ROUNDS,
    compared: Callable[[Key], Hashable] = lambda key: key,
) -> tuple[dict[Key, float], dict[Key, int]]:
    """(each timer's median milliseconds, the rounds it was timed): every round calls each timer still timed once
    (interleaved, so a change of load falls on all of them alike), and a timer is timed until its median agrees with
    its median of one round earlier within `tolerance` (relative), from `least_rounds` (at most `most_rounds`) to
    `most_rounds` rounds. Timers whose figures are compared with each other (the same `compared(key)`: one pass in
    two dtypes) go on together until every one of them is stable, so they are timed in the same rounds."""
    samples: dict[Key, list[float]] = {key: [] for key in timers}
    timed = set(timers)
    rounds: dict[Key, int] = {}
    least_rounds = min(least_rounds, most_rounds)
    for round_count in range(1, most_rounds + 1):
        for key, timer in timers.items():
            if key in timed:
                samples[key].append(timer())
        unstable = {compared(key) for key in timed if not _stable(samples[key], tolerance, least_rounds)}
        for key in list(timed):
            if round_count == most_rounds or compared(key) not in unstable:
                timed.discard(key)
                rounds[key] = round_count
        if not timed:
            break
    return {key: statistics.median(values) for key, values in samples.items()}, rounds


def _stable(values: list[float], tolerance: float, least_rounds: int) -> bool:
    """Whether `values` has at least `least_rounds` (and two) samples and its median moved by at most `tolerance`
    in its latest one."""
    if len(values) < max(2, least_rounds):
        return False
    return _agree(statistics.median(values[:-1]), statistics.median(values), tolerance)


def _agree(before: float, after: float, tolerance: float) -> bool:
    """Whether two medians differ by at most `tolerance` of the larger."""
    return abs(after - before) <= tolerance * max(abs(before), abs(after))
