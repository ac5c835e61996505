"""The one interface between the rollout engine (and speculative decoding) and the model being decoded.

The engine never calls a transformers module while decoding: it asks a `DecodeModel` for a cache,
runs blocks of tokens over that cache under a boolean mask, and turns hidden states into logits.
Two implementations: the owned forward of the Llama family (tlt_cli/engine/llama_family.py, plain
torch, fused projections in the engine's own layout) and every other causal LM through transformers'
public API (tlt_cli/engine/transformers_path.py). `decode_model_for` (tlt_cli/engine/__init__.py)
picks one.

Example:
    model = decode_model_for(policy)
    cache = model.new_cache(batch_size=2, capacity=64)
    hidden = model.forward_block(cache, input_ids, position_ids, write_slots, kv_length, visible)
    next_token = model.logits(hidden[:, -1]).argmax(-1)
    model.release()       # the copies' memory is the actor update's
    ...actor update...
    model.refresh()
"""

from __future__ import annotations

from typing import Protocol

import torch


class DecodeCache(Protocol):
    """Per-row storage of keys and values by slot (row b keeps position t at slot t), plus one extra
    vector per slot (the engine keeps the target's last hidden state there)."""

    capacity: int
    # [B, 1, capacity, D] or None: the vectors given to store_extra, by slot
    extra: torch.Tensor | None

    def prepare(self, write_slots: torch.Tensor, kv_length: int) -> None:
        """Route the next forward: row b writes its T new entries at write_slots[b] ([B, T]); attention
        reads slots [0, kv_length)."""

    def reserve(self, needed: int) -> None:
        """Hold at least `needed` slots per row."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only rows `rows` ([B'] indices, in that order)."""

    def move_slots(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copy each row's entries at source_slots [B, J] to target_slots [B, J]."""

    def store_extra(self, vectors: torch.Tensor) -> None:
        """Store vectors [B, T, D] at the slots of the last `prepare`."""


class DecodeModel(Protocol):
    """The model being decoded, as the engine and speculative decoding see it."""

    # what the run log prints: "owned llama-family" or "transformers"
    path: str
    # bytes of the model's own copies of weights (fused or transposed layouts, other dtypes)
    extra_bytes: int
    # dtype of the hidden states and of the cache
    dtype: torch.dtype

    def new_cache(self, batch_size: int, capacity: int) -> DecodeCache:
        """An empty cache of `batch_size` rows and `capacity` slots (it grows when asked to reserve more)."""

    def forward_block(
        self,
        cache: DecodeCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_slots: torch.Tensor,
        kv_length: int,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """Run T new entries per row: input_ids, position_ids, write_slots [B, T]; the keys and values go to
        write_slots; query j of row b attends slot s < kv_length iff visible[b, 0, j, s] ([B, 1, T,
        kv_length] bool). Returns the final-normed last hidden state [B, T, H]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] (float32)."""

    def refresh(self) -> None:
        """Re-read the weights from the policy module (after an actor update: writes through .data bump no
        version counter, so nothing else tells)."""

    def refresh_if_changed(self) -> None:
        """`refresh()` if a weight's storage or autograd version changed since the last read (an in-place
        optimizer step bumps it; a write through .data does not: call `refresh()` after those), or if
        `release()` freed the copies since."""

    def release(self) -> None:
        """Free the model's own weight copies until the next `refresh()` (the actor update needs the room)."""

    def describe(self) -> str:
        """One line for the run log: the path taken, and the memory of the model's own copies."""
