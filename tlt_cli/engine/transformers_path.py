"""Every causal LM the owned forward does not reproduce, decoded through transformers' public API only.

`TransformersModel(policy)` runs the model's decoder (`get_decoder()`) with a public `DynamicCache` and a
4D mask, and its head (`get_output_embeddings()`) for logits. The engine thinks in slots (row b keeps
position t at slot t); a DynamicCache only appends. `ColumnCache` bridges them: every forward appends its
T entries to the DynamicCache as T new columns for all rows, and a per-row map slot -> column says where
each slot's entry lies. The mask over columns is built from the engine's mask over slots through that map;
`move_slots` only remaps, `keep_rows` uses the DynamicCache's `batch_select_indices`. A sliding window is
applied to that mask from each slot's position (the cache itself keeps every column: a DynamicCache without
a config never crops), per layer type when layers differ. Entries that a row
no longer maps (rejected drafts, padding of a prefill) stay as hidden columns, so the cache grows by every
forward's block; this path is for correctness on any architecture with a key/value cache (not recurrent
or hybrid state-space models).

With a `LinearFormPlan` (linear_forms.py) the decoder and head run as a `FormedCopy` of the policy: the same
parameters, its planned nn.Linear layers replaced, in that copy only, by stand-ins computing in the measured
forms (a transposed copy of the head is what makes GPT-2-shaped models decode faster than `generate` at one
row). The policy module itself is never changed.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers import DynamicCache

from tlt_cli.engine.kv_cache import additive_mask
from tlt_cli.engine.linear_forms import FormedCopy, LinearFormPlan

PATH_NAME = "transformers"


class ColumnCache:
    """A DecodeCache (tlt_cli/engine/interface.py) over a DynamicCache; see the module docstring."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device) -> None:
        self.cache = DynamicCache()
        self.batch_size = batch_size
        self.capacity = capacity
        self.columns = 0  # columns the DynamicCache holds
        self.column_of = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.position_of = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.extra: torch.Tensor | None = None  # [B, 1, capacity, D]
        self._write_slots = torch.zeros(batch_size, 0, dtype=torch.long, device=device)

    def prepare(self, write_slots: torch.Tensor, kv_length: int, position_ids: torch.Tensor | None = None) -> None:
        """The next forward's T entries become columns [columns, columns + T) of every row, at slots write_slots
        [B, T] (their positions: position_ids [B, T], or the slots)."""
        self.reserve(kv_length)
        new_columns = self.columns + torch.arange(write_slots.shape[1], device=write_slots.device)
        self.column_of.scatter_(1, write_slots, new_columns.expand_as(write_slots))
        self.position_of.scatter_(1, write_slots, write_slots if position_ids is None else position_ids)
        self._write_slots = write_slots
        self.columns += write_slots.shape[1]

    def column_mask(self, visible: torch.Tensor) -> torch.Tensor:
        """The mask [B, 1, T, columns] over cache columns of a mask [B, 1, T, kv_length] over slots (a column
        is visible when a slot that maps to it is; after move_slots two slots may map to one column)."""
        batch_size, _, length, kv_length = visible.shape
        index = self.column_of[:, None, :kv_length].expand(batch_size, length, kv_length)
        counts = torch.zeros(batch_size, length, self.columns, dtype=torch.long, device=visible.device)
        counts.scatter_add_(2, index, visible[:, 0].long())
        return (counts > 0)[:, None]

    def reserve(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        self.capacity = max(needed, 2 * self.capacity)
        self.column_of, self.position_of = (
            _grown(slots, self.capacity) for slots in (self.column_of, self.position_of)
        )
        if self.extra is not None:
            extra = self.extra.new_zeros(*self.extra.shape[:2], self.capacity, self.extra.shape[3])
            extra[:, :, : self.extra.shape[2]] = self.extra
            self.extra = extra

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.column_of = self.column_of.index_select(0, rows)
        self.position_of = self.position_of.index_select(0, rows)
        if self.extra is not None:
            self.extra = self.extra.index_select(0, rows)
        self.batch_size = rows.shape[0]

    def move_slots(self, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
        for slots in (self.column_of, self.position_of):
            slots.scatter_(1, target_slots, slots.gather(1, source_slots))
        if self.extra is not None:
            shape = (source_slots.shape[0], 1, source_slots.shape[1], self.extra.shape[3])
            moved = self.extra.gather(2, source_slots[:, None, :, None].expand(shape))
            self.extra.scatter_(2, target_slots[:, None, :, None].expand(shape), moved)

    def store_extra(self, vectors: torch.Tensor) -> None:
        """Store vectors [B, T, D] at the slots of the last `prepare`."""
        if self.extra is None:
            self.extra = vectors.new_zeros(self.batch_size, 1, self.capacity, vectors.shape[-1])
        index = self._write_slots[:, None, :, None].expand(self.batch_size, 1, -1, vectors.shape[-1])
        self.extra.scatter_(2, index, vectors.unsqueeze(1))


def _grown(slots: torch.Tensor, capacity: int) -> torch.Tensor:
    grown = slots.new_zeros(slots.shape[0], capacity)
    grown[:, : slots.shape[1]] = slots
    return grown


class TransformersModel:
    """The DecodeModel of any causal LM through transformers' public API; see the module docstring."""

    path = PATH_NAME

    def __init__(self, policy: nn.Module, reason: str = "", linear_plan: LinearFormPlan | None = None) -> None:
        self.policy = policy
        self.reason = reason
        # the decode-time copy whose planned linear layers compute in their forms (None: the policy's own modules)
        self.formed = FormedCopy(policy, linear_plan) if linear_plan is not None else None
        decoding = self.formed.module if self.formed is not None else policy
        self.decoder = decoding.get_decoder()
        self.head = decoding.get_output_embeddings()
        self.dtype = next(policy.parameters()).dtype
        self.device = next(policy.parameters()).device
        # transformers 5.24 renamed the decoder's `past_key_values` argument to `cache`
        parameters = inspect.signature(self.decoder.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @property
    def extra_bytes(self) -> int:
        """Bytes of the formed layers' transposed copies held now (the policy's own weights are used as they are)."""
        return self.formed.extra_bytes if self.formed is not None else 0

    def describe(self) -> str:
        why = f" ({self.reason})" if self.reason else ""
        formed = f"; {len(self.formed.layers)} linear layers formed" if self.formed is not None else ""
        return (
            f"decode path: {self.path}{why}{formed}; own weight copies {self.extra_bytes / 2**20:.1f} MiB "
            f"({self.extra_bytes} bytes)"
        )

    def new_cache(self, batch_size: int, capacity: int) -> ColumnCache:
        return ColumnCache(batch_size, capacity, self.device)

    def refresh(self) -> None:
        """Re-read the transposed copies of the formed layers (the modules read the policy's parameters themselves)."""
        if self.formed is not None:
            self.formed.refresh()

    def refresh_if_changed(self) -> None:
        """Nothing to do: each transposed copy checks its weight's storage and version when used."""

    def release(self) -> None:
        """Free the transposed copies (re-read at the next use or `refresh()`)."""
        if self.formed is not None:
            self.formed.release()

    def forward_block(
        self,
        cache: ColumnCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_slots: torch.Tensor,
        kv_length: int,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        cache.prepare(write_slots, kv_length, position_ids)
        output = self.decoder(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=self._attention_mask(cache, visible, position_ids),
            use_cache=True,
            **{self.cache_argument: cache.cache},
        )
        return output.last_hidden_state

    def _attention_mask(self, cache: ColumnCache, visible: torch.Tensor, position_ids: torch.Tensor):
        """The additive mask over cache columns; with a sliding window, keys within it of each query's position
        only (a mask per layer type when some layers use the window and others do not)."""
        full = additive_mask(cache.column_mask(visible), self.dtype)
        config = self.policy.config
        window = getattr(config, "sliding_window", None)
        if window is None:
            return full
        key_positions = cache.position_of[:, : visible.shape[3]]
        # transformers' sliding window: key position > query position - window
        near = key_positions[:, None, None, :] > position_ids[:, None, :, None] - window
        windowed = additive_mask(cache.column_mask(visible & near), self.dtype)
        layer_types = set(getattr(config, "layer_types", None) or ["sliding_attention"])
        if layer_types == {"sliding_attention"}:
            return windowed
        if layer_types == {"full_attention"}:
            return full
        return {"full_attention": full, "sliding_attention": windowed}

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits (float32), with the final soft-capping or scale of the families that have one."""
        logits = self.head(hidden)
        config = self.policy.config
        softcap = getattr(config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        scale = getattr(config, "logit_scale", None)
        if scale is not None:
            logits = logits * scale
        return logits.float()
