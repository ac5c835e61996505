"""What a run does when its drafter diverges: reset it to fresh weights, or turn it off, the same on every rank.

The drafter is a helper: its logits going non-finite says nothing about the policy, so the run goes on. The
embedded engine's decoder finishes the rollout that met it without its drafts (speculative/decoder.py: the target
samples every token), and the rollout backend says so (`drafter_diverged`). After the rollout barrier every rank
of tlt_cli/training/worker_loop.py asks `DrafterWatch.after_rollout(step, diverged_here)`: one all_gather_object
makes the ranks' answers one, so each takes the same `DrafterAction`:
  - reset: the drafter gets fresh weights in place (`reset_in_place` from setup.py's `fresh_drafter`: the decoder
    and the sidecar hold the same module), the sidecar a fresh optimizer (its `on_drafter_reset` hook), and mode
    auto drafts n-grams until the new drafter pays (the rollout backend's `drafter_replaced`);
  - off: a drafter that diverges again within REPEAT_WINDOW_STEPS steps of its reset drafts no more this run
    (n-grams or plain decoding only), and the sidecar stops training it; its weights are reset all the same, so no
    checkpoint keeps the diverged ones.
The worker reports the action and its one line; the driver prints the line and writes the action to the step
record (`drafter_divergence`). A policy that diverges still stops the run (worker_loop.py `divergence`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tlt_cli.config import DrafterConfig

# the step record's `drafter_divergence` values
RESET_ACTION = "reset"
OFF_ACTION = "off"
# a drafter that diverges again within this many steps of its reset is turned off for the rest of the run
REPEAT_WINDOW_STEPS = 5


@dataclass(frozen=True)
class DrafterAction:
    """What the ranks agreed to do about a drafter that diverged in `step`'s rollout, and the line that says so."""

    step: int
    action: str  # RESET_ACTION or OFF_ACTION
    message: str

    @property
    def turned_off(self) -> bool:
        return self.action == OFF_ACTION


class DrafterWatch:
    """One rank's memory of the drafter's divergences: when it was last reset, and whether it is off."""

    def __init__(self, settings: DrafterConfig) -> None:
        self.settings = settings
        self.reset_step: int | None = None
        self.off = False

    def after_rollout(self, step: int, diverged_here: bool) -> DrafterAction | None:
        """The action every rank takes after `step`'s rollout (a collective: every rank calls it each step while
        the drafter is on), or None when the drafter diverged on no rank."""
        if self.off or not diverged_on_any_rank(diverged_here):
            return None
        cause = (
            f"step {step}: the drafter's logits are not finite, so the drafter diverged, not the policy (most likely "
            f"drafter.lr {self.settings.lr} or drafter.warmup_lr {self.settings.warmup_lr} is too high)"
        )
        if self.reset_step is not None and step - self.reset_step <= REPEAT_WINDOW_STEPS:
            self.off = True
            return DrafterAction(
                step,
                OFF_ACTION,
                f"{cause}; it diverged again {step - self.reset_step} steps after its reset, so the drafter is off "
                "for the rest of the run (SD drafts n-grams or decodes plainly); the policy trains on",
            )
        self.reset_step = step
        return DrafterAction(
            step,
            RESET_ACTION,
            f"{cause}; the rollout finished without its drafts, and the drafter starts again from fresh weights with "
            "a fresh optimizer (mode auto drafts n-grams until it pays); the policy trains on",
        )


def diverged_on_any_rank(diverged_here: bool) -> bool:
    """Whether the drafter diverged on any rank (one all_gather_object; this rank's answer when alone)."""
    if not torch.distributed.is_initialized():
        return diverged_here
    gathered: list[bool | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, diverged_here)
    return any(gathered)


def reset_in_place(drafter: nn.Module, fresh: nn.Module) -> None:
    """Give `drafter` the weights and draft vocabulary of `fresh` (another drafter of the same shapes), in place:
    every holder of the module (the decoder, its formed copy at its next call, the sidecar) sees the new drafter."""
    with torch.no_grad():
        fresh_parameters = dict(fresh.named_parameters())
        for name, parameter in drafter.named_parameters():
            parameter.copy_(fresh_parameters[name])
    if drafter.vocabulary.is_reduced:
        drafter.vocabulary.target_ids.copy_(fresh.vocabulary.target_ids)
        drafter.refresh_draft_head()
