"""Plugin hooks: the Protocols the workers and the driver call, the hosts that call them, what plugins declare.

A plugin is any object with some of the `WorkerPlugin` methods (all are optional). Recipes list
plugins under `plugins.enabled`: a name is looked up among the `tlt.plugins` entry points, so a
third party adds one by declaring an entry point in its own package, without touching tlt; a
`module:attribute` path imports a plugin that is not packaged (handy for experiments and tests).
Every worker process builds a `PluginHost` and calls its hooks in this order per step:

    on_rollout_start -> on_request_finished (per request) -> on_worker_idle (repeatedly, until
    the whole rollout is over) -> [on_drafter_reset, on every worker, when the drafter diverged in the
    rollout] -> on_rollout_end -> on_hidden_states (per actor micro-batch) -> on_weights_updated;
    on_checkpoint_save / on_checkpoint_load when checkpoints move.

A hook that raises disables its plugin for the rest of the run; the host records the error by
plugin name (the driver shows it and writes it to the trace). Hooks that talk across workers
(on_rollout_end, on_checkpoint_*) run only for plugins that are enabled on every worker: the
host agrees on that set with one collective first, so a plugin that failed on one worker
cannot leave the others waiting.

A plugin reports numbers by adding them to `context.metrics` under its own prefix (its class's
`metric_prefix`, else its name and "_"); the host checks every key a hook added starts with it
(a key that does not is a failure: the plugin is disabled). The driver sums keys ending in
_steps or _seconds over workers and averages the others into the step record. A plugin may
declare `display_columns` (MetricColumn: the live table shows them once a record has them) and
`idle_seconds_used` (the summary's share of idle worker time it used), `trains_drafter = True`
(the run then builds a drafter even with speculative decoding off), and set
`context.drafter_version` when it changed the drafter in place (servers reload it then).

Driver-side hooks (`DriverPlugin`: loggers) run in the driver process only, which alone sees
the step records: on_run_start(RunInfo) once the run directory exists -> on_step_record(record)
per step, after the trace has it -> on_run_end() however the run ends. None is collective; a
hook that raises disables its plugin with one warning and the run goes on. The driver builds
only the plugins with a driver hook, each worker only those with a worker hook; one class may
have both. docs/plugins.md has the whole contract and an example.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

import torch

from tlt_cli.errors import UserError

ENTRY_POINT_GROUP = "tlt.plugins"


class PluginError(UserError):
    """A plugin named in a recipe that cannot be found or built."""


@dataclass
class StepContext:
    """What a hook may look at and act on during one step of one worker.

    engine: the worker's rollout backend (a RolloutBackend, tlt_cli/rollout/backend.py); policy: the
    actor's module (shared weights); drafter: the drafter the rollout speculates with (None when the
    run has none; a plugin may train it in place); metrics: a dict the plugin may add numbers to
    under its metric prefix, reported in the step's worker record; drafter_version: set by a plugin
    that changed the drafter in place (a number that moves with each change: rollout servers
    reload the drafter when it moved since their last push).
    """

    step: int
    worker: int
    world_size: int
    engine: Any
    policy: torch.nn.Module
    drafter: torch.nn.Module | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    drafter_version: float | None = None


@dataclass(frozen=True)
class MetricColumn:
    """A plugin metric the live table shows (title, the record key, a format such as "{:.2f}")."""

    title: str
    key: str
    template: str


@dataclass(frozen=True)
class RunInfo:
    """What a driver-side hook learns when a run starts. recipe: the resolved recipe as plain values."""

    name: str
    run_directory: Path
    world_size: int
    steps: int
    start_step: int
    resumed: bool
    recipe: dict[str, Any]


class WorkerPlugin(Protocol):
    """The hooks (every one optional: implement the ones you need)."""

    name: str

    def on_rollout_start(self, context: StepContext) -> None: ...

    def on_request_finished(self, context: StepContext, completion: Any) -> None: ...

    def on_worker_idle(self, context: StepContext, rollout_over: Callable[[], bool]) -> None:
        """Called repeatedly while this worker waits for the others; return soon after rollout_over() is True."""

    def on_drafter_reset(self, context: StepContext, turned_off: bool) -> None:
        """The drafter diverged in this rollout and got fresh weights in place (a plugin that trains it starts
        afresh: its optimizer too); turned_off: no rollout drafts with it again this run (stop training it)."""

    def on_rollout_end(self, context: StepContext) -> None: ...

    def on_hidden_states(self, context: StepContext, batch: Any, hidden_states: torch.Tensor) -> None: ...

    def on_weights_updated(self, context: StepContext) -> None: ...

    def on_checkpoint_save(self, directory: Path) -> None: ...

    def on_checkpoint_load(self, directory: Path) -> None: ...


class DriverPlugin(Protocol):
    """The driver-side hooks (loggers; every one optional). record: a step record as trace.jsonl holds it."""

    name: str

    def on_run_start(self, run: RunInfo) -> None: ...

    def on_step_record(self, record: dict[str, Any]) -> None: ...

    def on_run_end(self) -> None: ...


WORKER_HOOKS = tuple(name for name in vars(WorkerPlugin) if name.startswith("on_"))
DRIVER_HOOKS = tuple(name for name in vars(DriverPlugin) if name.startswith("on_"))
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
    try:
        return found[name].load()
    except ImportError as error:
        raise PluginError(
            f"plugin '{name}' is declared by an installed package ({found[name].value}) but cannot be imported "
            f"({error}); reinstall the package that provides it or leave '{name}' out of plugins.enabled."
        ) from None


def build_plugins(
    names: list[str] | tuple[str, ...],
    options: dict[str, dict[str, Any]],
    recipe: Any,
    hooks: tuple[str, ...] = WORKER_HOOKS,
) -> list[Any]:
    """Instantiate the named plugins that have one of `hooks`: factory(recipe=..., **options[name])."""
    plugins = []
    for name in names:
        factory = plugin_factory(name)
        if not any(hasattr(factory, hook) for hook in hooks):
            continue
        plugin = factory(recipe=recipe, **options.get(name, {}))
        plugin.name = name
        plugin.metric_prefix = metric_prefix(name, factory)
        plugins.append(plugin)
    return plugins


def metric_prefix(name: str, factory: Any) -> str:
    """What a plugin's metric keys start with: its `metric_prefix`, else its name's last part and "_"."""
    declared = getattr(factory, "metric_prefix", None)
    return declared if declared else name.rpartition(":")[2].rpartition(".")[2].lower() + "_"


def plugins_train_drafter(names: list[str] | tuple[str, ...]) -> bool:
    """Whether a named plugin trains the drafter (its class sets `trains_drafter = True`): the run needs one."""
    return drafter_training_plugin(names) is not None


def drafter_training_plugin(names: list[str] | tuple[str, ...]) -> Any | None:
    """The class of the first named plugin that trains the drafter, or None."""
    return next((factory for factory in map(plugin_factory, names) if getattr(factory, "trains_drafter", False)), None)


def plugin_columns(names: list[str] | tuple[str, ...]) -> tuple[MetricColumn, ...]:
    """The live-table columns the named plugins declare (`display_columns`), in recipe order."""
    return tuple(column for name in names for column in getattr(plugin_factory(name), "display_columns", ()))


def plugin_idle_uses(names: list[str] | tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """(what, record key) of the idle worker-seconds each named plugin uses (`idle_seconds_used`), if declared."""
    uses = (getattr(plugin_factory(name), "idle_seconds_used", None) for name in names)
    return tuple(use for use in uses if use is not None)


def trl_reporting(
    names: list[str] | tuple[str, ...], options: dict[str, dict[str, Any]], run_directory: Path
) -> tuple[list[str], dict[str, str]]:
    """Under TRL: the `report_to` names of the named loggers TRL also has (class attribute `trl_report_to`),
    and the environment TRL's own loggers then read (`trl_environment(run_directory, **options)`: where
    they write under the run directory, W&B's mode)."""
    report_to, environment = [], {}
    for name in names:
        factory = plugin_factory(name)
        if getattr(factory, "trl_report_to", None) is None:
            continue
        report_to.append(factory.trl_report_to)
        if hasattr(factory, "trl_environment"):
            environment.update(factory.trl_environment(run_directory, **options.get(name, {})))
    return report_to, environment


