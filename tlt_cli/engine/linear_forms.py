"""Linear layers computed, during generation only, in the form of product fastest for the rows of each pass.

On a CPU the cost of `y = x W^T` at 1-16 rows depends on how it is asked for, not only on the bytes of W
(2-core AVX2 EPYC, float32, weights streaming from memory: 1536x576 at 1 row costs 44 ms per 120
matrices with `F.linear` and 27 ms with a contiguous transposed copy; 49152x576 at 3 rows 42 ms with
`F.linear`, 8 ms weight-major). Three forms of the same product, all [rows, in] -> [rows, out]:

  - `linear`: `F.linear(x, W, b)`, what nn.Linear does (and the only form used for more rows than
    the plan measured, under autograd, or for a shape whose plan never picks another form);
  - `transposed`: `x @ W_t` with W_t = W.t() kept as a contiguous copy (`TransposedCopy`);
  - `weight_major`: `(W @ x.T).T`, made contiguous so it has the layout F.linear returns.

A `LinearFormPlan` (measured by tlt_cli/engine/linear_forms_measure.py) names a form per weight shape
and per row count. `LinearForms` applies it to every `nn.Linear` of the given modules (the target's
decoder layers and lm_head, tied or untied, and the drafter's) for the length of a `with
forms.applied():` block: it sets each layer's `forward` as an instance attribute and deletes it on
exit, so nothing outside the block (the actor's training, another module, another call) sees a
change, and nothing is patched globally. The engine (tlt_cli/rollout/engine.py) opens that block
around each generate call. Even inside it, a call with gradients enabled takes `F.linear`, so a
backward never goes through another form.

Copies: a shape gets transposed copies only if its plan uses `transposed` at some row count; at most
one copy per weight (`extra_bytes`). A copy is refreshed (W.t() copied into the same buffer: one read
and one write of the weight; 0.4 s for all 513 MiB of SmolLM2-135M's on a loaded 2-core CPU) by
`refresh()`, which the rollout backends call after every actor update, and automatically before use
whenever the weight's storage or autograd version counter changed (an in-place optimizer step bumps
it). Writes through `.data` (DeepSpeed's ZeRO partitions) bump neither, which is why `refresh()` after
each update is still needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LINEAR, TRANSPOSED, WEIGHT_MAJOR = "linear", "transposed", "weight_major"
FORM_NAMES = (LINEAR, TRANSPOSED, WEIGHT_MAJOR)


def linear_product(inputs: torch.Tensor, weight: torch.Tensor, transposed: torch.Tensor | None, bias):
    """F.linear: [rows, in] x [out, in]^T -> [rows, out]."""
    return F.linear(inputs, weight, bias)


def transposed_product(inputs: torch.Tensor, weight: torch.Tensor, transposed: torch.Tensor, bias):
    """x @ W_t with the contiguous copy W_t = W.t() [in, out] (+ b)."""
    return torch.mm(inputs, transposed) if bias is None else torch.addmm(bias, inputs, transposed)


def weight_major_product(inputs: torch.Tensor, weight: torch.Tensor, transposed: torch.Tensor | None, bias):
    """(W @ x.T).T: [out, in] x [in, rows] -> [out, rows], returned as a contiguous [rows, out] (+ b)."""
    product = torch.mm(weight, inputs.t()) if bias is None else torch.addmm(bias[:, None], weight, inputs.t())
    return product.t().contiguous()


FORMS: dict[str, Callable] = {
    LINEAR: linear_product,
    TRANSPOSED: transposed_product,
    WEIGHT_MAJOR: weight_major_product,
}


def shape_key(weight: torch.Tensor) -> str:
    """A weight's plan key: '<out>x<in> <dtype>' (e.g. '1536x576 float32')."""
    return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"


def linear_layers(modules: Iterable[nn.Module | None]) -> list[nn.Linear]:
    """Every plain nn.Linear of `modules` (None skipped), each once, in module order; layers whose
    `forward` someone else already replaced (accelerate hooks, adapters) are left alone."""
    found: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None:
            continue
        for layer in module.modules():
            if type(layer) is nn.Linear and "forward" not in vars(layer):
                found.setdefault(id(layer), layer)
    return list(found.values())


