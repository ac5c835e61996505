"""Whether a run needs a drafter, from its recipe: the one rule setup.py (and the memory estimate) ask.

A rollout needs a drafter when it speculates (any `speculative.mode` but off) or when a plugin it enables trains
one (the drafter sidecar). Apart from setup.py so that training/memory.py can ask without importing the
composition root (setup -> update_precision -> memory would come back to setup).
"""

from __future__ import annotations

from tlt_cli.config import Recipe, SpeculativeSection
from tlt_cli.plugins import plugins_train_drafter
from tlt_cli.speculative.plan import SpeculationMode


def speculation_mode(section: SpeculativeSection) -> SpeculationMode:
    """The section's `mode` as a plan carries it."""
    return SpeculationMode(section.mode.value)


def rollout_needs_drafter(mode: SpeculationMode, drafter_trained: bool) -> bool:
    """The one rule: a rollout needs a drafter when it speculates, or when something trains one."""
    return mode != SpeculationMode.off or drafter_trained


def drafter_needed(recipe: Recipe) -> bool:
    """Whether the recipe's run needs a drafter: it speculates, or a plugin it enables trains one."""
    return rollout_needs_drafter(speculation_mode(recipe.speculative), plugins_train_drafter(recipe.plugins.enabled))
