"""Attention over a packed sequence by its segments: each group's prompt once, each response against its prompt.

packed_forward.py lays a micro-batch out as one sequence of groups, [prompt][response 0][response 1]..., with a
[1,1,L,L] boolean mask that lets each response see only its prompt and itself. A dense masked attention over
that sequence computes every (query, key) pair of the L x L square and throws most of them away: on
SmolLM2-135M at 800 tokens a packed group's attention was about a quarter of its forward and backward. This
module computes only the pairs the mask allows, segment by segment, with torch's fused attention:

    prompt:     softmax(q_p k_p^T) v_p, causal
    response r: softmax(q_r [k_p; k_r]^T) [v_p; v_r], all of the prompt and causal within r

which is the masked attention's result within rounding (tests/test_packed_forward.py). A layer with a sliding
window of W tokens gets the mask built for its layer type, which carries W as well: each query then sees only the
keys of the W row positions up to its own (transformers' key position > query position - W), within its segment
as everywhere. The layout's segments (and window) ride on the mask tensor itself (`segmented_mask`), so
gradient checkpointing's recomputation in backward, which calls each layer again with the same mask, finds them
too. `segmented_attention(model)` switches a model's
attention to this function while its packed forward or backward runs (transformers' AttentionInterface, the
documented extension point); a mask without segments falls back to transformers' sdpa.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "tlt_segmented"
# the attributes of a packed mask that carry its segments and its sliding window (None: unlimited)
SEGMENTS_ATTRIBUTE = "packed_segments"
WINDOW_ATTRIBUTE = "packed_window"


@dataclass(frozen=True)
class PackedGroup:
    """A group's segments in packed positions: its prompt [start, stop) (empty when not shared) and responses."""

    prompt: tuple[int, int]
    responses: tuple[tuple[int, int], ...]


def segmented_mask(mask: torch.Tensor, groups: list[PackedGroup], window: int | None = None) -> torch.Tensor:
    """The packed [1,1,L,L] mask carrying its groups' segments and the sliding window its layers attend within
    (read by `attend_by_segments`)."""
    setattr(mask, SEGMENTS_ATTRIBUTE, tuple(groups))
    setattr(mask, WINDOW_ATTRIBUTE, window)
    return mask


@contextlib.contextmanager
def segmented_attention(model: PreTrainedModel) -> Iterator[None]:
    """Within: `model` computes attention by segments where its mask carries them (switched with transformers'
    public `set_attn_implementation`, and back to what it was after)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def attend_by_segments(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **keywords,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: query [1,heads,L,d], key/value [1,kv heads,L,d] -> ([1,L,heads,d], None)."""
    groups = getattr(attention_mask, SEGMENTS_ATTRIBUTE, None)
    if groups is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **keywords)
    window = getattr(attention_mask, WINDOW_ATTRIBUTE, None)
    outputs = []
    for group in groups:
        prompt = slice(*group.prompt)
        if group.prompt[1] > group.prompt[0]:
            outputs.append(_attend(query[:, :, prompt], key[:, :, prompt], value[:, :, prompt], scaling, 0, window))
        for start, stop in group.responses:
            response = slice(start, stop)
            keys = torch.cat((key[:, :, prompt], key[:, :, response]), dim=2)
            values = torch.cat((value[:, :, prompt], value[:, :, response]), dim=2)
            prompt_length = group.prompt[1] - group.prompt[0]
            outputs.append(_attend(query[:, :, response], keys, values, scaling, prompt_length, window))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    prompt_length: int,
    window: int | None,
) -> torch.Tensor:
    """Fused attention of a segment: causal over itself (prompt_length 0), or every prompt key then causal over
    the rest; with a window, only keys within it. The keys are in row order: key column c is row position c."""
    if not prompt_length and window is None:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
    queries = query.shape[2]
    # query i sits at row position prompt_length + i and sees the columns c <= prompt_length + i ...
    mask = torch.ones(queries, key.shape[2], dtype=torch.bool, device=query.device).tril_(prompt_length)
    if window is not None:
        # ... within its window: c > prompt_length + i - window
        mask &= ~torch.ones_like(mask).tril_(prompt_length - window)
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True
    )


AttentionInterface.register(ATTENTION_NAME, attend_by_segments)