@dataclass(frozen=True)
class LinearFormPlan:
    """Which form computes each weight shape at each measured row count.

    row_buckets: the row counts measured, ascending; forms: shape key -> one form name per bucket. A
    pass of r rows takes the form of the smallest bucket >= r; above the largest bucket, `linear`.
    """

    row_buckets: tuple[int, ...]
    forms: dict[str, tuple[str, ...]]

    def forms_by_rows(self, key: str) -> tuple[str, ...]:
        """Form name for 0..max(row_buckets) rows (0 rows: linear); all linear for an unknown shape."""
        chosen = self.forms.get(key, (LINEAR,) * len(self.row_buckets))
        by_rows, bucket = [LINEAR], 0
        for rows in range(1, self.row_buckets[-1] + 1):
            while self.row_buckets[bucket] < rows:
                bucket += 1
            by_rows.append(chosen[bucket])
        return tuple(by_rows)

    def to_dict(self) -> dict:
        return {"row_buckets": list(self.row_buckets), "forms": {key: list(names) for key, names in self.forms.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> LinearFormPlan:
        forms = {key: tuple(names) for key, names in data["forms"].items()}
        unknown = {name for names in forms.values() for name in names} - set(FORM_NAMES)
        if unknown:
            raise ValueError(f"the plan names unknown forms {sorted(unknown)}; known: {', '.join(FORM_NAMES)}.")
        return cls(tuple(data["row_buckets"]), forms)

    @classmethod
    def uniform(cls, form: str, keys: Iterable[str], row_buckets: tuple[int, ...] = (64,)) -> LinearFormPlan:
        """One form at every row count up to max(row_buckets) for every shape in `keys`."""
        return cls(row_buckets, {key: (form,) * len(row_buckets) for key in keys})


class TransposedCopy:
    """A contiguous copy of `layer.weight.t()` [in, out] that follows the weight (see the module docstring)."""

    def __init__(self, layer: nn.Linear) -> None:
        self.layer = layer
        self.buffer: torch.Tensor | None = None
        self.seen: tuple[int, int, int] | None = None

    def fresh(self) -> torch.Tensor:
        """The copy, refreshed first if the weight's storage or version changed since the last copy."""
        weight = self.layer.weight
        if self.seen != (id(weight), weight.data_ptr(), weight._version):
            self.refresh()
        return self.buffer

    def refresh(self) -> None:
        """Copy W.t() into the buffer (allocated again only if the weight's shape, dtype or device changed)."""
        weight = self.layer.weight
        transposed = weight.detach().t()
        buffer = self.buffer
        if buffer is None or (buffer.shape, buffer.dtype, buffer.device) != (
            transposed.shape,
            weight.dtype,
            weight.device,
        ):
            self.buffer = buffer = torch.empty(transposed.shape, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            buffer.copy_(transposed)
        self.seen = (id(weight), weight.data_ptr(), weight._version)

    @property
    def nbytes(self) -> int:
        weight = self.layer.weight
        return weight.numel() * weight.element_size()


class FormedLinear:
    """One nn.Linear's forward in the form its plan picks for the rows of each call."""

    def __init__(self, layer: nn.Linear, forms_by_rows: tuple[str, ...]) -> None:
        self.layer = layer
        self.products = tuple(FORMS[name] for name in forms_by_rows)
        self.transposed = TransposedCopy(layer) if TRANSPOSED in forms_by_rows else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        rows = inputs.numel() // inputs.shape[-1] if inputs.shape[-1] else 0
        planned = rows < len(self.products) and not torch.is_grad_enabled()
        product = self.products[rows] if planned else linear_product
        if product is linear_product:
            return F.linear(inputs, layer.weight, layer.bias)
        transposed = self.transposed.fresh() if product is transposed_product else None
        outputs = product(inputs.reshape(rows, inputs.shape[-1]), layer.weight, transposed, layer.bias)
        return outputs.view(*inputs.shape[:-1], outputs.shape[-1])


class LinearForms:
    """A plan applied to the nn.Linear layers of `modules` (see the module docstring).

    Example:
        forms = LinearForms([model, drafter], plan)
        with torch.no_grad(), forms.applied():
            logits = model(input_ids).logits
        ...optimizer step...
        forms.refresh()
    """

    def __init__(self, modules: Iterable[nn.Module | None], plan: LinearFormPlan) -> None:
        self.plan = plan
        self.layers: list[FormedLinear] = []
        for layer in linear_layers(modules):
            forms_by_rows = plan.forms_by_rows(shape_key(layer.weight))
            if any(name != LINEAR for name in forms_by_rows):
                self.layers.append(FormedLinear(layer, forms_by_rows))
        self.refresh()

    def keep_only(self, modules: Iterable[nn.Module | None]) -> None:
        """Form only the layers of `modules` from now on; the others' transposed copies are freed (the engine
        calls it when its decode model computes the policy with weights of its own, never through the
        policy's nn.Linear layers; a layer the drafter shares with the policy, its head, stays formed)."""
        kept = {id(layer) for layer in linear_layers(modules)}
        self.layers = [formed for formed in self.layers if id(formed.layer) in kept]

    @property
    def copies(self) -> list[TransposedCopy]:
        return [formed.transposed for formed in self.layers if formed.transposed is not None]

    @property
    def extra_bytes(self) -> int:
        """Bytes of the transposed copies (at most one per weight)."""
        return sum(copy.nbytes for copy in self.copies)

    def refresh(self) -> None:
        """Copy every weight into its transposed copy: call after the weights changed (an actor update)."""
        for copy in self.copies:
            copy.refresh()

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block, the planned layers compute in their planned forms; afterwards they are plain
        nn.Linear again (a layer whose forward someone else replaced meanwhile is left alone)."""
        formed = [item for item in self.layers if "forward" not in vars(item.layer)]
        for item in formed:
            item.layer.forward = item.forward
        try:
            yield
        finally:
            for item in formed:
                del item.layer.forward

    def describe(self) -> str:
        """One line: the forms picked per shape, and the copies' memory."""
        shapes = [
            f"{key}: {form_ranges(self.plan.row_buckets, names)}"
            for key, names in sorted(self.plan.forms.items())
            if any(name != LINEAR for name in names)
        ]
        picked = "; ".join(shapes) if shapes else f"{LINEAR} everywhere"
        return (
            f"linear forms: {picked}; {len(self.layers)} layers formed, transposed copies "
            f"{self.extra_bytes / 2**20:.1f} MiB ({self.extra_bytes} bytes)"
        )


def form_ranges(row_buckets: tuple[int, ...], names: tuple[str, ...]) -> str:
    """'1 transposed, 2-8 weight_major, 9-64 linear': consecutive buckets with one form merged."""
    parts, start = [], 1
    for index, name in enumerate(names):
        last = index == len(names) - 1
        if last or names[index + 1] != name:
            end = row_buckets[index]
            parts.append(f"{start}{'' if start == end else f'-{end}'} {name}")
            start = end + 1
    return ", ".join(parts)
