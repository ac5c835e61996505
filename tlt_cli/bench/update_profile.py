"""Where one GRPO update's time goes: `Actor.update` under torch.profiler, every operator's self time (time not
spent in the operators it calls) put in one category and one phase.

`profile_update(actor, batch)` labels the actor's parts (`label_update_parts`: the engine's backward and step,
the forward of each decoder layer's parts; instance attributes wrapped, so only for a process that profiles), runs one
update under the profiler and returns an `UpdateProfile`. Categories: AdamW's step, the rest of DeepSpeed's
step (gradient norm, clipping, ZeRO's partition copies), all-reduce, the log-prob head's products over the
vocabulary and its log-softmax (tlt_cli/training/logprobs.py), matrix products, attention, dtype casts and
copies, the other operators (norms, activations, elementwise), and Python and dispatch (self time of the
autograd engine's nodes and of the labels, and the update's wall-clock outside every operator). Phases, as
the roofline takes them (tlt_cli/bench/update_roofline.py PHASES): the decoder's forward, its
recomputation (a decoder layer's forward inside the engine's backward: gradient checkpointing), its backward,
the log-prob head (forward and backward), the optimizer step and the all-reduce. `tlt bench update
--profile` (tlt_cli/bench/update_worker.py) calls it after a first, warm-up update.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from tlt_cli.bench.update_roofline import PHASES
from tlt_cli.training.actor import Actor, UpdateMetrics
from tlt_cli.training.policy_batch import PolicyBatch

CATEGORIES = (
    "matrix products",
    "log-prob head: products over the vocabulary",
    "log-prob head: log-softmax over the vocabulary",
    "attention",
    "dtype casts and copies",
    "other operators (norms, activations, elementwise)",
    "optimizer step (AdamW)",
    "DeepSpeed step (gradient norm, clipping, ZeRO copies)",
    "all-reduce",
    "Python and dispatch",
)
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"}
COLLECTIVES = ("all_reduce", "allreduce", "reduce_scatter", "allgather", "all_gather")
# labels put around the update's parts
BACKWARD_LABEL = "profile: backward"
STEP_LABEL = "profile: DeepSpeed step"
LAYER_LABEL = "profile: decoder layer"
# the log-prob head's autograd Function: its forward and its backward node carry the name
HEAD_NAME = "ChunkedHeadLogprobs"
TOP_OPERATORS = 25
MICROSECONDS = 1e-6


@dataclass(frozen=True)
class UpdateProfile:
    """One profiled update: its wall-clock and CPU seconds, metrics, and self seconds by category and phase."""

    seconds: float
    cpu_seconds: float
    metrics: UpdateMetrics
    categories_seconds: dict[str, float]
    phases_seconds: dict[str, float]
    outside_operators_seconds: float
    costliest_operators_seconds: dict[str, float]

    def phases_cpu_seconds(self) -> dict[str, float]:
        """Each phase's share of the profiled wall-clock applied to the update's CPU seconds (one thread: its CPU
        time; on a loaded machine the wall-clock also counts the time other processes held the core)."""
        scale = self.cpu_seconds / self.seconds if self.seconds > 0 else 0.0
        return {phase: seconds * scale for phase, seconds in self.phases_seconds.items()}


def profile_update(actor: Actor, batch: PolicyBatch) -> UpdateProfile:
    """One `actor.update(batch)` under torch.profiler (label the actor first: `label_update_parts`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        started, started_cpu = time.perf_counter(), time.process_time()
        metrics = actor.update(batch)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    return UpdateProfile(seconds, cpu_seconds, metrics, **categorise(profiler.events(), seconds))


def label_update_parts(actor: Actor) -> None:
    """Wrap the engine's backward and step, and the forward of each decoder layer's parts, in profiler labels; a
    layer's forward inside the engine's backward is its recomputation (gradient checkpointing)."""
    engine = actor.engine
    for name, label in (("backward", BACKWARD_LABEL), ("step", STEP_LABEL)):
        setattr(engine, name, labelled(getattr(engine, name), label))
    label_decoder_layers(actor.policy)


def label_decoder_layers(policy) -> None:
    """Wrap the forward of each decoder layer's parts in LAYER_LABEL."""
    # each layer's parts, not the layer: transformers' checkpointing replays the layer class's own forward, which
    # calls its parts (attention, MLP, norms) through their modules, so the parts' labels mark the recomputation
    for layer in policy.get_decoder().layers:
        for part in layer.children():
            part.forward = labelled(part.forward, LAYER_LABEL)


def labelled(function, label: str):
    """`function` run inside a profiler label."""
    from torch.profiler import record_function

    def run(*arguments, **keywords):
        with record_function(label):
            return function(*arguments, **keywords)

    return run


def categorise(events, wall_seconds: float) -> dict:
    """Self seconds per category and per phase, and the costliest operators (module docstring)."""
    categories: dict[str, float] = defaultdict(float)
    phases: dict[str, float] = defaultdict(float)
    operators: dict[str, float] = defaultdict(float)
    top_level = 0.0
    for event in events:
        seconds = event.self_cpu_time_total * MICROSECONDS
        ancestors = ancestor_names(event)
        if event.cpu_parent is None:
            top_level += event.cpu_time_total * MICROSECONDS
        categories[category(event.name, ancestors)] += seconds
        phases[phase(ancestors | {event.name})] += seconds
        if event.name.startswith("aten::") or is_collective(event.name):
            operators[event.name] += seconds
    outside = max(wall_seconds - top_level, 0.0)
    categories["Python and dispatch"] += outside
    costliest = sorted(operators.items(), key=lambda item: -item[1])[:TOP_OPERATORS]
    return {
        "categories_seconds": {name: categories.get(name, 0.0) for name in CATEGORIES},
        "phases_seconds": {name: phases.get(name, 0.0) for name in PHASES},
        "outside_operators_seconds": outside,
        "costliest_operators_seconds": dict(costliest),
    }


def ancestor_names(event) -> set[str]:
    names = set()
    parent = event.cpu_parent
    while parent is not None:
        names.add(parent.name)
        parent = parent.cpu_parent
    return names


def is_collective(name: str) -> bool:
    return any(collective in name for collective in COLLECTIVES)


def in_head(names: set[str]) -> bool:
    return any(HEAD_NAME in name for name in names)


def category(name: str, ancestors: set[str]) -> str:
    """The category of an event's self time, given the names of the events it runs inside."""
    if is_collective(name):
        return "all-reduce"
    if any(ancestor.startswith("Optimizer.") for ancestor in ancestors | {name}):
        return "optimizer step (AdamW)"
    if not name.startswith("aten::"):
        return "Python and dispatch"
    if STEP_LABEL in ancestors:
        return "DeepSpeed step (gradient norm, clipping, ZeRO copies)"
    if in_head(ancestors):
        if name in PRODUCTS:
            return "log-prob head: products over the vocabulary"
        if name not in CASTS:
            return "log-prob head: log-softmax over the vocabulary"
    if name in PRODUCTS:
        return "matrix products"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in CASTS:
        return "dtype casts and copies"
    return "other operators (norms, activations, elementwise)"


def phase(names: set[str]) -> str:
    """The phase (update_roofline.PHASES) of an event's self time, given its name and those it runs inside."""
    if any(is_collective(name) for name in names):
        return "all-reduce"
    if STEP_LABEL in names:
        return "optimizer"
    if in_head(names):
        return "log-prob head"
    if BACKWARD_LABEL in names:
        return "recomputation" if LAYER_LABEL in names else "backward"
    return "forward"
