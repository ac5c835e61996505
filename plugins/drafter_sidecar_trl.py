"""The drafter sidecar in a data-parallel TRL run: the drafter trains while this process waits.

Under TRL with several processes (accelerate, DDP or ZeRO), each process's `rollout_func` decodes
its own shard, then would sit in TRL's next collective until the slowest process is done.
`TrlSidecar.after_rollout` runs at the end of each rollout, on every process:
  1. keeps this shard's completions with the target hidden states the engine produced while
     decoding them (no forward over the responses);
  2. waits for the other processes (tlt_cli/integrations/process_wait.py) and, in that wait, runs
     short units of work, checking between units whether everyone is done: first turning kept
     completions into drafter features (one no-grad forward over the prompts of a few sequences
     adds the prompt states), then drafter training steps (drafter_sidecar.py's
     `on_worker_idle`: EAGLE losses, a window of recent rollouts);
  3. averages the processes' drafter copies, weighted by the steps each took (the sidecar's
     `on_rollout_end`, as in tlt's own trainer).
A unit of work never starts after the wait is over, so the step is delayed by at most one unit.
In a single-process run there is no such wait, and tlt_cli/integrations/trl.py does not build one;
it builds one through `DrafterSidecar.trl_process_sidecar`, never by this module's name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_cli.drafter.warmup import prompt_hidden_states
from tlt_cli.integrations.process_wait import wait_for_other_processes
from tlt_cli.integrations.trl_support import policy_in_eval_mode
from tlt_cli.plugins import StepContext
from tlt_cli.rollout.types import Completion

# sequences per feature unit (one prompt forward, one stored micro-batch for the sidecar to draw from)
FEATURE_ROWS = 8
# the wait's share of the step record: seconds between this process's last completion and everyone's
IDLE_SECONDS_METRIC = "idle_seconds"


@dataclass
class SequenceBatch:
    """The sequence view of a few completions that the sidecar's `on_hidden_states` reads."""

    input_ids: torch.Tensor  # [B, L] prompt + response ids, right-padded
    response_mask: torch.Tensor  # [B, L] bool
    attention_mask: torch.Tensor  # [B, L] bool


class TrlSidecar:
    """The drafter sidecar driven from TRL's rollout_func (see the module docstring)."""

    def __init__(
        self,
        plugin: Any,
        policy: nn.Module,
        drafter: nn.Module,
        process: int,
        processes: int,
        device: torch.device,
        pad_token_id: int,
    ) -> None:
        self.policy, self.drafter, self.device, self.pad_token_id = policy, drafter, device, pad_token_id
        self.process, self.processes = process, processes
        # the DrafterSidecar it drives (built by DrafterSidecar.trl_process_sidecar: this module never names it)
        self.plugin = plugin
        # (rollout number, completions) not yet turned into features, oldest first
        self.pending: list[tuple[int, list[Completion]]] = []
        # time.time() when the last wait ended: every process had finished its rollout
        self.wait_end = 0.0

    def after_rollout(self, rollout: int, completions: list[Completion]) -> dict[str, float]:
        """Train in the wait for the other processes, then average the drafters; the step's metrics."""
        context = self._context(rollout)
        self.plugin.on_rollout_start(context)
        # sorted by length, so each unit's sequences pad little (as the actor's micro-batches are)
        self.pending.append((rollout, sorted(completions, key=_sequence_length)))
        busy_end = time.time()
        wait_for_other_processes(self.device, lambda rollout_over: self._idle(context, rollout_over))
        self.wait_end = time.time()
        idle_seconds = self.wait_end - busy_end
        self.plugin.on_rollout_end(context)
        return {**context.metrics, IDLE_SECONDS_METRIC: idle_seconds}

    def _context(self, rollout: int) -> StepContext:
        return StepContext(
            step=rollout,
            worker=self.process,
            world_size=self.processes,
            engine=None,
            policy=self.policy,
            drafter=self.drafter,
        )

    def _idle(self, context: StepContext, rollout_over) -> None:
        """Features first (oldest rollout first, a few sequences per unit), then drafter steps."""
        window = self.plugin.settings.window_steps
        self.pending = [(rollout, kept) for rollout, kept in self.pending if rollout > context.step - window]
        while self.pending and not rollout_over():
            rollout, kept = self.pending[0]
            chunk, rest = kept[:FEATURE_ROWS], kept[FEATURE_ROWS:]
            self.pending[0] = (rollout, rest)
            if not rest:
                self.pending.pop(0)
            self._add_features(self._context(rollout), chunk)
        self.plugin.on_worker_idle(context, rollout_over)

    def _add_features(self, context: StepContext, completions: list[Completion]) -> None:
        with policy_in_eval_mode(self.policy):
            prompt_states = prompt_hidden_states(self.policy, [completion.prompt_ids for completion in completions])
        batch, hidden = sequence_batch(completions, prompt_states, self.pad_token_id)
        self.plugin.on_hidden_states(context, batch, hidden)

    def save_state(self, directory: Path) -> None:
        """The sidecar's state (drafter_sidecar/rank-<process>.pt) and, on process 0, the drafter (drafter/)."""
        self.plugin.on_checkpoint_save(directory)

    def load_state(self, directory: Path) -> None:
        self.plugin.on_checkpoint_load(directory)


def _sequence_length(completion: Completion) -> int:
    return len(completion.prompt_ids) + len(completion.response_ids)


def sequence_batch(
    completions: list[Completion], prompt_states: list[torch.Tensor], pad_token_id: int
) -> tuple[SequenceBatch, torch.Tensor]:
    """Right-padded sequences and their target hidden states [B, L, H]: the prompt's up to position
    P-2, then the engine's from P-1 (the state that produced each response token); the last
    token's own state is never read by a feature that counts, so it stays zero."""
    length = max(len(completion.prompt_ids) + len(completion.response_ids) for completion in completions)
    reference = prompt_states[0]
    input_ids = torch.full((len(completions), length), pad_token_id, dtype=torch.long, device=reference.device)
    hidden = reference.new_zeros((len(completions), length, reference.shape[-1]))
    response_mask = torch.zeros((len(completions), length), dtype=torch.bool, device=reference.device)
    attention_mask = torch.zeros_like(response_mask)
    for row, (completion, prompt_state) in enumerate(zip(completions, prompt_states)):
        prompt_length, end = len(completion.prompt_ids), len(completion.prompt_ids) + len(completion.response_ids)
        input_ids[row, :end] = torch.tensor([*completion.prompt_ids, *completion.response_ids], device=input_ids.device)
        hidden[row, : prompt_length - 1] = prompt_state[: prompt_length - 1]
        hidden[row, prompt_length - 1 : end - 1] = completion.target_hidden[: end - prompt_length].to(hidden.dtype)
        response_mask[row, prompt_length:end] = True
        attention_mask[row, :end] = True
    return SequenceBatch(input_ids, response_mask, attention_mask), hidden
