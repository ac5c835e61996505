"""Natural rollouts timed step by step: emitted tokens per second and accept length by running batch size.

`measure_shards(pair, grid, configs, requests_for, ...)` generates, for every repeat, one worker
shard to its natural end with each configuration fixed in turn (so load on a shared machine hits
all of them alike; 'off' is plain decoding steps inside the same speculative decoder, as the
adaptive engine runs them). The running batch shrinks as responses end, exactly as in training,
and every decode step is attributed to the bucket of its running batch size: the largest grid
size not above it (the smallest for a batch below the grid). A cell is one (bucket, configuration):
its response tokens and seconds summed over the repeats. So each configuration is judged on the
tokens a rollout really decodes at that batch size: the first, easy tokens of every response
while the batch is large, the long responses' later tokens in the tail.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.model_pair import ModelPair, fixed_decoder, shard_engine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig


@dataclass(frozen=True)
class ShardTotals:
    """What one shard's decode steps in one bucket added up to (row_steps: running rows summed over its steps)."""

    decode_steps: int
    row_steps: int
    tokens: int
    seconds: float


@dataclass(frozen=True)
class Cell:
    """One (bucket, configuration) over its repeated shards; `batch_size` is the bucket's grid size."""

    batch_size: int
    label: str
    shards: tuple[ShardTotals, ...]

    @property
    def decode_steps(self) -> int:
        return sum(shard.decode_steps for shard in self.shards)

    @property
    def tokens_per_second(self) -> float:
        """All the bucket's tokens over all its seconds (0.0 when no step ran there)."""
        seconds = sum(shard.seconds for shard in self.shards)
        return sum(shard.tokens for shard in self.shards) / seconds if seconds > 0 else 0.0

    @property
    def spread(self) -> float:
        """(fastest - slowest) / median of the shards' own rates, over the shards with steps here."""
        rates = [shard.tokens / shard.seconds for shard in self.shards if shard.decode_steps > 0 and shard.seconds > 0]
        return (max(rates) - min(rates)) / statistics.median(rates) if rates else 0.0

    @property
    def accept_length(self) -> float:
        """Tokens per running row per decode step."""
        row_steps = sum(shard.row_steps for shard in self.shards)
        return sum(shard.tokens for shard in self.shards) / row_steps if row_steps else 0.0


def bucket_of(batch_size: int, grid: list[int]) -> int:
    """The grid size that owns `batch_size`: the largest not above it, else the smallest."""
    index = bisect.bisect_right(grid, batch_size) - 1
    return grid[max(index, 0)]


def bucket_totals(steps: list[DecodeStep], grid: list[int]) -> dict[int, ShardTotals]:
    """One shard's steps summed per bucket of the (sorted) grid; every grid size appears."""
    sums = {size: [0, 0, 0, 0.0] for size in grid}
    for step in steps:
        totals = sums[bucket_of(step.batch_size, grid)]
        totals[0] += 1
        totals[1] += step.batch_size
        totals[2] += step.tokens
        totals[3] += step.seconds
    return {size: ShardTotals(*totals) for size, totals in sums.items()}


def time_shard(
    pair: ModelPair, decoder: SpeculativeDecoder, requests: list[RolloutRequest], sampling: SamplingParams, seed: int
) -> list[DecodeStep]:
    """Generate `requests` to their natural end with `decoder`; each decode step's record."""
    steps: list[DecodeStep] = []
    shard_engine(pair, decoder).generate(
        requests, sampling, torch.Generator(device=pair.device).manual_seed(seed), on_decode_step=steps.append
    )
    return steps


def measure_shards(
    pair: ModelPair,
    grid: list[int],
    configs: dict[str, SpeculativeConfig | None],
    requests_for: Callable[[int], list[RolloutRequest]],
    sampling: SamplingParams,
    seed: int,
    repeats: int,
    on_shard: Callable[[str, int], None] | None = None,
) -> list[Cell]:
    """Cells for every grid size and configuration; requests_for(repeat) gives each repeat's shard."""
    grid = sorted(grid)
    totals: dict[str, list[dict[int, ShardTotals]]] = {label: [] for label in configs}
    for repeat in range(repeats):
        requests = requests_for(repeat)
        for label, config in configs.items():
            if on_shard is not None:
                on_shard(label, repeat)
            steps = time_shard(pair, fixed_decoder(pair, config), requests, sampling, seed + repeat)
            totals[label].append(bucket_totals(steps, grid))
    return [Cell(size, label, tuple(shard[size] for shard in totals[label])) for size in grid for label in configs]
