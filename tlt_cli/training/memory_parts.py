"""A worker's resident memory by part at each step's end, freed memory returned, one warning past the estimate.

The worker loop (worker_loop.py) makes one `MemoryWatch` and calls `phase_end()` when its rollout is over and
`step_end(step, rollout_peak, update_peak)` when its step is; `take_warnings()` goes into the step's report:

    watch = MemoryWatch.for_recipe(recipe, policy, optimizer, drafter)
    ...rollout...;  watch.phase_end()
    ...update...;   metrics.update(watch.step_end(step, rollout_peak, update_peak))

`phase_end` hands malloc's free pages back (tlt_cli/memory_hygiene.py), so the next phase starts from what is
alive. `step_end` splits the resident set, before it returns the update's freed memory, into `MemoryParts`: what
torch holds in tensors (the policy's weights, their gradients, the optimizer's state, the drafter, every other
live tensor: DeepSpeed's buffers, the sidecar's window), what malloc holds in use beyond them (kernel caches, C++
and large Python objects) and the rest (malloc's resident free lists, Python's small objects, libraries, stacks),
and reports them as `memory_<part>_gb` with what malloc_trim gave back (`memory_returned_gb`). When the step's peak
passes the estimate made before the run (memory.py `worker_peak_estimate`) by more than `ESTIMATE_MARGIN`, it
warns once, naming the part that grew most since the first step.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, fields
from typing import Any

import torch

from tlt_cli.memory_hygiene import malloc_counts, return_freed_memory
from tlt_cli.training import memory

# a peak this far above the estimate gets one warning
ESTIMATE_MARGIN = 0.15


@dataclass(frozen=True)
class MemoryParts:
    """A worker's resident set by part, in bytes; the parts add up to `resident_bytes`."""

    policy_weights: int
    gradients: int
    optimizer: int
    drafter: int
    other_tensors: int
    # malloc's chunks in use that no live tensor owns (0 without glibc's counts)
    native_heap: int
    # resident minus everything above
    rest: int

    @property
    def resident_bytes(self) -> int:
        return sum(getattr(self, part.name) for part in fields(self))

    def metrics(self) -> dict[str, float]:
        return {f"memory_{part.name}_gb": getattr(self, part.name) / memory.GB for part in fields(self)}

    def largest_growth(self, earlier: MemoryParts) -> tuple[str, int, int]:
        """The part that grew most since `earlier`: its name, its bytes then and now."""
        name = max((part.name for part in fields(self)), key=lambda name: getattr(self, name) - getattr(earlier, name))
        return name, getattr(earlier, name), getattr(self, name)


def live_tensor_bytes(owners: dict[str, list[torch.Tensor]]) -> dict[str, int]:
    """Bytes of every live CPU tensor's storage, each storage counted once, under the first owner (in `owners`'
    order) that holds a tensor on it; the storages no owner holds under "other_tensors"."""
    owners = {owner: [tensor for tensor in tensors if _in_memory(tensor)] for owner, tensors in owners.items()}
    owner_of: dict[int, str] = {}
    for owner, tensors in owners.items():
        for tensor in tensors:
            owner_of.setdefault(_storage_key(tensor), owner)
    storages: dict[int, int] = {}
    # every tensor object Python tracks (about 0.1 s for a worker's half a million objects)
    for candidate in gc.get_objects():
        # type(), not isinstance: reading __class__ of some module-level objects warns
        if issubclass(type(candidate), torch.Tensor) and _in_memory(candidate):
            storages[_storage_key(candidate)] = candidate.untyped_storage().nbytes()
    for tensor in (tensor for tensors in owners.values() for tensor in tensors):
        storages[_storage_key(tensor)] = tensor.untyped_storage().nbytes()
    totals = dict.fromkeys([*owners, "other_tensors"], 0)
    for key, size in storages.items():
        totals[owner_of.get(key, "other_tensors")] += size
    return totals


