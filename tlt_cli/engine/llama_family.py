"""The owned decode forward of the Llama family: Llama (Llama 3's rope scaling included), Qwen2, Qwen3 and
Mistral, with grouped-query attention and a tied or untied head.

`LlamaFamilyModel(policy)` reads the policy module's parameters into the engine's own tensors once (and
again on `refresh()`, after each actor update; `release()` frees them for the update in between): q/k/v
fused into one product and gate/up into another, each product kept in the layout its measured plan
(`linear_plan`, tlt_cli/engine/linear_forms.py) picks per row count. The forward is plain torch
(one loop over the layers, the layer's maths in tlt_cli/engine/layers.py), fills a `SlotCache` by its
own calls and never calls a transformers module, so a transformers release cannot break it. Greedy output
equals transformers' `generate` in float32.

`refusal(policy)` says why a model is not one this forward reproduces exactly (the factory then takes
the transformers path): another architecture, a sliding window in use, a rope type other than
default/linear/llama3, an activation other than SiLU, or a layer that does not look like the family's.

Product forms (measured on this CPU, see docs/design.md, "What a verify pass costs"): `linear` is F.linear on
W [out, in]; `transposed` is x @ W_t with a contiguous copy W_t [in, out] (1.6x faster at 1 row);
`weight_major` is (W @ x.T).T (fastest for a big head at 2-4 rows). A fused product keeps only W_t when
its plan ever uses `transposed` (then every row count multiplies by W_t), else only W.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tlt_cli.engine.kv_cache import SlotCache
from tlt_cli.engine.layers import AttentionShape, attend, gated, grouped_mask, rms_norm, rotary_tables
from tlt_cli.engine.linear_forms import FORMS, LINEAR, TRANSPOSED, LinearFormPlan, form_ranges
from tlt_cli.engine.rounding import parameter_key, stochastic_bfloat16

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_TYPES = ("default", "linear", "llama3")
PROJECTIONS = ("qkv", "o", "gate_up", "down", "head")
PATH_NAME = "owned llama-family"


def refusal(policy: nn.Module) -> str | None:
    """Why the owned forward would not reproduce `policy` exactly, or None when it does."""
    config = policy.config
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        return f"rope type {rope.get('rope_type')!r} is not one of {', '.join(ROPE_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        return f"sliding window {window} is shorter than max_position_embeddings {config.max_position_embeddings}"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "some layers use sliding-window attention"
    decoder = policy.get_decoder()
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(decoder).__name__} lacks embed_tokens, layers, norm or rotary_emb"
    if type(policy.get_output_embeddings()) is not nn.Linear:
        return "the output head is not a plain nn.Linear"
    for layer in decoder.layers:
        reason = _layer_refusal(layer, config)
        if reason is not None:
            return f"{type(layer).__name__}: {reason}"
    return None


def _layer_refusal(layer: nn.Module, config) -> str | None:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(projection) is nn.Linear for projection in projections):
        return "a projection is missing or not a plain nn.Linear"
    q, k, v, _, gate, up, down = projections
    if len({q.bias is None, k.bias is None, v.bias is None}) > 1:
        return "q/k/v differ in having a bias"
    if len({gate.bias is None, up.bias is None, down.bias is None}) > 1:
        return "gate/up/down differ in having a bias"
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    norms += [getattr(attention, name) for name in ("q_norm", "k_norm") if hasattr(attention, name)]
    if any(getattr(norm, "variance_epsilon", None) != config.rms_norm_eps for norm in norms):
        return "a norm is not an RMSNorm with the config's rms_norm_eps"
    return None


@dataclass
class Projection:
    """One product's weights as the engine keeps them: W [out, in] and/or W_t [in, out], bias [out] or None."""

    weight: torch.Tensor | None
    transposed: torch.Tensor | None
    bias: torch.Tensor | None


@dataclass
class LayerWeights:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qk_norm: tuple[torch.Tensor, torch.Tensor] | None


