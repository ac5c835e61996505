"""The update's forward over packed micro-batches: no padding, and each GRPO group's prompt computed once.

The actor (actor.py) calls `packed_hidden(decoder, batch)` instead of running the decoder over the
right-padded rows of a `PolicyBatch`. Every row's real tokens are laid out back to back in one packed
sequence; with `share_prompt`, the rows of a group (same `group_ids`, the same prompt tokens) keep
their prompt once, followed by each response:

    packed:    [prompt g0][response 0][response 1]...[prompt g1][response 4]...
    positions:  0 .. P-1   P .. P+R0-1  P .. P+R1-1    0 .. P'-1
    attends:    causal     prompt + its own response, causally; nothing across groups

The mask is a [1,1,L,L] boolean (True: may attend) handed to the decoder as a prepared 4D mask (where the decoder
attends by segments, segmented_attention.py, only the segments it carries are read, so it is one stored value seen
as [1,1,L,L]: no L x L tensor is built), and the positions make every token's rotary position the one it has in its
own row. So each response token sees exactly the keys and values it sees in the padded layout, and the output
[B,T,H] is gathered back to that layout: the prompt's states are shared by the group's rows, and in backward their
gradients add up over the group, which is the padded update's gradient (Prefix Grouper, arXiv 2506.05433). Log-probs,
the loss and the drafter's features read the gathered states exactly as before; the rows' padding
positions hold some packed state the response mask never reads.

A sliding window (Mistral's `sliding_window`, Qwen2's and Qwen3's `use_sliding_window` above
`max_window_layers`, any `layer_types` of "sliding_attention") limits the layers that have it to the keys of the
last W row positions: those layers get a second mask, the first one within the window, and the decoder takes a
mask per layer type as the rollout's transformers path does (tlt_cli/engine/transformers_path.py).
`packing_supported(config)` is the one place that says when a model cannot pack (another kind of layer, such as
chunked or linear attention), and `packs_micro_batches(micro_batch_tokens, config)` whether the update packs: the
actor (which says so when it trains padded rows instead) and the update-precision measurement both ask it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from tlt_cli.training.policy_batch import PolicyBatch
from tlt_cli.training.segmented_attention import ATTENTION_NAME, PackedGroup, segmented_attention, segmented_mask

# the segment id of a group's prompt in the packed layout (responses count 0, 1, ...)
PROMPT_SEGMENT = -1
# the layer types (a config's `layer_types`) whose attention the packed layout reproduces
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


def packing_supported(config) -> str | None:
    """Why a model of `config` cannot run the packed update (its layers attend in a way the layout does not
    reproduce), or None when it can."""
    others = sorted(set(getattr(config, "layer_types", None) or ()) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if others:
        return f"layer type {', '.join(others)} is not {FULL_ATTENTION} or {SLIDING_ATTENTION}"
    return None


def packs_micro_batches(micro_batch_tokens: int, config) -> bool:
    """Whether the update packs its micro-batches: actor.micro_batch_tokens set and a model of `config` that can."""
    return bool(micro_batch_tokens) and packing_supported(config) is None


def attention_window(config) -> int | None:
    """The sliding window (in tokens) of the model's windowed layers, or None when every layer sees all keys."""
    window = getattr(config, "sliding_window", None)
    if window is None or _layer_types(config) == {FULL_ATTENTION}:
        return None
    return window


def _layer_types(config) -> set[str]:
    """The config's layer types; a windowed config without them (Mistral) windows every layer."""
    default = SLIDING_ATTENTION if getattr(config, "sliding_window", None) is not None else FULL_ATTENTION
    return set(getattr(config, "layer_types", None) or [default])


