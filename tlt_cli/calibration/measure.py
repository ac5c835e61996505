"""Timed windows of decode steps at a fixed running batch size: emitted tokens per second and accept length.

`measure_grid(pair, batch_sizes, configs, ...)` runs, for every batch size B and every repeat, one
window per configuration in turn (so load on a shared machine hits all of them alike): B requests
go through the embedded engine with that configuration fixed ('off' is plain decoding steps inside
the same speculative decoder, as the adaptive engine runs them); `warmup_steps` decode steps run
untimed, then `timed_steps` are timed from the start of the first to the start of the step after
the last, so the engine's own bookkeeping counts too. The engine is given no end token and a token
budget the window cannot exhaust, so no row leaves and the running batch stays at B throughout:
rows that reach EOS inside the window keep decoding past it. `prompts_by_response_length` orders a
shard's prompts by how long their responses naturally run, so a window at batch size B can use the
rows a rollout's tail is made of, which are long enough that the window stays inside real response
text. Accept length is tokens emitted per row per decode step (1.0 for off).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tlt_cli.rollout.engine import EmbeddedEngine
from tlt_cli.rollout.speculative import SpeculativeDecoder
from tlt_cli.rollout.types import RolloutRequest, SamplingParams, SpeculativeConfig

# a token id the model never emits: rows do not end at EOS inside a window
NO_END_TOKEN = -1


@dataclass(frozen=True)
class ModelPair:
    """The target and its drafter on one device, with the ids the engine needs."""

    target: nn.Module
    drafter: nn.Module
    pad_token_id: int
    eos_token_id: int
    device: torch.device


@dataclass(frozen=True)
class Window:
    """One timed window: `decode_steps` steps over `batch_size` rows emitted `tokens` in `seconds`."""

    decode_steps: int
    batch_size: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def accept_length(self) -> float:
        return self.tokens / (self.decode_steps * self.batch_size)


@dataclass(frozen=True)
class Cell:
    """One (batch size, configuration) measured over its repeated windows."""

    batch_size: int
    label: str
    windows: tuple[Window, ...]

    @property
    def tokens_per_second(self) -> float:
        """Median over the repeats."""
        return statistics.median(window.tokens_per_second for window in self.windows)

    @property
    def spread(self) -> float:
        """(fastest - slowest) / median over the repeats."""
        rates = [window.tokens_per_second for window in self.windows]
        return (max(rates) - min(rates)) / self.tokens_per_second

    @property
    def accept_length(self) -> float:
        """Tokens per row per decode step over all repeats."""
        return sum(window.tokens for window in self.windows) / sum(window.decode_steps * window.batch_size for window in self.windows)


class WindowComplete(Exception):
    """Raised by the clock inside the engine's decode loop to end the generate call once the window is timed."""


class WindowClock(SpeculativeDecoder):
    """A speculative decoder fixed to one configuration (None: plain decoding) that times a window of steps."""

    def __init__(self, drafter: nn.Module, config: SpeculativeConfig | None, warmup_steps: int, timed_steps: int,
                 device: torch.device) -> None:
        super().__init__(drafter, lambda batch_size: config)
        self.warmup_steps, self.timed_steps, self.device = warmup_steps, timed_steps, device
        self.steps_started, self.tokens, self.batch_size = 0, 0, 0
        self.window_start, self.seconds = 0.0, 0.0

    def step(self, engine, batch, sampling, generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.steps_started == self.warmup_steps:
            self.window_start, self.batch_size = self._now(), batch.size
        if self.steps_started == self.warmup_steps + self.timed_steps:
            self.seconds = self._now() - self.window_start
            raise WindowComplete
        self.steps_started += 1
        emitted, counts = super().step(engine, batch, sampling, generator)
        if self.steps_started > self.warmup_steps:
            self.tokens += int(counts.sum())
        return emitted, counts

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def window(self) -> Window:
        if self.seconds == 0.0:
            raise RuntimeError(f"the decode window ended after {self.steps_started} steps, before its "
                               f"{self.warmup_steps + self.timed_steps} steps were timed.")
        return Window(self.timed_steps, self.batch_size, self.tokens, self.seconds)


def window_token_budget(warmup_steps: int, timed_steps: int, configs: dict[str, SpeculativeConfig | None]) -> int:
    """max_new_tokens no row can reach inside a window (a step emits at most steps + 1 tokens per row)."""
    deepest = max((config.steps for config in configs.values() if config is not None), default=0)
    return (warmup_steps + timed_steps + 1) * (deepest + 1) + 1


def time_window(pair: ModelPair, config: SpeculativeConfig | None, requests: list[RolloutRequest], sampling: SamplingParams,
                seed: int, warmup_steps: int, timed_steps: int) -> Window:
    """Decode `requests` (one running batch) with `config` fixed and time one window."""
    clock = WindowClock(pair.drafter, config, warmup_steps, timed_steps, pair.device)
    engine = EmbeddedEngine(pair.target, eos_token_id=NO_END_TOKEN, pad_token_id=pair.pad_token_id, speculative=clock)
    generator = torch.Generator(device=pair.device).manual_seed(seed)
    with contextlib.suppress(WindowComplete):
        engine.generate(requests, sampling, generator)
    return clock.window()


def prompts_by_response_length(pair: ModelPair, prompts: list[tuple[int, ...]], group_size: int,
                               sampling: SamplingParams, seed: int) -> list[tuple[int, ...]]:
    """One row per (prompt, sample), generated plainly to their natural end; their prompts, longest response first."""
    engine = EmbeddedEngine(pair.target, eos_token_id=pair.eos_token_id, pad_token_id=pair.pad_token_id)
    requests = [RolloutRequest(row, prompts[row // group_size]) for row in range(len(prompts) * group_size)]
    completions = engine.generate(requests, sampling, torch.Generator(device=pair.device).manual_seed(seed))
    ordered = sorted(completions, key=lambda completion: (-len(completion.response_ids), completion.request_id))
    return [prompts[completion.request_id // group_size] for completion in ordered]


def measure_grid(pair: ModelPair, batch_sizes: list[int], configs: dict[str, SpeculativeConfig | None],
                 requests_for: Callable[[int, int], list[RolloutRequest]], sampling: SamplingParams, seed: int,
                 warmup_steps: int, timed_steps: int, repeats: int,
                 on_window: Callable[[int, str, int], None] | None = None) -> list[Cell]:
    """Cells for every batch size and configuration; requests_for(batch_size, repeat) gives each repeat's batch."""
    cells = []
    for batch_size in batch_sizes:
        windows: dict[str, list[Window]] = {label: [] for label in configs}
        for repeat in range(repeats):
            requests = requests_for(batch_size, repeat)
            for label, config in configs.items():
                if on_window is not None:
                    on_window(batch_size, label, repeat)
                windows[label].append(time_window(pair, config, requests, sampling, seed + repeat, warmup_steps, timed_steps))
        cells += [Cell(batch_size, label, tuple(windows[label])) for label in configs]
    return cells
