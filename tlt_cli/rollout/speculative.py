"""Lossless speculative decoding inside the embedded engine: draft, verify, accept, commit.

`EmbeddedEngine(model, eos, pad, speculative=SpeculativeDecoder(drafter, SpeculativeConfig(...)))`
calls `begin` after the prefill and `step` once per decoding step. A step, for every running row
at once:
  1. draft: the drafter (anything with `EagleDrafter`'s forward) runs `steps` times from the row's
     root state, building a chain or a tree (tlt_cli/rollout/tree.py) in its own `SlotCache`;
  2. verify: the target runs once over the root and all drafted nodes, with the tree mask;
  3. accept: tlt_cli/rollout/acceptance.py keeps a prefix per row (ragged: each row keeps its own
     number of tokens) and draws the bonus token;
  4. commit: kept entries move into place in the target cache, the drafter catches up on the
     target's true hidden states for the kept tokens, and the next root state is read off it.
Rejected entries in either cache sit past the row's committed length and are simply overwritten
later. EOS and max_new_tokens inside an accepted run are cut by the engine, which ends the row.

Drafter positions follow tlt_cli/drafter/trainer.py: drafter entry t reads (token[t+1],
target_hidden[t]) at position t, so the drafter cache holds exactly as many entries as the target
cache after every commit, and the entry of the last committed position yields the root's
prediction of the first drafted token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tlt_cli.rollout.acceptance import Verdict, accept_chain, accept_tree
from tlt_cli.rollout.kv_cache import SlotCache, block_attention_mask
from tlt_cli.rollout.tree import ChainBuilder, DraftTree, TreeBuilder
from tlt_cli.rollout.types import SamplingParams, SpeculativeConfig, SpeculativeStats

if TYPE_CHECKING:
    from tlt_cli.rollout.engine import EmbeddedEngine, RunningBatch


def check_speculative_config(config: SpeculativeConfig, vocab_size: int) -> None:
    """Raise ValueError naming the field to fix when `config` cannot be drafted."""
    if config.steps < 1:
        raise ValueError(f"speculative steps is {config.steps}; set it to at least 1.")
    if not 1 <= config.topk <= vocab_size:
        raise ValueError(f"speculative topk is {config.topk}; set it between 1 and the vocabulary size {vocab_size}.")
    if config.is_chain:
        if config.draft_tokens not in (0, config.steps + 1):
            raise ValueError(
                f"a chain (topk 1) of {config.steps} steps verifies {config.steps + 1} tokens; "
                f"set draft_tokens to {config.steps + 1} or 0, not {config.draft_tokens}."
            )
        return
    candidates = config.topk + (config.steps - 1) * config.topk**2
    if not 2 <= config.verified_tokens <= candidates + 1:
        raise ValueError(
            f"speculative draft_tokens is {config.verified_tokens}; with steps {config.steps} and topk "
            f"{config.topk} set it between 2 and {candidates + 1}."
        )


class SpeculativeDecoder:
    """Drafts with `drafter` in the shape of `config` and verifies exactly (see the module docstring)."""

    def __init__(self, drafter: nn.Module, config: SpeculativeConfig) -> None:
        check_speculative_config(config, drafter.config.vocab_size)
        self.drafter = drafter
        self.config = config
        self.cache = SlotCache(0, 0)
        self.root_hidden = torch.zeros(0)  # [B, H] drafter hidden of the last committed entry
        self.root_logits = torch.zeros(0)  # [B, V] its logits: the first drafted token's distribution
        self.verify_passes = torch.zeros(0)  # [B]
        self.accepted_draft_tokens = torch.zeros(0)  # [B]
        self.accepted_by_depth = torch.zeros(0)  # [B, steps]
        self.proposed_by_depth = torch.zeros(0)  # [B, steps]

    def begin(self, batch: RunningBatch, prefill_hidden: torch.Tensor, sampling: SamplingParams) -> None:
        """Run the drafter over the prompts (prefill_hidden: [B, P, H], the target's prefill output)."""
        batch_size, longest = prefill_hidden.shape[:2]
        device = prefill_hidden.device
        self.cache = SlotCache(batch_size, batch.cache.capacity)
        # entry t pairs target_hidden[t] with token[t+1]; the prompt's last entry gets the first response token
        next_token_ids = batch.tokens[:, 1 : longest + 1].clone()
        next_token_ids.scatter_(1, (batch.lengths - 1)[:, None], batch.pending[:, None])
        positions = torch.arange(longest, device=device).expand(batch_size, longest)
        causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
        start = torch.zeros_like(batch.lengths)
        output = self._run_drafter(next_token_ids, prefill_hidden, start, positions, causal, written=0)
        rows = torch.arange(batch_size, device=device)
        self.root_hidden = output.hidden[rows, batch.lengths - 1]
        self.root_logits = output.logits[rows, batch.lengths - 1]
        self.verify_passes = torch.zeros_like(batch.lengths)
        self.accepted_draft_tokens = torch.zeros_like(batch.lengths)
        self.accepted_by_depth = torch.zeros(batch_size, self.config.steps, dtype=torch.long, device=device)
        self.proposed_by_depth = torch.zeros_like(self.accepted_by_depth)

    def step(
        self, engine: EmbeddedEngine, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft-verify-accept-commit round; returns the emitted tokens [B, E] and counts [B]."""
        tree = self._draft(batch, sampling, generator)
        hidden = engine.forward_block(batch, tree.tokens, batch.lengths[:, None] + tree.depths, tree.ancestors)
        target_logits = engine.lm_head(hidden)
        accept = accept_chain if self.config.is_chain else accept_tree
        verdict = accept(tree, target_logits, sampling, generator)
        self._count(tree, verdict)
        emitted = self._commit(batch, tree, verdict, hidden)
        return emitted, verdict.accept_length + 1

    def _draft(self, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator) -> DraftTree:
        """Run the drafter `steps` times from each row's root, expanding the chain or tree."""
        if self.config.is_chain:
            builder = ChainBuilder(batch.pending, self.config.steps, sampling, generator)
        else:
            builder = TreeBuilder(batch.pending, self.config)
        frontier_hidden, frontier_logits = self.root_hidden[:, None], self.root_logits[:, None]
        written = 0
        for step in range(self.config.steps):
            frontier = builder.expand(frontier_logits)
            if step == self.config.steps - 1:
                break
            # each node reads its parent's predicted hidden state, at the parent's position + 1
            parent_hidden = frontier_hidden.gather(
                1, frontier.parent_slot[:, :, None].expand(-1, -1, frontier_hidden.shape[2])
            )
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
        self.cache.prepare(write_slots, kv_length)
        mask = block_attention_mask(lengths, visible, kv_length)
        return self.drafter(input_ids, target_hidden, positions, mask, self.cache)

    def _commit(self, batch: RunningBatch, tree: DraftTree, verdict: Verdict, hidden: torch.Tensor) -> torch.Tensor:
        """Move kept entries into place, catch the drafter up, advance the rows; return the
        emitted tokens [B, D + 1] (kept drafts, then the bonus at index accept_length)."""
        accept_length, path = verdict.accept_length, verdict.path
        offsets = torch.arange(path.shape[1], device=path.device)
        if not self.config.is_chain:
            # kept node path[j] moves from slot lengths + path[j] to lengths + j; others stay put
            source = torch.where(offsets[None, :] <= accept_length[:, None], path, offsets[None, :])
            batch.cache.move_slots(batch.lengths[:, None] + source, batch.lengths[:, None] + offsets[None, :])
        path_tokens = tree.tokens.gather(1, path)
        emitted = torch.cat([path_tokens[:, 1:], torch.zeros_like(path_tokens[:, :1])], dim=1)
        emitted.scatter_(1, accept_length[:, None], verdict.bonus[:, None])
        # drafter catch-up: entry at position lengths + j pairs target_hidden there with emitted[j]
        caught_up = int(accept_length.max()) + 1
        path_hidden = hidden.gather(1, path[:, :caught_up, None].expand(-1, -1, hidden.shape[2]))
        positions = batch.lengths[:, None] + offsets[None, :caught_up]
        causal = torch.ones(caught_up, caught_up, dtype=torch.bool, device=path.device).tril()
        output = self._run_drafter(emitted[:, :caught_up], path_hidden, batch.lengths, positions, causal, written=0)
        rows = torch.arange(path.shape[0], device=path.device)
        self.root_hidden = output.hidden[rows, accept_length]
        self.root_logits = output.logits[rows, accept_length]
        batch.lengths = batch.lengths + accept_length + 1
        batch.pending = verdict.bonus
        return emitted

    def _count(self, tree: DraftTree, verdict: Verdict) -> None:
        depth_index = torch.arange(self.config.steps, device=verdict.accept_length.device)
        self.verify_passes += 1
        self.accepted_draft_tokens += verdict.accept_length
        self.accepted_by_depth += depth_index[None, :] < verdict.accept_length[:, None]
        tree_depth = tree.depths.max(dim=1).values
        self.proposed_by_depth += depth_index[None, :] < tree_depth[:, None]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows` of the drafter cache and every per-row tensor."""
        self.cache.keep_rows(rows)
        for name in ("root_hidden", "root_logits", "verify_passes", "accepted_draft_tokens", "accepted_by_depth", "proposed_by_depth"):
            setattr(self, name, getattr(self, name).index_select(0, rows))

    def stats(self, row: int) -> SpeculativeStats:
        """What SD did for the request in `row` (acceptance as judged at verification, before any
        cut at EOS or max_new_tokens)."""
        return SpeculativeStats(
            verify_passes=int(self.verify_passes[row]),
            accepted_draft_tokens=int(self.accepted_draft_tokens[row]),
            accepted_by_depth=self.accepted_by_depth[row].tolist(),
            proposed_by_depth=self.proposed_by_depth[row].tolist(),
        )
