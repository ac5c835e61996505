"""The running batch and the model being decoded over it: the one interface speculative decoding uses.

`RunningBatch` holds the per-row state of the requests still generating (lengths, pending tokens,
token ids, the target's slot cache, the target hidden states kept by position); `keep_rows` drops
finished rows from every field at once. `DecodeTarget` is the target as a decoding step sees it:

    hidden = target.forward_block(batch, input_ids, position_ids, block_mask)   # T new entries per row
    logits = target.logits(hidden)                                              # [..., V] float32
    tokens, counts = target.decode_step(batch, sampling, generator)            # one plain step

The embedded rollout's generate loop (tlt_cli/rollout/generate_loop.py) decodes with it; speculative decoding
(tlt_cli/speculative/) drafts, verifies through `forward_block` under a tree mask, and commits by
moving cache entries (`batch.cache.move_slots`) and advancing `lengths` and `pending`. Neither calls
the other's internals, and neither sees a transformers module: the model is a `DecodeModel`
(tlt_cli/engine/interface.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_cli.engine.interface import DecodeCache, DecodeModel
from tlt_cli.engine.kv_cache import block_attention_mask, decode_attention_mask, keep_rows_of
from tlt_cli.engine.sampling import SamplingParams, next_tokens


@dataclass
class RunningBatch:
    """Per-row state of the requests still generating (B rows; every tensor field is per-row, in
    one row order, and `keep_rows` selects them all).

    Invariant: row b's target cache holds positions [0, lengths[b]); `pending[b]`, its last
    emitted token, sits at position lengths[b] and is fed by the next step.
    """

    # index of each row's request in the list given to generate: [B]
    request_index: torch.Tensor
    prompt_lengths: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B] committed target-cache length
    pending: torch.Tensor  # [B] token at position lengths[b], not yet in the cache
    generated: torch.Tensor  # [B] response tokens emitted so far
    finished_by_eos: torch.Tensor  # [B] bool
    tokens: torch.Tensor  # [B, capacity] prompt and response ids by position
    cache: DecodeCache
    # keep the target's last hidden state of every position in cache.extra (for return_hidden
    # and for the drafter, which catches up from it after steps without SD)
    store_hidden: bool

    @property
    def size(self) -> int:
        return self.request_index.shape[0]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep rows `rows` of every per-row tensor and of the cache, drop the rest."""
        keep_rows_of(self, rows)


class DecodeTarget:
    """The model being decoded (a DecodeModel) applied to a RunningBatch."""

    def __init__(self, decode_model: DecodeModel, device: torch.device) -> None:
        self.decode_model = decode_model
        self.device = device

    def forward_block(
        self,
        batch: RunningBatch,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        block_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the target on T new entries per row, written at slots lengths[b] + [0, T).

        input_ids, position_ids: [B, T]; block_mask: [B, T, T] or [T, T], which new entries each new entry
        may see (it always sees the row's committed prefix; None for a single entry). Returns the last
        hidden state [B, T, H]; the cache's committed lengths are left to the caller.
        """
        block_size = input_ids.shape[1]
        kv_length = int(batch.lengths.max()) + block_size
        write_slots = batch.lengths[:, None] + torch.arange(block_size, device=self.device)
        if block_size == 1:
            visible = decode_attention_mask(batch.lengths, kv_length)
        else:
            visible = block_attention_mask(batch.lengths, block_mask, kv_length)
        hidden = self.decode_model.forward_block(batch.cache, input_ids, position_ids, write_slots, kv_length, visible)
        if batch.store_hidden:
            batch.cache.store_extra(hidden)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] (float32) of hidden states [..., H]."""
        return self.decode_model.logits(hidden)

    def decode_step(
        self, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plain decoding: feed each row's pending token, draw the next one."""
        hidden = self.forward_block(batch, batch.pending[:, None], batch.lengths[:, None])
        batch.lengths = batch.lengths + 1
        batch.pending = next_tokens(self.logits(hidden[:, -1]), sampling, generator)
        return batch.pending[:, None], torch.ones_like(batch.pending)
