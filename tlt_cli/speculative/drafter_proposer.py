"""The drafter as a draft source: its own cache, its catch-up on committed positions, chain and tree drafts.

The speculative decoder (tlt_cli/speculative/decoder.py) keeps one `DrafterProposer(drafter)` (anything
with `EagleDrafter`'s forward, `config.hidden_size`, `vocabulary` and `refresh_draft_head`) behind the
`Proposer` hooks (tlt_cli/speculative/proposer.py). At an SD step that drafts with the model, `propose`:
  1. catches up: the drafter reads the committed positions it has not seen (the prompt, and tokens of
     plain or model-free steps) from the target hidden states the engine keeps in its cache;
  2. drafts: runs the drafter `steps` times from each row's root state, building a chain or a tree
     (tlt_cli/speculative/tree.py) in its own `SlotCache`; its logits cover its draft vocabulary (N
     tokens, possibly fewer than the target's) and drafted ids are mapped to target ids.
After the commit (`after_commit`) it reads the target's true hidden states for the kept tokens and
takes the next root state off them; a step it did not draft for leaves it behind, to catch up later.

Positions follow tlt_cli/drafter/trainer.py: drafter entry t reads (token[t+1], target_hidden[t]) at
position t, so the drafter cache holds exactly as many entries as the target cache after every
commit, and the entry of the last committed position yields the root's prediction of the first
drafted token. Rejected entries sit past the row's committed length and are overwritten later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tlt_cli.engine.kv_cache import SlotCache, block_attention_mask, keep_rows_of
from tlt_cli.engine.linear_forms import FormedCopy, LinearFormPlan
from tlt_cli.speculative.tree import ChainBuilder, DraftTree, TreeBuilder, gather_rows
from tlt_cli.speculative.types import DRAFTER_SOURCE

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tlt_cli.engine.running_batch import RunningBatch
    from tlt_cli.engine.sampling import SamplingParams
    from tlt_cli.speculative.proposer import Commit, GroupedPrompt
    from tlt_cli.speculative.types import SpeculativeConfig


@dataclass
class DrafterRows:
    """The drafter's state for the rows of the running batch (B rows, in its order; every tensor field
    is per-row, and `keep_rows_of` selects them all and the drafter cache's rows)."""

    cache: SlotCache  # the drafter's own cache
    drafter_lengths: torch.Tensor  # [B] committed drafter entries (lags the target after plain steps)
    root_hidden: torch.Tensor  # [B, H] drafter hidden of the last committed entry
    root_logits: torch.Tensor  # [B, N] its logits over the draft vocabulary: the first drafted token's

    @classmethod
    def empty(
        cls,
        batch_size: int,
        capacity: int,
        hidden_size: int,
        draft_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DrafterRows:
        """Fresh rows: an empty drafter cache of `capacity` slots, no entries, zero root states."""
        return cls(
            cache=SlotCache(batch_size, capacity),
            drafter_lengths=torch.zeros(batch_size, dtype=torch.long, device=device),
            root_hidden=torch.zeros(batch_size, hidden_size, dtype=dtype, device=device),
            root_logits=torch.zeros(batch_size, draft_vocab_size, dtype=dtype, device=device),
        )


class DrafterProposer:
    """Drafts chains and trees with `drafter` (see the module docstring)."""

    source = DRAFTER_SOURCE

    def __init__(self, drafter: nn.Module) -> None:
        self.drafter = drafter
        # the drafter's decode-time copy computing in the measured linear forms (use_linear_plan), or None
        self.forms: FormedCopy | None = None
        self.rows = DrafterRows.empty(0, 0, 0, 0, torch.float32, torch.device("cpu"))

    def use_linear_plan(self, plan: LinearFormPlan) -> None:
        """Draft through a decode-time copy of the drafter whose linear layers compute in the plan's forms
        (tlt_cli/engine/linear_forms.py); the drafter the trainer updates is left as it is."""
        self.forms = FormedCopy(self.drafter, plan)

    @property
    def drafting(self) -> nn.Module:
        """The module that drafts: the drafter's formed copy, else the drafter."""
        return self.forms.module if self.forms is not None else self.drafter

    def begin(self, batch: RunningBatch, requests: Sequence[GroupedPrompt]) -> None:
        """The drafter's head (and its formed copy's transposed weights) re-read from the target and drafter,
        whose weights may have changed since the last call, and an empty drafter cache: the drafter reads the
        prompt at the first SD step, from the target hidden states the engine keeps."""
        if self.forms is not None:
            self.forms.refresh()  # a few MiB: cheaper than tracking every way the drafter is updated
        self.drafting.refresh_draft_head()
        self.rows = DrafterRows.empty(
            batch.size,
            batch.cache.capacity,
            self.drafter.config.hidden_size,
            self.drafter.vocabulary.size,
            next(self.drafter.parameters()).dtype,
            batch.lengths.device,
        )

    def propose(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> DraftTree:
        """Catch up on the committed positions not yet read, then draft the chain or tree of `config`."""
        self._catch_up(batch)
        return self._draft(batch, config, sampling, generator)

    def after_commit(self, batch: RunningBatch, commit: Commit) -> None:
        """The drafter catches up on the kept tokens and the next root state is read off it."""
        accept_length, path = commit.verdict.accept_length, commit.verdict.path
        offsets = torch.arange(path.shape[1], device=path.device)
        caught_up = int(accept_length.max()) + 1
        # drafter catch-up: entry at position lengths + j pairs target_hidden there with emitted[j]
        path_hidden = gather_rows(commit.target_hidden, path[:, :caught_up])
        positions = commit.lengths[:, None] + offsets[None, :caught_up]
        causal = torch.ones(caught_up, caught_up, dtype=torch.bool, device=path.device).tril()
        output = self._run_drafter(
            commit.emitted[:, :caught_up], path_hidden, commit.lengths, positions, causal, written=0
        )
        row_index = torch.arange(path.shape[0], device=path.device)
        self.rows.root_hidden = output.hidden[row_index, accept_length]
        self.rows.root_logits = output.logits[row_index, accept_length]
        self.rows.drafter_lengths = batch.lengths.clone()

    def keep_rows(self, batch: RunningBatch, rows: torch.Tensor) -> None:
        keep_rows_of(self.rows, rows)

    def lag_entries(self, batch: RunningBatch) -> int:
        """Entries the catch-up pass of the next model draft computes: rows x the widest row's unread positions."""
        return batch.size * max(int((batch.lengths - self.rows.drafter_lengths).max()), 0) if batch.size else 0

    def _catch_up(self, batch: RunningBatch) -> None:
        """Feed the drafter every committed position it has not seen (the prompt, and whatever
        plain steps decoded): entry t pairs the stored target hidden state at t with token t+1."""
        gap = batch.lengths - self.rows.drafter_lengths
        if not bool((gap > 0).any()):
            return
        width = int(gap.max())
        slots = self.rows.drafter_lengths[:, None] + torch.arange(width, device=gap.device)
        stored_hidden = batch.cache.extra[:, 0]
        hidden = gather_rows(stored_hidden, slots.clamp(max=stored_hidden.shape[1] - 1))
        # token t+1 of every position up to the pending token at lengths[b]
        next_token_ids = batch.tokens.gather(1, (slots + 1).clamp(max=batch.tokens.shape[1] - 1))
        causal = torch.ones(width, width, dtype=torch.bool, device=gap.device).tril()
        output = self._run_drafter(next_token_ids, hidden, self.rows.drafter_lengths, slots, causal, written=0)
        caught_up = gap > 0
        last_entry = (gap - 1).clamp(min=0)
        row_index = torch.arange(batch.size, device=gap.device)
        rows = self.rows
        rows.root_hidden = torch.where(caught_up[:, None], output.hidden[row_index, last_entry], rows.root_hidden)
        rows.root_logits = torch.where(caught_up[:, None], output.logits[row_index, last_entry], rows.root_logits)
        rows.drafter_lengths = batch.lengths.clone()

    def _draft(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> DraftTree:
        """Run the drafter `steps` times from each row's root, expanding the chain or tree."""
        vocabulary = self.drafter.vocabulary
        if config.is_chain:
            builder = ChainBuilder(batch.pending, config.steps, sampling, generator, vocabulary)
        else:
            builder = TreeBuilder(batch.pending, config.drafter_part, vocabulary)
        frontier_hidden, frontier_logits = self.rows.root_hidden[:, None], self.rows.root_logits[:, None]
        written = 0
        for step in range(config.steps):
            frontier = builder.expand(frontier_logits)
            if step == config.steps - 1:
                break
            # each node reads its parent's predicted hidden state, at the parent's position + 1
            parent_hidden = gather_rows(frontier_hidden, frontier.parent_slot)
            positions = (batch.lengths + step)[:, None].expand_as(frontier.tokens)
            output = self._run_drafter(
                frontier.tokens, parent_hidden, batch.lengths, positions, frontier.visible, written
            )
            frontier_hidden, frontier_logits = output.hidden, output.logits
            written += frontier.tokens.shape[1]
        return builder.finish()

    def _run_drafter(self, input_ids, target_hidden, lengths, positions, visible, written: int):
        """Drafter forward on entries written at slots lengths + written + [0, T), seeing the
        committed prefix and the region [lengths, lengths + written + T) as `visible` ([.., T, W]) says."""
        entries = input_ids.shape[1]
        write_slots = lengths[:, None] + written + torch.arange(entries, device=input_ids.device)
        kv_length = int(lengths.max()) + written + entries
        self.rows.cache.prepare(write_slots, kv_length)
        mask = block_attention_mask(lengths, visible, kv_length)
        return self.drafting(input_ids, target_hidden, positions, mask, self.rows.cache)
