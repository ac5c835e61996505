"""The learner's bfloat16 compute on CPU with the rollout's weight copies: linear layers that multiply by
stochastically rounded bfloat16 copies of the float32 master weights, cast once per optimizer step.

Under `actor.precision: bf16` on CPU the actor's forwards run in bfloat16 autocast over float32 master
weights. Autocast casts each weight to bfloat16 by round-to-nearest at every use, and round-to-nearest
does not follow an RL-sized update (tlt_cli/engine/rounding.py): the learner's gradients would be taken at
weights that moved ~300x more than the policy did, and would not be the weights the rollout sampled with.
`RoundedLinearWeights(policy, skip)` gives every nn.Linear of the policy (the modules in `skip` excepted:
the head, which the log-prob pass runs in float32) a forward that multiplies by `stochastic_bfloat16` of
its weight under the same key as the rollout's decode copy, so the learner computes with the very same
bfloat16 values the rollout sampled from. The copy is made at a layer's first use and kept until `forget()`
or an in-place update of the weight (one copy of every weight, 2 bytes a parameter, for the length of an
update: one cast per weight per optimizer step instead of autocast's cast per use, and recomputation in
backward reads the same copy).
Gradients flow to the float32 weight as autocast's cast passes them: the bfloat16 gradient cast to float32.
The copies are used only inside `active()` (the learner's forwards and its backward, where recomputation
runs the forward again); elsewhere, in a rollout through the transformers path say, a layer is plain
nn.Linear. The actor calls `forget()` whenever its weights may have moved (before each pass over a batch)
and when an update ends (freeing the copies for the rollout). Everything else autocast does is unchanged.

Example:
    rounded = RoundedLinearWeights(policy, skip={policy.get_output_embeddings()})
    with rounded.active(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        loss = policy(input_ids).logits.sum()
    with rounded.active():
        loss.backward()
    optimizer.step(); rounded.forget()
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tlt_cli.engine.rounding import parameter_key, stochastic_bfloat16


class RoundedLinearWeights:
    """Stochastically rounded bfloat16 weights for every nn.Linear of a module; see the module docstring."""

    def __init__(self, module: nn.Module, skip: set[nn.Module]) -> None:
        # id(weight) -> (the weight's version when cast, its copy)
        self.copies: dict[int, tuple[int, torch.Tensor]] = {}
        self.in_use = False
        skipped = {id(layer) for layer in skip}
        for name, layer in module.named_modules():
            if isinstance(layer, nn.Linear) and id(layer) not in skipped:
                layer.forward = self._forward_of(layer, parameter_key(f"{name}.weight"))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: the linear layers multiply by the rounded copies (outside: by their own weights)."""
        previous, self.in_use = self.in_use, True
        try:
            yield
        finally:
            self.in_use = previous

    def forget(self) -> None:
        """Drop every copy: the next forward rounds the weights as they are then."""
        self.copies.clear()

    @property
    def copy_bytes(self) -> int:
        return sum(copy.numel() * copy.element_size() for _, copy in self.copies.values())

    def _forward_of(self, layer: nn.Linear, key: int):
        def forward(inputs: torch.Tensor) -> torch.Tensor:
            if not self.in_use:
                return F.linear(inputs, layer.weight, layer.bias)
            weight = _RoundedCopy.apply(layer.weight, self._copy(layer.weight, key))
            return F.linear(inputs, weight, layer.bias)

        return forward

    def _copy(self, weight: torch.Tensor, key: int) -> torch.Tensor:
        """The weight's copy, cast again if an in-place update (an optimizer step) bumped its version since."""
        version, copy = self.copies.get(id(weight), (None, None))
        if copy is None or version != weight._version:
            copy = stochastic_bfloat16(weight, key)
            self.copies[id(weight)] = (weight._version, copy)
        return copy


class _RoundedCopy(torch.autograd.Function):
    """Forward: the weight's bfloat16 copy; backward: the copy's gradient, cast to the weight's dtype (what
    autocast's cast of the weight does)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.weight_dtype = weight.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gradient.to(ctx.weight_dtype), None