def scalar_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step record a logger plots: every numeric key but the step and wall-clock times.

    Wall-clock times (keys ending in _start or _end, seconds since 1970) are left out: as float32
    scalars they would be rounded to minutes and mean nothing on a plot.
    """
    return {
        key: float(value)
        for key, value in record.items()
        if isinstance(value, int | float)
        and not isinstance(value, bool)
        and key != "step"
        and not key.endswith(("_start", "_end"))
    }


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
            metrics = _step_metrics(arguments)
            before = dict(metrics)
            try:
                method(*arguments)
                _check_metric_keys(plugin, before, metrics)
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


class DriverPlugins:
    """A run's driver-side plugins (loggers), built and called in the driver: a failure is one warning.

    Example (tlt_cli/processes/driver.py):
        loggers = DriverPlugins(recipe)
        with loggers.running(run, warn=display.note):   # on_run_start ... on_run_end
            ... loggers.step_recorded(step_record) ...
    """

    def __init__(self, recipe: Any):
        self.recipe = recipe
        self.host = PluginHost([])
        self.warn: Callable[[str], None] = print

    @contextlib.contextmanager
    def running(self, run: RunInfo, warn: Callable[[str], None]) -> Iterator[DriverPlugins]:
        """Build the plugins, call on_run_start; on_run_end when the block ends, however it ends."""
        self.warn = warn
        for name in self.recipe.plugins.enabled:
            try:
                self.host.plugins += build_plugins([name], dict(self.recipe.plugins.options), self.recipe, DRIVER_HOOKS)
            except Exception as error:  # a logger that cannot be built must not stop the run
                warn(f"plugin {name} disabled: it could not be built ({type(error).__name__}: {error}).")
        self._call("on_run_start", run)
        try:
            yield self
        finally:
            self._call("on_run_end")

    def step_recorded(self, record: dict[str, Any]) -> None:
        self._call("on_step_record", record)

    def _call(self, hook: str, *arguments: Any) -> None:
        self.host.call(hook, *arguments)
        for failure in self.host.take_failures():
            self.warn(f"plugin {failure.plugin} disabled: {failure.hook} raised {failure.message}; the run goes on.")


class MetricKeyError(ValueError):
    """A plugin reported a metric outside its prefix."""


def _step_metrics(arguments: tuple[Any, ...]) -> dict[str, float]:
    """The step's metrics dict when a hook gets a StepContext (a fresh dict otherwise: nothing to check)."""
    context = arguments[0] if arguments else None
    return context.metrics if isinstance(context, StepContext) else {}


def _check_metric_keys(plugin: Any, before: dict[str, float], metrics: dict[str, float]) -> None:
    """Every key the hook added or changed starts with the plugin's prefix; others are undone and raise."""
    prefix = getattr(plugin, "metric_prefix", "")
    foreign = sorted(
        key
        for key, value in metrics.items()
        if not key.startswith(prefix) and (key not in before or before[key] is not value)
    )
    if not foreign:
        return
    for key in foreign:
        if key in before:
            metrics[key] = before[key]
        else:
            del metrics[key]
    raise MetricKeyError(f"metric {foreign[0]!r} does not start with the plugin's metric prefix {prefix!r}")


def agree_across_workers(disabled: set[str]) -> set[str]:
    """Union of the disabled-plugin sets of all workers (one all_gather_object)."""
    gathered: list[set[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, disabled)
    return set().union(*(names or set() for names in gathered))
