"""A fault-injection plugin for benchmarks: the drafter goes bad mid-run, as after a broken weight sync.

    tlt train recipes/tiny-cpu.yaml speculative.mode=adaptive plugins.enabled=[drafter_faults:CorruptDrafter]

(with this folder on PYTHONPATH). At the start of RL step FAULT_STEP every worker overwrites its
drafter's own weights (not the shared target embedding and head) with seeded noise, so its drafts
are garbage from then on and the adaptive engine must notice the collapse and turn SD off.
"""

from __future__ import annotations

from typing import Any

import torch

FAULT_STEP = 10
NOISE_SCALE = 0.5


class CorruptDrafter:
    """Replaces the drafter's weights with noise at the rollout start of step FAULT_STEP."""

    name = "corrupt_drafter"

    def __init__(self, recipe: Any, step: int = FAULT_STEP, seed: int = 0):
        self.step, self.seed = step, seed

    def on_rollout_start(self, context: Any) -> None:
        if context.step != self.step or context.drafter is None:
            return
        generator = torch.Generator().manual_seed(self.seed + context.worker)
        with torch.no_grad():
            for parameter in context.drafter.parameters():
                noise = torch.randn(parameter.shape, generator=generator) * NOISE_SCALE
                parameter.copy_(noise.to(parameter.dtype))