@dataclass(frozen=True)
class PackedLayout:
    """One micro-batch packed into a single sequence of L tokens.

    input_ids, position_ids: [1,L]; attention_mask: [1,1,L,L] bool (True: query may attend to key; laid out by
    segments, a view of one True that carries the segments); window_mask: [1,1,L,L] bool, attention_mask within
    the sliding window (None without one);
    gather_index: [B,T] the packed position of each row's token (0 on padding).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    gather_index: torch.Tensor
    window_mask: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]


def packed_length(batch: PolicyBatch, share_prompt: bool) -> int:
    """How many tokens the packed sequence of `batch` holds (its prompts once per group with share_prompt)."""
    return sum(queries for queries, _ in attention_segments(batch, share_prompt))


def attention_segments(batch: PolicyBatch, share_prompt: bool) -> list[tuple[int, int]]:
    """(queries, keys) of each attention segment of the packed layout (segmented_attention.py): a group's shared
    prompt over itself, each response over its prompt and itself."""
    segments = []
    for _, rows, prompt_length in _groups(batch, share_prompt):
        if prompt_length:
            segments.append((prompt_length, prompt_length))
        segments.extend((_row_length(batch, row) - prompt_length, _row_length(batch, row)) for row in rows)
    return segments


def packed_layout(
    batch: PolicyBatch, share_prompt: bool, window: int | None = None, by_segments: bool = False
) -> PackedLayout:
    """Pack the batch's rows (see the module docstring); groups share their prompt when share_prompt; with a
    sliding window, a second mask within it. by_segments: the decoder attends by segments (`attends_by_segments`),
    which reads the masks' segments and never their values, so no [L,L] mask is built: each is one stored value
    seen as [1,1,L,L]."""
    device = batch.input_ids.device
    tokens, positions, groups, segments, packed_groups = [], [], [], [], []
    gather_index = torch.zeros_like(batch.input_ids)
    offset = 0
    for group, rows, prompt_length in _groups(batch, share_prompt):
        prompt, responses = (offset, offset + prompt_length), []
        if prompt_length:
            tokens.append(batch.input_ids[rows[0], :prompt_length])
            positions.append(torch.arange(prompt_length, device=device))
            groups.append(torch.full((prompt_length,), group, device=device))
            segments.append(torch.full((prompt_length,), PROMPT_SEGMENT, device=device))
            gather_index[rows, :prompt_length] = torch.arange(offset, offset + prompt_length, device=device)
            offset += prompt_length
        for row in rows:
            length = _row_length(batch, row)
            tokens.append(batch.input_ids[row, prompt_length:length])
            positions.append(torch.arange(prompt_length, length, device=device))
            groups.append(torch.full((length - prompt_length,), group, device=device))
            segments.append(torch.full((length - prompt_length,), row, device=device))
            gather_index[row, prompt_length:length] = torch.arange(
                offset, offset + length - prompt_length, device=device
            )
            responses.append((offset, offset + length - prompt_length))
            offset += length - prompt_length
        packed_groups.append(PackedGroup(prompt, tuple(responses)))
    group_of, segment_of, position_of = torch.cat(groups), torch.cat(segments), torch.cat(positions)
    if by_segments:
        allowed, within_window = _unread_mask(offset, device), _unread_mask(offset, device)
    else:
        allowed = _attention_mask(group_of, segment_of)[None, None]
        within_window = None if window is None else allowed & _window_mask(position_of, window)[None, None]
    return PackedLayout(
        input_ids=torch.cat(tokens)[None],
        position_ids=position_of[None],
        attention_mask=segmented_mask(allowed, packed_groups),
        gather_index=gather_index,
        window_mask=None if window is None else segmented_mask(within_window, packed_groups, window),
    )


def attends_by_segments(config) -> bool:
    """Whether a model of `config` computes a packed micro-batch's attention by segments (segmented_attention.py):
    it uses sdpa, the fused kernel that module calls. Otherwise its kernel reads the dense [L,L] masks."""
    return config._attn_implementation in ("sdpa", ATTENTION_NAME)


def packed_hidden(decoder: nn.Module, batch: PolicyBatch, share_prompt: bool) -> torch.Tensor:
    """The decoder's last hidden states [B,T,H] for the batch's right-padded rows, computed over its packed
    layout (equal to running the decoder on the rows, within floating-point rounding)."""
    by_segments = attends_by_segments(decoder.config)
    layout = packed_layout(batch, share_prompt, attention_window(decoder.config), by_segments)
    window_mask = layout.attention_mask if layout.window_mask is None else layout.window_mask
    masks = {FULL_ATTENTION: layout.attention_mask, SLIDING_ATTENTION: window_mask}
    if not by_segments:
        # eager and other kernels add the mask to the scores: 0 where allowed, the dtype's lowest elsewhere
        masks = {kind: _additive(mask, decoder.dtype) for kind, mask in masks.items()}
    with packed_attention(decoder):
        output = decoder(
            input_ids=layout.input_ids,
            attention_mask=_decoder_mask(masks, _layer_types(decoder.config)),
            position_ids=layout.position_ids,
            use_cache=False,
        )
    return output.last_hidden_state[0, layout.gather_index]


def _decoder_mask(masks: dict[str, torch.Tensor], layer_types: set[str]) -> torch.Tensor | dict[str, torch.Tensor]:
    """What the decoder takes: the one mask all its layers use, or a mask per layer type (when they differ)."""
    if len(layer_types) == 1:
        return masks[next(iter(layer_types))]
    return masks


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def packed_attention(model: PreTrainedModel) -> contextlib.AbstractContextManager:
    """Where a packed forward, or the backward that recomputes it, runs: the model attends by segments
    (segmented_attention.py) when it uses sdpa, the fused kernel that function calls; as it is otherwise."""
    if attends_by_segments(model.config):
        return segmented_attention(model)
    return contextlib.nullcontext()


def _unread_mask(length: int, device: torch.device) -> torch.Tensor:
    """A [1,1,L,L] boolean view of one stored True: the shape the decoder expects, for attention that reads only
    the segments it carries."""
    return torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(1, 1, length, length)


def _window_mask(position_of: torch.Tensor, window: int) -> torch.Tensor:
    """[L,L] True where the key is within the query's sliding window: a query sees the keys of its own row only
    (the attention mask), so row positions compare: key position > query position - W."""
    return position_of[None, :] > position_of[:, None] - window


def _attention_mask(group_of: torch.Tensor, segment_of: torch.Tensor) -> torch.Tensor:
    """[L,L] True where query i may attend to key j: j <= i in the same group, and j is in the group's prompt
    or in i's own segment (a prompt token's own segment is the prompt, so it sees only earlier prompt tokens)."""
    length = group_of.numel()
    causal = torch.ones(length, length, dtype=torch.bool, device=group_of.device).tril_()
    same_group = group_of[:, None] == group_of[None, :]
    visible = (segment_of[None, :] == PROMPT_SEGMENT) | (segment_of[:, None] == segment_of[None, :])
    return causal & same_group & visible


def _groups(batch: PolicyBatch, share_prompt: bool) -> list[tuple[int, list[int], int]]:
    """(group number, its rows, its shared prompt length) in order of first row. Rows share a prompt only when
    share_prompt, their group ids match and their prompt tokens are the same; otherwise a row is a group of
    its own whose whole sequence is its "response" part (prompt length 0)."""
    if not share_prompt or batch.group_ids is None:
        return [(row, [row], 0) for row in range(batch.size)]
    groups: dict[tuple, tuple[int, list[int], int]] = {}
    for row in range(batch.size):
        prompt_length = _prompt_length(batch, row)
        key = (int(batch.group_ids[row]), tuple(batch.input_ids[row, :prompt_length].tolist()))
        groups.setdefault(key, (len(groups), [], prompt_length))[1].append(row)
    return list(groups.values())


def _row_length(batch: PolicyBatch, row: int) -> int:
    return int(batch.attention_mask[row].sum())


def _prompt_length(batch: PolicyBatch, row: int) -> int:
    """The row's tokens before its response (the response is the row's last real tokens)."""
    return _row_length(batch, row) - int(batch.response_mask[row].sum())


def packed_micro_batches(
    batch: PolicyBatch, token_budget: int, share_prompt: bool, count: int | None = None
) -> list[PolicyBatch]:
    """Consecutive slices of whole groups (rows, without group ids), each packing at most token_budget tokens
    (a group larger than the budget alone), or exactly `count` slices as even in tokens as contiguous slices
    allow (count at most the number of groups: the ranks of one update agree on a count, actor.py)."""
    spans = batch.group_spans()
    tokens = _group_tokens(batch, spans, share_prompt)
    parts = _greedy_parts(tokens, token_budget) if count is None else _even_parts(tokens, count)
    return [batch.slice(spans[first][0], spans[last - 1][1]) for first, last in parts]


def micro_batch_count(batch: PolicyBatch, token_budget: int, share_prompt: bool) -> int:
    """How many packed micro-batches `packed_micro_batches(batch, token_budget, share_prompt)` makes."""
    return len(_greedy_parts(_group_tokens(batch, batch.group_spans(), share_prompt), token_budget))


def _group_tokens(batch: PolicyBatch, spans: list[tuple[int, int]], share_prompt: bool) -> list[int]:
    """The packed tokens of each span of rows."""
    return [packed_length(batch.slice(start, stop), share_prompt) for start, stop in spans]


def _greedy_parts(tokens: list[int], budget: int) -> list[tuple[int, int]]:
    """(first, last) unit ranges filled in order while their tokens stay within budget (one unit at least)."""
    parts, first, filled = [], 0, 0
    for index, count in enumerate(tokens):
        if index > first and filled + count > budget:
            parts.append((first, index))
            first, filled = index, 0
        filled += count
    if tokens:
        parts.append((first, len(tokens)))
    return parts


def _even_parts(tokens: list[int], count: int) -> list[tuple[int, int]]:
    """Exactly `count` contiguous unit ranges whose largest token sum is as small as a greedy fill makes it:
    the smallest budget whose greedy fill needs at most count parts, then the largest parts split until count."""
    if not 1 <= count <= len(tokens):
        raise ValueError(f"cannot split {len(tokens)} groups into {count} micro-batches.")
    low, high = max(tokens), sum(tokens)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(_greedy_parts(tokens, middle)) <= count else (middle + 1, high)
    parts = _greedy_parts(tokens, low)
    while len(parts) < count:
        splittable = [part for part in parts if part[1] - part[0] > 1]
        first, last = max(splittable, key=lambda part: sum(tokens[part[0] : part[1]]))
        # cut where the larger half is smallest
        middle = min(range(first + 1, last), key=lambda cut: max(sum(tokens[first:cut]), sum(tokens[cut:last])))
        index = parts.index((first, last))
        parts[index : index + 1] = [(first, middle), (middle, last)]
    return parts
