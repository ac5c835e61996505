"""Plugin hooks: the Protocol a worker calls at each point of a step, and the host that calls them.

A plugin is any object with some of the `WorkerPlugin` methods (all are optional). Recipes list
plugins under `plugins.enabled`: a name is looked up among the `tlt.plugins` entry points, so a
third party adds one by declaring an entry point in its own package, without touching tlt; a
`module:attribute` path imports a plugin that is not packaged (handy for experiments and tests).
Every worker process builds a `PluginHost` and calls its hooks in this order per step:

    on_rollout_start -> on_request_finished (per request) -> on_worker_idle (repeatedly, until
    the whole rollout is over) -> on_rollout_end -> on_hidden_states (per actor micro-batch)
    -> on_weights_updated;   on_checkpoint_save / on_checkpoint_load when checkpoints move.

A hook that raises disables its plugin for the rest of the run; the host records the error by
plugin name (the driver shows it and writes it to the trace). Hooks that talk across workers
(on_rollout_end, on_checkpoint_*) run only for plugins that are enabled on every worker: the
host agrees on that set with one collective first, so a plugin that failed on one worker
cannot leave the others waiting.
"""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import torch

ENTRY_POINT_GROUP = "tlt.plugins"


class PluginError(ValueError):
    """A plugin named in a recipe that cannot be found or built."""


@dataclass
class StepContext:
    """What a hook may look at and act on during one step of one worker.

    engine: the worker's rollout backend (a RolloutBackend, tlt_cli/rollout/backend.py); policy: the
    actor's module (shared weights); drafter: the drafter the rollout speculates with (None when the
    run has none; a plugin may train it in place); metrics: a dict the plugin may add numbers to,
    reported in the step's worker record.
    """

    step: int
    worker: int
    world_size: int
    engine: Any
    policy: torch.nn.Module
    drafter: torch.nn.Module | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class WorkerPlugin(Protocol):
    """The hooks (every one optional: implement the ones you need)."""

    name: str

    def on_rollout_start(self, context: StepContext) -> None: ...

    def on_request_finished(self, context: StepContext, completion: Any) -> None: ...

    def on_worker_idle(self, context: StepContext, rollout_over: Callable[[], bool]) -> None:
        """Called repeatedly while this worker waits for the others; return soon after rollout_over() is True."""

    def on_rollout_end(self, context: StepContext) -> None: ...

    def on_hidden_states(self, context: StepContext, batch: Any, hidden_states: torch.Tensor) -> None: ...

    def on_weights_updated(self, context: StepContext) -> None: ...

    def on_checkpoint_save(self, directory: Path) -> None: ...

    def on_checkpoint_load(self, directory: Path) -> None: ...


COLLECTIVE_HOOKS = ("on_rollout_end", "on_checkpoint_save", "on_checkpoint_load")


def available_plugins() -> dict[str, Any]:
    """Plugin factories by name, from the `tlt.plugins` entry points."""
    return {entry.name: entry for entry in entry_points(group=ENTRY_POINT_GROUP)}


def plugin_factory(name: str) -> Callable[..., Any]:
    """The class (or factory) for a plugin name or a `module:attribute` path; PluginError if absent."""
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as error:
            raise PluginError(f"plugin '{name}' cannot be imported ({error}).") from None
    found = available_plugins()
    if name not in found:
        choices = ", ".join(sorted(found)) or "none installed"
        raise PluginError(
            f"plugin '{name}' is not installed (entry point group {ENTRY_POINT_GROUP}; available: {choices})."
        )
    return found[name].load()


def build_plugins(names: list[str] | tuple[str, ...], options: dict[str, dict[str, Any]], recipe: Any) -> list[Any]:
    """Instantiate the named plugins: factory(recipe=..., **options[name])."""
    plugins = []
    for name in names:
        plugin = plugin_factory(name)(recipe=recipe, **options.get(name, {}))
        plugin.name = name
        plugins.append(plugin)
    return plugins


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that raised: which plugin, in which hook, with what error."""

    plugin: str
    hook: str
    message: str
    details: str


class PluginHost:
    """Calls hooks on enabled plugins and disables a plugin the first time one of its hooks raises."""

    def __init__(self, plugins: list[Any], agree: Callable[[set[str]], set[str]] | None = None):
        self.plugins = plugins
        self.disabled: set[str] = set()
        self.failures: list[PluginFailure] = []
        # agree(disabled_here) -> plugins disabled on any worker (a collective); identity when alone
        self.agree = agree or (lambda disabled: disabled)

    def call(self, hook: str, *arguments: Any) -> None:
        if hook in COLLECTIVE_HOOKS:
            self.disabled |= self.agree(set(self.disabled))
        for plugin in self.plugins:
            method = getattr(plugin, hook, None)
            if plugin.name in self.disabled or method is None:
                continue
            try:
                method(*arguments)
            except Exception as error:  # a plugin's bug must not end or corrupt the step: disable it, report it
                self.disabled.add(plugin.name)
                self.failures.append(
                    PluginFailure(plugin.name, hook, f"{type(error).__name__}: {error}", traceback.format_exc())
                )

    def wants(self, hook: str) -> bool:
        """Whether any enabled plugin implements `hook` (lets the caller skip work nobody reads)."""
        return any(plugin.name not in self.disabled and hasattr(plugin, hook) for plugin in self.plugins)

    def take_failures(self) -> list[PluginFailure]:
        failures, self.failures = self.failures, []
        return failures


def agree_across_workers(disabled: set[str]) -> set[str]:
    """Union of the disabled-plugin sets of all workers (one all_gather_object)."""
    gathered: list[set[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, disabled)
    return set().union(*(names or set() for names in gathered))
