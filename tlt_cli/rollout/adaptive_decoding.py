"""Speculative decoding steered by an `AdaptiveSchedule`: each decode step is timed and reported back.

The embedded engine calls `step` once per decode step exactly as for a `SpeculativeDecoder`;
this subclass asks the schedule for the step's configuration (through the decoder's own
schedule hook), times the step, and tells the schedule how many tokens the step emitted, how
many rows verified a draft and how long it took. Outputs are unchanged: the schedule only
chooses among lossless configurations (or plain decoding).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from tlt_cli.adaptive import AdaptiveSchedule
from tlt_cli.rollout.speculative import SpeculativeDecoder


class AdaptiveSpeculativeDecoder(SpeculativeDecoder):
    """A SpeculativeDecoder whose configuration comes from, and whose steps feed, an AdaptiveSchedule."""

    def __init__(self, drafter: nn.Module, schedule: AdaptiveSchedule) -> None:
        super().__init__(drafter, schedule)
        self.adaptive_schedule = schedule

    def step(self, engine, batch, sampling, generator) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = batch.size
        started = time.perf_counter()
        emitted, counts = super().step(engine, batch, sampling, generator)
        seconds = time.perf_counter() - started
        speculated = self.adaptive_schedule.last_config is not None
        self.adaptive_schedule.observe(int(counts.sum()), batch_size if speculated else 0, seconds)
        return emitted, counts