def product(form: str, inputs: torch.Tensor, projection: Projection) -> torch.Tensor:
    """[rows, in] -> [rows, out] by the linear forms' product of that name (a fused product that keeps only W_t
    multiplies by it whatever the form)."""
    form = TRANSPOSED if projection.weight is None else form
    return FORMS[form](inputs, projection.weight, projection.transposed, projection.bias)


class LlamaFamilyModel:
    """The DecodeModel (tlt_cli/engine/interface.py) of a Llama-family policy; see the module docstring.

    Example:
        model = LlamaFamilyModel(policy)
        cache = model.new_cache(1, 64)
        hidden = model.forward_block(cache, ids, positions, positions, ids.shape[1], causal_visible)
    """

    path = PATH_NAME

    def __init__(
        self,
        policy: nn.Module,
        dtype: torch.dtype | None = None,
        linear_plan: LinearFormPlan | None = None,
        stochastic_rounding: bool = True,
    ):
        reason = refusal(policy)
        if reason is not None:
            raise ValueError(f"the owned forward does not reproduce this model: {reason}.")
        self.policy = policy
        # the weights' own dtype unless another is asked for (bfloat16 copies of a float32 policy)
        self.dtype = dtype if dtype is not None else policy.get_input_embeddings().weight.dtype
        # bfloat16 copies of float32 weights rounded as the learner's are (rounding.py), or to nearest
        self.stochastic_rounding = stochastic_rounding
        dtype = self.dtype
        config = policy.config
        self.shape = AttentionShape.of(config)
        self.widths = (
            self.shape.heads * self.shape.head_dim,
            self.shape.kv_heads * self.shape.head_dim,
            self.shape.kv_heads * self.shape.head_dim,
        )
        self.intermediate_size = config.intermediate_size
        decoder = policy.get_decoder()
        self.forms = {name: _forms_of(name, decoder, policy, dtype, linear_plan) for name in PROJECTIONS}
        self.layers: list[LayerWeights] = []
        self._owned: list[torch.Tensor] = []
        self.refresh()

    @property
    def extra_bytes(self) -> int:
        """Bytes of the tensors this model holds beyond the policy's own (fused, transposed, cast copies)."""
        return sum(tensor.numel() * tensor.element_size() for tensor in self._owned)

    def describe(self) -> str:
        forms = ", ".join(f"{name} {_form_summary(self.forms[name])}" for name in PROJECTIONS)
        return (
            f"decode path: {self.path} ({str(self.dtype).removeprefix('torch.')}; forms: {forms}); own weight "
            f"copies {self.extra_bytes / 2**20:.1f} MiB ({self.extra_bytes} bytes)"
        )

    def new_cache(self, batch_size: int, capacity: int) -> SlotCache:
        return SlotCache(batch_size, capacity)

    def refresh(self) -> None:
        """Read every weight of the policy again into this model's tensors (buffers of unchanged shape are reused)."""
        decoder, reader = self.policy.get_decoder(), _Reader(self.dtype, self._owned, self._rounding_keys())
        previous = self.layers or [None] * len(decoder.layers)
        self.embed = reader.tensor([decoder.embed_tokens.weight])
        self.final_norm = reader.tensor([decoder.norm.weight])
        rotary = decoder.rotary_emb
        self.inv_freq, self.attention_scaling = rotary.inv_freq.detach().float(), float(rotary.attention_scaling)
        self.layers = [self._layer(layer, reader, old) for layer, old in zip(decoder.layers, previous, strict=True)]
        head = self.policy.get_output_embeddings()
        self.head = reader.projection([head.weight], [head.bias], self.forms["head"], getattr(self, "head", None))
        self._owned = reader.owned
        self._seen = self._versions()

    def _rounding_keys(self) -> dict[int, int]:
        """id(parameter) -> its rounding key, when float32 weights are copied to bfloat16 stochastically."""
        if not (self.stochastic_rounding and self.dtype == torch.bfloat16):
            return {}
        return {id(parameter): parameter_key(name) for name, parameter in self.policy.named_parameters()}

    def refresh_if_changed(self) -> None:
        """`refresh()` if any weight's storage or autograd version changed since the last read, or after `release()`."""
        if self._seen is None or self._versions() != self._seen:
            self.refresh()

    def release(self) -> None:
        """Drop the fused, transposed and cast copies (views of the policy's parameters cost nothing); the next
        `refresh()` reads them again, into new buffers."""
        self.layers, self._owned, self._seen = [], [], None
        self.embed = self.final_norm = self.head = None

    def _versions(self) -> list[tuple[int, int]]:
        return [(parameter.data_ptr(), parameter._version) for parameter in self.policy.parameters()]

    def _layer(self, layer: nn.Module, reader: _Reader, old: LayerWeights | None) -> LayerWeights:
        attention, mlp, forms = layer.self_attn, layer.mlp, self.forms
        qkv = [attention.q_proj, attention.k_proj, attention.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        qk_norm = None
        if hasattr(attention, "q_norm"):
            qk_norm = (reader.tensor([attention.q_norm.weight]), reader.tensor([attention.k_norm.weight]))
        return LayerWeights(
            qkv=reader.projection(*_weights_and_biases(qkv), forms["qkv"], old and old.qkv),
            o=reader.projection(*_weights_and_biases([attention.o_proj]), forms["o"], old and old.o),
            gate_up=reader.projection(*_weights_and_biases(gate_up), forms["gate_up"], old and old.gate_up),
            down=reader.projection(*_weights_and_biases([mlp.down_proj]), forms["down"], old and old.down),
            input_norm=reader.tensor([layer.input_layernorm.weight]),
            post_norm=reader.tensor([layer.post_attention_layernorm.weight]),
            qk_norm=qk_norm,
        )

    def forward_block(
        self,
        cache: SlotCache,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        write_slots: torch.Tensor,
        kv_length: int,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """T new entries per row through every layer over `cache`; the final-normed hidden state [B, T, H]
        (see DecodeModel.forward_block)."""
        batch_size, length = input_ids.shape
        rows = batch_size * length
        cache.prepare(write_slots, kv_length)
        hidden = F.embedding(input_ids, self.embed)
        rotary = rotary_tables(self.inv_freq, self.attention_scaling, position_ids, hidden.dtype)
        qkv_form, o_form, gate_up_form, down_form = (_form_at(self.forms[name], rows) for name in PROJECTIONS[:4])
        eps, inner = self.shape.eps, self.intermediate_size
        split = (self.widths[0] + self.widths[1], self.widths[2])  # queries and keys | values
        mask = grouped_mask(visible, self.shape)
        for index, layer in enumerate(self.layers):
            normed = rms_norm(hidden, layer.input_norm, eps).view(rows, -1)
            query_key, value = product(qkv_form, normed, layer.qkv).view(batch_size, length, -1).split(split, -1)
            attended = attend(query_key, value, rotary, mask, self.shape, cache, index, layer.qk_norm)
            hidden = hidden + product(o_form, attended.view(rows, -1), layer.o).view(batch_size, length, -1)
            normed = rms_norm(hidden, layer.post_norm, eps).view(rows, -1)
            gate, up = product(gate_up_form, normed, layer.gate_up).split(inner, -1)
            hidden = hidden + product(down_form, gated(gate, up), layer.down).view(batch_size, length, -1)
        return rms_norm(hidden, self.final_norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32 through the head, in the form planned for the rows."""
        rows = hidden.numel() // hidden.shape[-1]
        flat = hidden.reshape(rows, hidden.shape[-1]).to(self.dtype)
        return product(_form_at(self.forms["head"], rows), flat, self.head).view(*hidden.shape[:-1], -1).float()


class _Reader:
    """Reads parameters into this model's tensors: a view of the parameter when neither a cast, a fusion nor
    a transpose is needed, else a copy (into the previous buffer when its shape still fits), remembered in
    `owned`. A float32 parameter with a key in `rounding_keys` is cast to bfloat16 by `stochastic_bfloat16`
    (the learner's rounding), any other cast rounds to nearest."""

    def __init__(self, dtype: torch.dtype, previous: list[torch.Tensor], rounding_keys: dict[int, int]) -> None:
        self.dtype = dtype
        self.previous = {id(tensor) for tensor in previous}
        self.rounding_keys = rounding_keys
        self.owned: list[torch.Tensor] = []

    def tensor(self, parts: list[torch.Tensor], transpose: bool = False, reuse: torch.Tensor | None = None):
        """parts stacked along dim 0 ([sum out, in], or [sum out] for biases), or their transpose [in, sum out]."""
        first = parts[0].detach()
        if len(parts) == 1 and not transpose and first.dtype == self.dtype:
            return first
        rows = sum(part.shape[0] for part in parts)
        shape = (first.shape[1], rows) if transpose else (rows, *first.shape[1:])
        fits = reuse is not None and id(reuse) in self.previous and reuse.shape == shape and reuse.dtype == self.dtype
        buffer = reuse if fits and reuse.device == first.device else first.new_empty(shape, dtype=self.dtype)
        start = 0
        with torch.no_grad():
            for part in parts:
                end = start + part.shape[0]
                if transpose:
                    buffer[:, start:end].copy_(self._rounded(part).t())
                elif not self._round_into(part, buffer[start:end]):
                    buffer[start:end].copy_(part.detach())
                start = end
        self.owned.append(buffer)
        return buffer

    def _rounded(self, part: torch.Tensor) -> torch.Tensor:
        """The part, rounded stochastically to bfloat16 when it has a rounding key (else as copy_ casts it)."""
        rounded = torch.empty(part.shape, dtype=self.dtype, device=part.device)
        return rounded if self._round_into(part, rounded) else part.detach()

    def _round_into(self, part: torch.Tensor, out: torch.Tensor) -> bool:
        """Write the part's stochastically rounded bfloat16 copy into contiguous `out`, if it has a rounding key."""
        key = self.rounding_keys.get(id(part))
        if key is None or part.dtype != torch.float32:
            return False
        stochastic_bfloat16(part, key, out=out)
        return True

    def projection(
        self, weights: list[torch.Tensor], biases: list, forms: tuple[str, ...], old: Projection | None
    ) -> Projection:
        transposed_used = TRANSPOSED in forms
        # a fused product with a transposed form keeps only W_t (every form then multiplies by it)
        keeps_weight = not (transposed_used and len(weights) > 1)
        return Projection(
            weight=self.tensor(weights, reuse=old and old.weight) if keeps_weight else None,
            transposed=self.tensor(weights, True, old and old.transposed) if transposed_used else None,
            bias=None if biases[0] is None else self.tensor(biases, reuse=old and old.bias),
        )


def _weights_and_biases(layers: list[nn.Linear]) -> tuple[list[torch.Tensor], list]:
    return [layer.weight for layer in layers], [layer.bias for layer in layers]


def _forms_of(name: str, decoder: nn.Module, policy: nn.Module, dtype: torch.dtype, plan) -> tuple[str, ...]:
    """The planned form of projection `name` per row count (index = rows; more rows: linear). A fused product
    whose own shape the plan never measured takes the form of its first part's shape."""
    if plan is None:
        return (LINEAR,)
    layer = decoder.layers[0]
    parts = {
        "qkv": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
        "o": [layer.self_attn.o_proj],
        "gate_up": [layer.mlp.gate_proj, layer.mlp.up_proj],
        "down": [layer.mlp.down_proj],
        "head": [policy.get_output_embeddings()],
    }[name]
    dtype_name = str(dtype).removeprefix("torch.")
    fused_key = f"{sum(part.weight.shape[0] for part in parts)}x{parts[0].weight.shape[1]} {dtype_name}"
    first_key = f"{parts[0].weight.shape[0]}x{parts[0].weight.shape[1]} {dtype_name}"
    return plan.forms_by_rows(fused_key if fused_key in plan.forms else first_key)


def _form_at(forms: tuple[str, ...], rows: int) -> str:
    return forms[rows] if rows < len(forms) else LINEAR


def _form_summary(forms: tuple[str, ...]) -> str:
    """'1 transposed, 2-4 weight_major, 5+ linear' (forms: index = rows)."""
    measured = form_ranges(tuple(range(1, len(forms))), forms[1:])
    return ", ".join([*([measured] if measured else []), f"{len(forms)}+ {LINEAR}"])
