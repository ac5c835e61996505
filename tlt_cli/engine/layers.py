"""The Llama-family decoder layer in plain torch: RMSNorm, rotary embedding, grouped-query attention over a
cache under a boolean mask, and the SiLU-gated MLP.

Both the owned decode forward (tlt_cli/engine/llama_family.py, fused weights in the engine's own layout,
no autograd) and the drafter's decoder layer (`DecoderLayer`, an nn.Module trained with autograd) run
these functions. Their op order mirrors transformers' Llama/Qwen2/Qwen3/Mistral code where it changes
float32 results: RMSNorm in float32 then cast back, rotary as rotate_half with cos/sin computed in
float32, attention softmax in float32 (SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionShape:
    """heads, kv_heads, head_dim of a layer's attention; eps of its RMSNorms."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, config) -> AttentionShape:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_attention_heads, config.num_key_value_heads, head_dim, config.rms_norm_eps)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps), computed in float32 and cast back before the weight (as transformers)."""
    # F.rms_norm is x * rsqrt(mean(x^2) + eps), bit for bit transformers' three ops, in one call
    normalized = F.rms_norm(hidden.to(torch.float32), (hidden.shape[-1],), eps=eps)
    return weight * normalized.to(hidden.dtype)


def rotary_tables(
    inv_freq: torch.Tensor, attention_scaling: float, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for position_ids [B, T] (angles in float32, then cast to `dtype`)."""
    freqs = position_ids[..., None].float() * inv_freq.float()
    angles = torch.cat((freqs, freqs), dim=-1)
    cos = (angles.cos() * attention_scaling).to(dtype)
    sin = (angles.sin() * attention_scaling).to(dtype)
    return cos[:, None], sin[:, None]


def rotate_half(states: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


def grouped_mask(visible: torch.Tensor, shape: AttentionShape) -> torch.Tensor:
    """visible [B, 1, T, S] (True = may attend) repeated for the query heads that share a key head:
    [B, 1, group*T, S], the layout `attend` folds queries into. Made once per forward; every layer reads it."""
    group = shape.heads // shape.kv_heads
    return visible if group == 1 else visible[:, :, None].expand(-1, -1, group, -1, -1).flatten(2, 3)


def attend(
    query_key: torch.Tensor,
    value: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    shape: AttentionShape,
    cache=None,
    layer_index: int = 0,
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of T new entries per row: query_key [B, T, (heads+kv_heads)*head_dim] (the query's heads then
    the key's, projected, bias added: the first columns of a fused q/k/v product), value [B, T,
    kv_heads*head_dim]; returns [B, T, heads*head_dim] before the output projection.

    rotary: cos, sin from `rotary_tables`; mask: `grouped_mask` of the [B, 1, T, S] bool mask over the S keys
    attention reads;
    cache: None (the T new entries are all the keys) or any object whose `update(k, v, layer_index)`
    stores them and returns the layer's keys and values [B, kv_heads, S, head_dim] (a SlotCache after
    `prepare`, a DynamicCache); qk_norm: Qwen3's per-head RMSNorm weights of queries and keys.
    """
    batch_size, length = query_key.shape[:2]
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    query_key = query_key.view(batch_size, length, heads + kv_heads, head_dim)
    if qk_norm is not None:
        # one norm over all heads: each query head by q_norm's weight, each key head by k_norm's
        weight = torch.cat((qk_norm[0].expand(heads, -1), qk_norm[1].expand(kv_heads, -1)))
        query_key = rms_norm(query_key, weight, shape.eps)
    query_key = query_key.transpose(1, 2)
    cos, sin = rotary
    # rotary on queries and keys at once (the same elementwise maths as applying it to each)
    query_key = query_key * cos + rotate_half(query_key) * sin
    query, key = query_key.split((heads, kv_heads), dim=1)
    value = value.view(batch_size, length, kv_heads, head_dim).transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, layer_index)
    # grouped-query attention without copying keys: query head h reads kv head h // group, so the group's
    # queries are folded into the query length ([B, kv_heads, group*T, head_dim]), as the mask was
    folded_query = query.reshape(batch_size, kv_heads, heads // kv_heads * length, head_dim)
    output = F.scaled_dot_product_attention(folded_query, key, value, attn_mask=mask, scale=head_dim**-0.5)
    return output.view(batch_size, heads, length, head_dim).transpose(1, 2).reshape(batch_size, length, -1)


def gated(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The MLP's inner activation: silu(gate) * up."""
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """An RMSNorm whose parameter is `weight`, as transformers names it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.weight, self.eps)


class SelfAttention(nn.Module):
    """q/k/v/o projections (and Qwen3's q/k norms) under transformers' parameter names."""

    def __init__(self, config, attention_bias: bool, output_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        shape = AttentionShape.of(config)
        self.shape = shape
        hidden, query_width, kv_width = (
            config.hidden_size,
            shape.heads * shape.head_dim,
            shape.kv_heads * shape.head_dim,
        )
        self.q_proj = nn.Linear(hidden, query_width, bias=attention_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=attention_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=attention_bias)
        self.o_proj = nn.Linear(query_width, hidden, bias=output_bias)
        if qk_norm:
            self.q_norm = RMSNorm(shape.head_dim, shape.eps)
            self.k_norm = RMSNorm(shape.head_dim, shape.eps)


class GatedMLP(nn.Module):
    def __init__(self, config, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)


class DecoderLayer(nn.Module):
    """One Llama-family decoder layer as an nn.Module with transformers' parameter names
    (`self_attn.q_proj.weight`, `mlp.gate_proj.weight`, `post_attention_layernorm.weight`, ...), so its
    state_dict loads into and from transformers' own layer. The drafter trains it with autograd.

    `layout` says which biases and norms it has: `LayerLayout.of(target_layer)`.
    """

    def __init__(self, config, layout: LayerLayout) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, layout.attention_bias, layout.output_bias, layout.qk_norm)
        self.mlp = GatedMLP(config, layout.mlp_bias)
        self.input_layernorm: nn.Module = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        visible: torch.Tensor,
        cache=None,
        layer_index: int = 0,
    ) -> torch.Tensor:
        """hidden [B, T, H] -> [B, T, H]; visible: [B, 1, T, S] bool; rotary and cache as `attend` takes them."""
        attention, mlp = self.self_attn, self.mlp
        normed = self.input_layernorm(hidden)
        qk_norm = (attention.q_norm.weight, attention.k_norm.weight) if hasattr(attention, "q_norm") else None
        attended = attend(
            torch.cat((attention.q_proj(normed), attention.k_proj(normed)), dim=-1),
            attention.v_proj(normed),
            rotary,
            grouped_mask(visible, attention.shape),
            attention.shape,
            cache,
            layer_index,
            qk_norm,
        )
        hidden = hidden + attention.o_proj(attended)
        normed = self.post_attention_layernorm(hidden)
        return hidden + mlp.down_proj(gated(mlp.gate_proj(normed), mlp.up_proj(normed)))


@dataclass(frozen=True)
class LayerLayout:
    """Which optional parts a Llama-family layer has: bias on q/k/v, on o, on the MLP; q/k norms."""

    attention_bias: bool
    output_bias: bool
    mlp_bias: bool
    qk_norm: bool

    @classmethod
    def of(cls, layer: nn.Module) -> LayerLayout:
        """The layout of a transformers Llama/Qwen2/Qwen3/Mistral decoder layer (or of a DecoderLayer)."""
        attention, mlp = layer.self_attn, layer.mlp
        return cls(
            attention_bias=attention.q_proj.bias is not None,
            output_bias=attention.o_proj.bias is not None,
            mlp_bias=mlp.gate_proj.bias is not None,
            qk_norm=hasattr(attention, "q_norm"),
        )
