"""Linear layers computed, during generation only, in the form of product fastest for the rows of each pass.

On a CPU the cost of `y = x W^T` at 1-16 rows depends on how it is asked for, not only on the bytes of W
(2-core AVX2 EPYC, float32, weights streaming from memory: 1536x576 at 1 row costs 44 ms per 120
matrices with `F.linear` and 27 ms with a contiguous transposed copy; 49152x576 at 3 rows 42 ms with
`F.linear`, 8 ms weight-major). Three forms of the same product, all [rows, in] -> [rows, out]:

  - `linear`: `F.linear(x, W, b)`, what nn.Linear does (and the only form used for more rows than
    the plan measured, under autograd, or for a shape whose plan never picks another form);
  - `transposed`: `x @ W_t` with W_t = W.t() kept as a contiguous copy (`TransposedCopy`);
  - `weight_major`: `(W @ x.T).T`, made contiguous so it has the layout F.linear returns.

A `LinearFormPlan` (measured and cached per machine by tlt_cli/tuning/linear_forms.py) names a form per
weight shape and per row count. Whoever decodes receives the plan; no module's forward is ever patched:

  - the owned Llama-family forward (llama_family.py) lays its own fused weight copies out by the plan;
  - every other module (the transformers path's policy, the drafter) decodes through a `FormedCopy`: a
    decode-time copy of its module tree that shares every parameter and submodule with the original
    except the planned nn.Linear layers, which it replaces by `FormedLinear` modules computing the same
    product from the original layer's own parameters in the planned form. The original tree (the one the
    actor trains) is never touched; a call with gradients enabled takes `F.linear` all the same.

Copies: a layer gets a transposed copy only if its plan uses `transposed` at some row count. A copy is
re-read (W.t() copied into the same buffer) by `FormedCopy.refresh()`, which the rollout backends call
after every actor update, and automatically before use whenever the weight's storage or autograd
version counter changed (an in-place optimizer step bumps it). Writes through `.data` (DeepSpeed's ZeRO
partitions) bump neither, which is why `refresh()` after each update is still needed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
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


def is_plain_linear(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear computing as nn.Linear does: not a subclass, no forward of its own set
    by someone else (accelerate hooks, adapters), no forward hooks (they would not run on a stand-in)."""
    return (
        type(module) is nn.Linear
        and "forward" not in vars(module)
        and not (module._forward_hooks or module._forward_pre_hooks)
    )


def linear_layers(modules: Iterable[nn.Module | None]) -> list[nn.Linear]:
    """Every plain nn.Linear of `modules` (None skipped), each once, in module order."""
    found: dict[int, nn.Linear] = {}
    for module in modules:
        if module is None:
            continue
        for layer in module.modules():
            if is_plain_linear(layer):
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
        """The copy, re-read first if the weight's storage or version changed since the last read (or after release)."""
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

    def release(self) -> None:
        """Free the buffer; the next `fresh()` reads the weight again."""
        self.buffer, self.seen = None, None

    @property
    def nbytes(self) -> int:
        """Bytes the copy holds now (0 once released)."""
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()


class FormedLinear(nn.Module):
    """A decode-time stand-in for one nn.Linear: the layer's own weight and bias (read at every call, never
    copied but for its transposed copy) multiplied in the form its plan picks for the rows of each call."""

    def __init__(self, layer: nn.Linear, forms_by_rows: tuple[str, ...]) -> None:
        super().__init__()
        # the original layer, deliberately not registered as a submodule: its owner trains it, this only reads it
        object.__setattr__(self, "layer", layer)
        self.forms_by_rows = forms_by_rows
        self.products = tuple(FORMS[name] for name in forms_by_rows)
        self.transposed = TransposedCopy(layer) if TRANSPOSED in forms_by_rows else None
        self.training = False

    @property
    def weight(self) -> nn.Parameter:
        """The original layer's weight (code that reads `.weight` of a layer, for its dtype say, sees the same)."""
        return self.layer.weight

    @property
    def bias(self) -> nn.Parameter | None:
        return self.layer.bias

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

    def extra_repr(self) -> str:
        """'576x576 float32, 1 transposed, 2-8 weight_major' (what print(model) shows of a decode copy)."""
        measured_rows = tuple(range(1, len(self.forms_by_rows)))
        return f"{shape_key(self.layer.weight)}, {form_ranges(measured_rows, self.forms_by_rows[1:])}"


class FormedCopy:
    """A decode-time copy of `root` whose planned nn.Linear layers compute in their forms (see the module
    docstring). `module` is the copy: every submodule on the way to a formed layer is a shallow copy (its own
    children, in eval mode; the same parameters, buffers and hooks), every other submodule is the original.

    Example:
        formed = FormedCopy(policy, plan)
        with torch.no_grad():
            logits = formed.module(input_ids).logits
        ...actor update through .data...
        formed.refresh()
    """

    def __init__(self, root: nn.Module, plan: LinearFormPlan) -> None:
        self.plan = plan
        self.layers: list[FormedLinear] = []
        self.module = self._copied(root, {})
        self.refresh()

    def _copied(self, module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
        """`module` itself when nothing under it is formed, else its stand-in or a shallow copy over copied children
        (`done`: the copy of each module met so far, so a module met twice has one copy)."""
        if id(module) not in done:
            formed = self._formed(module)
            done[id(module)] = formed if formed is not None else self._with_children_copied(module, done)
        return done[id(module)]

    def _formed(self, module: nn.Module) -> FormedLinear | None:
        if not is_plain_linear(module):
            return None
        forms_by_rows = self.plan.forms_by_rows(shape_key(module.weight))
        if all(name == LINEAR for name in forms_by_rows):
            return None
        formed = FormedLinear(module, forms_by_rows)
        self.layers.append(formed)
        return formed

    def _with_children_copied(self, module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
        children = {
            name: None if child is None else self._copied(child, done) for name, child in module._modules.items()
        }
        if all(children[name] is child for name, child in module._modules.items()):
            return module
        duplicate = copy.copy(module)
        duplicate._modules = children
        duplicate.training = False
        return duplicate

    @property
    def extra_bytes(self) -> int:
        """Bytes of the transposed copies held now (at most one per weight)."""
        return sum(formed.transposed.nbytes for formed in self.layers if formed.transposed is not None)

    def refresh(self) -> None:
        """Copy every weight into its transposed copy: call after the weights changed (an actor update)."""
        for formed in self.layers:
            if formed.transposed is not None:
                formed.transposed.refresh()

    def release(self) -> None:
        """Free the transposed copies until the next `refresh()` or use."""
        for formed in self.layers:
            if formed.transposed is not None:
                formed.transposed.release()


def describe_plan(plan: LinearFormPlan) -> str:
    """One line for the run log: the forms the plan picks per shape (shapes that keep `linear` everywhere left out)."""
    shapes = [
        f"{key}: {form_ranges(plan.row_buckets, names)}"
        for key, names in sorted(plan.forms.items())
        if any(name != LINEAR for name in names)
    ]
    return f"linear forms: {'; '.join(shapes) if shapes else f'{LINEAR} everywhere'}"


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