def _in_memory(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage lives in this process's memory (CPU, dense), not on a GPU."""
    return tensor.device.type == "cpu" and tensor.layout == torch.strided


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def module_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    return [] if module is None else [*module.parameters(), *module.buffers()]


def gradient_tensors(module: torch.nn.Module | None) -> list[torch.Tensor]:
    return [] if module is None else [parameter.grad for parameter in module.parameters() if parameter.grad is not None]


def reachable_tensors(root: Any, depth: int = 4) -> list[torch.Tensor]:
    """The tensors reachable from `root` through attributes, lists, tuples and dicts, `depth` levels down (an
    optimizer: DeepSpeed's ZeRO partitions and the torch optimizer's state within it)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    frontier = [root]
    for _ in range(depth + 1):
        following = []
        for value in frontier:
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, dict):
                following.extend(value.values())
            elif isinstance(value, (list, tuple)):
                following.extend(value)
            elif isinstance(value, (torch.nn.Module, str, bytes, int, float)):
                continue  # the modules' weights are owned above; scalars hold no tensors
            elif hasattr(value, "__dict__"):
                following.extend(vars(value).values())
        frontier = following
    return found


def measure_parts(policy: torch.nn.Module, optimizer: Any, drafter: torch.nn.Module | None) -> MemoryParts:
    """This process's resident set now, by part."""
    tensors = live_tensor_bytes(
        {
            "policy_weights": module_tensors(policy),
            "drafter": module_tensors(drafter),
            "gradients": gradient_tensors(policy) + gradient_tensors(drafter),
            "optimizer": reachable_tensors(optimizer),
        }
    )
    resident = memory.resident_bytes()
    counts = malloc_counts()
    held = sum(tensors.values())
    native = max(0, counts.in_use + counts.mapped - held) if counts is not None else 0
    return MemoryParts(**tensors, native_heap=native, rest=resident - held - native)


class MemoryWatch:
    """One worker's memory bookkeeping over its steps (module docstring)."""

    def __init__(self, estimate_bytes: int, policy: torch.nn.Module, optimizer: Any, drafter: torch.nn.Module | None):
        self.estimate_bytes = estimate_bytes
        self.policy, self.optimizer, self.drafter = policy, optimizer, drafter
        self.first: MemoryParts | None = None
        self.warned = False
        self.warnings: list[str] = []

    @classmethod
    def for_recipe(cls, recipe: Any, policy: torch.nn.Module, optimizer: Any, drafter: torch.nn.Module | None):
        """A watch against the estimate `tlt train` checked before the run (memory.py), for this worker's parts."""
        shape = memory.model_shape(recipe)
        estimate = memory.worker_peak_estimate(recipe, shape, memory.longest_prompt_tokens(recipe))
        return cls(estimate.total_bytes, policy, optimizer, drafter)

    def phase_end(self) -> None:
        """A phase is over: return what it freed, so the next one starts from what is alive."""
        return_freed_memory()

    def step_end(self, step: int, rollout_peak: int, update_peak: int) -> dict[str, float]:
        """The step's parts (before its freed memory goes back) and what went back, as trace metrics; a warning
        when the step's peak passed the estimate by more than ESTIMATE_MARGIN (once a run)."""
        parts = measure_parts(self.policy, self.optimizer, self.drafter)
        self.first = self.first or parts
        before = memory.resident_bytes()
        return_freed_memory()
        peak = max(rollout_peak, update_peak)
        if not self.warned and peak > self.estimate_bytes * (1 + ESTIMATE_MARGIN):
            self.warned = True
            self.warnings.append(self.over_estimate(step, peak, parts))
        return {**parts.metrics(), "memory_returned_gb": (before - memory.resident_bytes()) / memory.GB}

    def over_estimate(self, step: int, peak: int, parts: MemoryParts) -> str:
        """One sentence: the step, its peak against the estimate, and the part that grew most since the first step
        (the largest part when the first step is the one over)."""
        over = f"step {step}: the resident peak {peak / memory.GB:.2f} GB passed the estimate made before the run"
        over += f" ({self.estimate_bytes / memory.GB:.2f} GB) by {peak / self.estimate_bytes - 1:.0%}"
        name, then, now = parts.largest_growth(self.first)
        if now > then:
            grew = f"{then / memory.GB:.2f} -> {now / memory.GB:.2f} GB"
            return f"{over}; the part that grew most since the first step: {_named(name)}, {grew}"
        name = max((part.name for part in fields(parts)), key=lambda name: getattr(parts, name))
        return f"{over}; its largest part: {_named(name)}, {getattr(parts, name) / memory.GB:.2f} GB"

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings


# how a warning names each part
PART_NAMES = {
    "policy_weights": "the policy's weights",
    "gradients": "the policy's and drafter's gradients",
    "optimizer": "the optimizer's state",
    "drafter": "the drafter",
    "other_tensors": "other tensors (DeepSpeed's buffers, the sidecar's window)",
    "native_heap": "malloc's chunks outside tensors (kernel caches, C++ and large Python objects)",
    "rest": "the rest (malloc's free lists, Python's small objects, libraries)",
}


def _named(part: str) -> str:
    return PART_NAMES[part]
