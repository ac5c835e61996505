"""Per-row slot KV cache and the 4D attention masks that go with it.

`SlotCache` is the cache of the engine's owned forward (tlt_cli/engine/llama_family.py) and of the
drafter: row b keeps the key and value of its position t at slot t, so rows of one batch hold
sequences of different lengths without padding holes. Before each forward the caller says where the
T new entries of every row go (`prepare`); each attention layer calls `update`, which scatters them
there and returns slots [0, kv_length) for attention. What a query may see (the row's committed
prefix plus the part of the new block its mask allows) is a 4D mask built by `block_attention_mask`.
Rejected speculative entries need no rollback: they lie past the row's committed length, are masked
out, and are overwritten by the next forward. Accepted entries of a draft tree are moved into place with `move_slots`.
`keep_rows_of` drops finished rows from a dataclass of per-row state (the engine's running batch,
the drafter proposer's rows, the speculative decoder's counters) and from its caches, field by field,
so no list of per-row names needs keeping in step with the fields.
"""

from __future__ import annotations

import dataclasses

import torch


class SlotCache:
    """Key/value buffers [B, kv_heads, capacity, head_dim] per layer, indexed by position.

    An optional extra buffer of the same layout (`store_extra`) keeps one vector per position (the
    engine stores the target's last hidden state there) and moves with the keys and values.
    """

    def __init__(self, batch_size: int, capacity: int) -> None:
        self.batch_size = batch_size
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.extra: torch.Tensor | None = None
        self._write_slots = torch.zeros(batch_size, 0, dtype=torch.long)
        self._kv_length = 0
        self._scatter_index: dict[tuple[int, ...], torch.Tensor] = {}

    def prepare(self, write_slots: torch.Tensor, kv_length: int) -> None:
        """Route the next forward: row b writes its T new entries at write_slots[b] ([B, T]) and
        attention reads slots [0, kv_length)."""
        self.reserve(kv_length)
        self._write_slots = write_slots
        self._kv_length = kv_length
        self._scatter_index = {}

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict | None = None,
        **call_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store key/value states [B, kv_heads, T, head_dim] of layer `layer_idx`; return the
        layer's keys and values over slots [0, kv_length).

        Both ways transformers' attention layers call a cache are accepted: up to 5.23
        `update(k, v, layer_idx)` (or with `cache_kwargs`), from 5.24 `update(k, v, layer_idx,
        kwargs=...)`. Where the entries go is fixed by `prepare`, so neither argument is read."""
        if layer_idx == len(self.keys):
            self.keys.append(self._new_buffer(key_states))
            self.values.append(self._new_buffer(value_states))
        index = self._index_for(key_states.shape)
        self.keys[layer_idx].scatter_(2, index, key_states)
        self.values[layer_idx].scatter_(2, index, value_states)
        return self.keys[layer_idx][:, :, : self._kv_length], self.values[layer_idx][:, :, : self._kv_length]

    def store_extra(self, vectors: torch.Tensor) -> None:
        """Store one vector per new entry, vectors [B, T, D], at the slots of the last `prepare`."""
        if self.extra is None:
            self.extra = self._new_buffer(vectors.unsqueeze(1))
        self.extra.scatter_(2, self._index_for((self.batch_size, 1, *vectors.shape[1:])), vectors.unsqueeze(1))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Slots attention reads in the current forward (the longest row plus the new block)."""
        return self._kv_length

    def reserve(self, needed: int) -> None:
        """Grow every buffer (doubling) until it holds at least `needed` slots."""
        if needed <= self.capacity:
            return
        self.capacity = max(needed, 2 * self.capacity)
        self.keys = [self._grown(buffer) for buffer in self.keys]
        self.values = [self._grown(buffer) for buffer in self.values]
        if self.extra is not None:
            self.extra = self._grown(self.extra)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only batch rows `rows` ([B'] indices, in that order); the rest leave the cache."""
        self.keys = [buffer.index_select(0, rows) for buffer in self.keys]
        self.values = [buffer.index_select(0, rows) for buffer in self.values]
        if self.extra is not None:
            self.extra = self.extra.index_select(0, rows)
        self.batch_size = rows.shape[0]

    def move_slots(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        """Copy every buffer's entries at source_slots [B, J] to target_slots [B, J] (row-wise)."""
        for buffer in [*self.keys, *self.values, *([self.extra] if self.extra is not None else [])]:
            heads, width = buffer.shape[1], buffer.shape[3]
            shape = (*source_slots.shape[:1], heads, source_slots.shape[1], width)
            moved = buffer.gather(2, source_slots[:, None, :, None].expand(shape))
            buffer.scatter_(2, target_slots[:, None, :, None].expand(shape), moved)

    def _new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(like.shape[0], like.shape[1], self.capacity, like.shape[3])

    def _grown(self, buffer: torch.Tensor) -> torch.Tensor:
        grown = buffer.new_zeros(*buffer.shape[:2], self.capacity, buffer.shape[3])
        grown[:, :, : buffer.shape[2]] = buffer
        return grown

    def _index_for(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Scatter index [B, heads, T, width] sending entry t of row b to write_slots[b, t]."""
        shape = tuple(shape)
        if shape not in self._scatter_index:
            self._scatter_index[shape] = self._write_slots[:, None, :, None].expand(shape)
        return self._scatter_index[shape]


def keep_rows_of(state, rows: torch.Tensor) -> None:
    """Keep rows `rows` ([B'] indices, in that order) of dataclass `state`: every tensor field is
    per-row (dim 0 = row) and is index-selected, every field with its own `keep_rows` (a SlotCache)
    is asked to keep them; other fields are per-batch and stay as they are."""
    for field in dataclasses.fields(state):
        value = getattr(state, field.name)
        if isinstance(value, torch.Tensor):
            setattr(state, field.name, value.index_select(0, rows))
        elif hasattr(value, "keep_rows"):
            value.keep_rows(rows)


def block_attention_mask(lengths: torch.Tensor, block_mask: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, kv_length] (True = may attend) for T queries past each row's prefix.

    Row b's region of W new slots starts at lengths[b]. Query j sees every committed slot
    s < lengths[b], and region slot lengths[b] + i iff block_mask[b, j, i] (block_mask: [B, T, W]
    or a shared [T, W]; causal for a chain, ancestor-or-self for a draft tree).
    """
    query_count, region_width = block_mask.shape[-2:]
    batch_size = lengths.shape[0]
    block_mask = block_mask.expand(batch_size, query_count, region_width)
    # offset of each slot from the row's region start: < 0 committed, [0, W) the region
    offset = torch.arange(kv_length, device=lengths.device)[None, :] - lengths[:, None]
    in_region = (offset >= 0) & (offset < region_width)
    region_index = offset.clamp(0, region_width - 1)[:, None, :].expand(batch_size, query_count, kv_length)
    visible_in_region = block_mask.gather(2, region_index) & in_region[:, None, :]
    return ((offset < 0)[:, None, :] | visible_in_region).unsqueeze(1)


def decode_attention_mask(lengths: torch.Tensor, kv_length: int) -> torch.Tensor:
    """Mask [B, 1, 1, kv_length] for one new token per row written at slot lengths[b]."""
    slots = torch.arange(kv_length, device=lengths.device)
    return (slots[None, :] <= lengths[:, None])[:, None, None, :]


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form of a boolean mask: 0 where visible, the dtype's minimum where hidden (eager
    and SDPA attention both add it to the scores)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, torch.finfo(dtype).min)
