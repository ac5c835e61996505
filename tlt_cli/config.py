"""Recipes: YAML merged with `key=value` overrides into typed, frozen dataclasses, validated once.

`load_recipe(path, overrides)` is the only way a recipe enters the program. Structure and types
are checked by OmegaConf against the dataclasses below; values are then checked by
`validate_recipe`. Every problem becomes a `RecipeError` whose message is one sentence naming
the key, which the CLI prints before exiting with code 2.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError


class RecipeError(ValueError):
    """A recipe (or an override) that cannot be run; the message names the key to fix."""


@dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0


@dataclass(frozen=True)
class ModelConfig:
    path: str = "builtin:tiny-arith"
    cache_dir: str | None = None


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arithmetic"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 20
    prompts_per_step: int = 16
    group_size: int = 4


@dataclass(frozen=True)
class WorkersConfig:
    count: int = 2
    threads_per_worker: int = 1
    # DeepSpeed hostfile (one line per node: "<host> slots=<n>", n GPUs or, with actor.devices cpu, CPU ranks);
    # null = the workers are spawned on this machine without the DeepSpeed launcher
    hostfile: str | None = None


@dataclass(frozen=True)
class SGLangConfig:
    """How tlt runs its SGLang rollout servers (one per GPU, or per group of tp_size GPUs)."""

    # GPU indices on this node the servers use, split into consecutive groups of tp_size
    gpus: tuple[int, ...] = (0,)
    # tensor-parallel size of each server (1 = one server per GPU)
    tp_size: int = 1
    # first port of the servers' range on 127.0.0.1; server i takes port_base + 2*i (HTTP) and the next (NCCL)
    port_base: int = 30100
    # seconds to wait for every server to answer /health before giving up with its log tail
    startup_timeout_s: float = 900.0
    # seconds a server gets to exit after SIGTERM before its process group is killed
    stop_timeout_s: float = 30.0
    # fraction of GPU memory for SGLang's weights and KV cache (leave room for a colocated actor)
    mem_fraction: float = 0.6
    # most requests one server runs at once; set explicitly because SGLang caps it at 48 when EAGLE is on
    max_running_requests: int = 256
    # weight and activation dtype of the served model
    dtype: str = "bfloat16"
    # Python interpreter whose environment has sglang installed ("" = the one running tlt)
    python: str = ""
    # send and receive token ids only (no tokenizer in the server)
    skip_tokenizer_init: bool = True
    # actor ranks and servers share a node: push weights as CUDA tensors; false = through a checkpoint on disk
    colocated: bool = True
    # seconds one /generate request may take before the rollout fails
    request_timeout_s: float = 3600.0
    # most requests tlt keeps in flight on one server at a time
    max_in_flight_per_server: int = 1024
    # tokens generated per prompt by the post-sync acceptance probe
    probe_max_new_tokens: int = 64
    # accept length at or below which a drafter that worked before a sync counts as collapsed
    collapse_accept_length: float = 1.1
    # let SGLang turn SD off in a batch-size slot whose acceptance collapses (adaptive mode only)
    auto_off_on_collapse: bool = True
    # more command-line flags for sglang.launch_server, e.g. ["--attention-backend", "fa3"]
    extra_args: tuple[str, ...] = ()

    @property
    def server_count(self) -> int:
        return len(self.gpus) // self.tp_size


@dataclass(frozen=True)
class RolloutConfig:
    backend: str = "embedded"
    max_new_tokens: int = 320
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # SGLang servers, used when backend is sglang (checked by tlt_cli/sglang/config.py)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    zero_stage: int = 2
    micro_batch_size: int = 4
    clip_ratio: float = 0.2
    kl_coef: float = 0.0
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    # "cpu", or GPU indices of this node, one per worker rank (e.g. [0, 1])
    devices: Any = "cpu"
    # fp32, or bf16 (GPUs only)
    precision: str = "fp32"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 5
    keep: int = 2


@dataclass(frozen=True)
class SpeculativeSection:
    mode: str = "off"
    steps: int = 4
    topk: int = 1
    draft_tokens: int = 0
    rules: list[dict[str, Any]] = field(default_factory=list)
    collapse_accept_length: float = 1.3
    reprobe_steps: int = 64
    bandit_epsilon: float = 0.0


@dataclass(frozen=True)
class DrafterConfig:
    init: str = "warmup"
    warmup_steps: int = 600
    warmup_lr: float = 1e-3
    warmup_prompts: int = 1024
    warmup_batch_size: int = 16
    lr: float = 1e-3
    weight_decay: float = 0.0
    window_steps: int = 2
    batch_size: int = 4


@dataclass(frozen=True)
class PluginsConfig:
    enabled: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    speculative: SpeculativeSection = field(default_factory=SpeculativeSection)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)


ROLLOUT_BACKENDS = ("embedded", "sglang")
PRECISIONS = ("fp32", "bf16")
CPU_DEVICES = "cpu"
SPECULATIVE_MODES = ("off", "fixed", "adaptive")
DRAFTER_STARTS = ("warmup", "random")


class _RecipeYamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true and false. YAML 1.1 also reads yes/no/on/off as booleans, which
    would turn `speculative.mode: off` or `run.name=off` into False; as words they stay strings, and
    boolean keys still accept them (OmegaConf converts "off" to False for a bool field). A key given
    twice in one mapping is an error, not a silent override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = []
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark)
            seen.append(key)
        return super().construct_mapping(node, deep)


_RecipeYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def read_yaml(text: str) -> Any:
    """A recipe file's or an override value's YAML, with YAML 1.2 booleans (see _RecipeYamlLoader)."""
    return yaml.load(text, Loader=_RecipeYamlLoader)


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply `key=value` overrides, and return the validated Recipe."""
    recipe_path = Path(path)
    if not recipe_path.is_file():
        raise RecipeError(f"recipe file {recipe_path} does not exist; pass the path of a YAML recipe (see `tlt recipes list`).")
    try:
        content = read_yaml(recipe_path.read_text(encoding="utf-8"))
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"recipe file {recipe_path} is not valid YAML{where}: {_first_line(error)}.") from None
    if not isinstance(content, dict | None):
        raise RecipeError(f"recipe file {recipe_path} must hold a mapping of sections (run:, model:, ...), not a list or a scalar.")
    try:
        loaded = OmegaConf.create(content or {})
    except OmegaConfBaseException as error:
        raise RecipeError(f"recipe file {recipe_path} is not a valid recipe: {_first_line(error)}.") from None
    _check_sections(loaded, str(recipe_path))
    return recipe_from_config(loaded, overrides, origin=str(recipe_path))


def _check_sections(loaded: DictConfig, origin: str) -> None:
    sections = [f.name for f in dataclasses.fields(Recipe)]
    for section, value in loaded.items():
        _require(section in sections, f"{origin}: section '{section}' is not a recipe section; sections are: {', '.join(sections)}.")
        _require(isinstance(value, DictConfig), f"{origin}: section '{section}' must be a mapping of keys, got {value!r}.")


def recipe_from_config(loaded: DictConfig, overrides: list[str] | tuple[str, ...] = (), origin: str = "recipe") -> Recipe:
    """Merge a loaded config and overrides onto the schema, then validate values."""
    schema = OmegaConf.structured(Recipe)
    try:
        merged = OmegaConf.merge(schema, loaded)
    except OmegaConfBaseException as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None
    for override in overrides:
        merged = _apply_override(merged, override)
    try:
        recipe = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None
    validate_recipe(recipe)
    return recipe


def _apply_override(merged: DictConfig, override: str) -> DictConfig:
    if "=" not in override:
        raise RecipeError(f"override '{override}' must have the form key=value, e.g. train.steps=10.")
    key = override.split("=", 1)[0].strip()
    free_form = key.startswith(FREE_FORM_SECTIONS)
    if not free_form and OmegaConf.select(merged, key, default=_MISSING_KEY) is _MISSING_KEY:
        raise RecipeError(f"override key '{key}' is not a recipe key; {_suggest(key)}")
    try:
        parsed = OmegaConf.create()
        OmegaConf.update(parsed, key, read_yaml(override.split("=", 1)[1]))
    except (YAMLError, OmegaConfBaseException) as error:
        raise RecipeError(f"override '{override}': the value is not valid YAML ({_first_line(error)}).") from None
    try:
        return OmegaConf.merge(merged, parsed)
    except OmegaConfBaseException as error:
        raise RecipeError(f"override '{override}': {_describe(error)}") from None


_MISSING_KEY = object()
# keys under these take any name (options passed through to the chosen task)
FREE_FORM_SECTIONS = ("task.options.", "plugins.options.")


def _describe(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", None) or "?"
    message = _first_line(error)
    if "not in struct" in message or ("Key '" in message and "not in" in message):
        return f"key '{key}' is not a recipe key; {_suggest(key)}"
    if "Value '" in message or "Invalid type" in message or "could not convert" in message.lower():
        return f"key '{key}' has the wrong type ({message})."
    if "Missing mandatory value" in message:
        return f"key '{key}' must be set."
    return f"key '{key}': {message}."


def _suggest(key: str) -> str:
    section = key.split(".")[0]
    sections = [f.name for f in dataclasses.fields(Recipe)]
    if section not in sections:
        return f"sections are: {', '.join(sections)}."
    section_type = {f.name: f.type for f in dataclasses.fields(Recipe)}[section]
    section_class = globals()[section_type] if isinstance(section_type, str) else section_type
    names = [f.name for f in dataclasses.fields(section_class)]
    return f"keys of '{section}' are: {', '.join(names)}."


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def validate_recipe(recipe: Recipe) -> None:
    """Check values that types alone cannot (ranges, choices, files); raise RecipeError on the first problem."""
    _require(recipe.run.name.strip() != "" and "/" not in recipe.run.name,
             f"run.name must be a non-empty folder name without '/', got '{recipe.run.name}'.")
    _require(recipe.train.steps >= 1, f"train.steps must be at least 1, got {recipe.train.steps}.")
    _require(recipe.train.prompts_per_step >= 1, f"train.prompts_per_step must be at least 1, got {recipe.train.prompts_per_step}.")
    _require(recipe.train.group_size >= 2, f"train.group_size must be at least 2 (GRPO compares responses within a group), got {recipe.train.group_size}.")
    _require(recipe.workers.count >= 1, f"workers.count must be at least 1, got {recipe.workers.count}.")
    _require(recipe.train.prompts_per_step % recipe.workers.count == 0,
             f"train.prompts_per_step ({recipe.train.prompts_per_step}) must be a multiple of workers.count ({recipe.workers.count}) so every worker gets whole groups.")
    _require(recipe.workers.threads_per_worker >= 1, f"workers.threads_per_worker must be at least 1, got {recipe.workers.threads_per_worker}.")
    _require(recipe.rollout.backend in ROLLOUT_BACKENDS,
             f"rollout.backend must be one of {', '.join(ROLLOUT_BACKENDS)}, got '{recipe.rollout.backend}'.")
    _require(recipe.rollout.max_new_tokens >= 1, f"rollout.max_new_tokens must be at least 1, got {recipe.rollout.max_new_tokens}.")
    _require(recipe.rollout.temperature >= 0.0, f"rollout.temperature must be >= 0 (0 is greedy), got {recipe.rollout.temperature}.")
    _require(0.0 < recipe.rollout.top_p <= 1.0, f"rollout.top_p must be in (0, 1], got {recipe.rollout.top_p}.")
    _require(recipe.rollout.top_k >= 0, f"rollout.top_k must be >= 0 (0 keeps all tokens), got {recipe.rollout.top_k}.")
    _require(recipe.actor.lr > 0.0, f"actor.lr must be positive, got {recipe.actor.lr}.")
    _require(recipe.actor.zero_stage in (0, 1, 2, 3), f"actor.zero_stage must be 0, 1, 2 or 3, got {recipe.actor.zero_stage}.")
    _require(recipe.actor.micro_batch_size >= 1, f"actor.micro_batch_size must be at least 1, got {recipe.actor.micro_batch_size}.")
    _require(0.0 < recipe.actor.clip_ratio < 1.0, f"actor.clip_ratio must be in (0, 1), got {recipe.actor.clip_ratio}.")
    _require(recipe.actor.kl_coef >= 0.0, f"actor.kl_coef must be >= 0, got {recipe.actor.kl_coef}.")
    _require(recipe.actor.ppo_epochs >= 1, f"actor.ppo_epochs must be at least 1, got {recipe.actor.ppo_epochs}.")
    _require(recipe.actor.grad_clip > 0.0, f"actor.grad_clip must be positive, got {recipe.actor.grad_clip}.")
    _require(recipe.checkpoint.every >= 1, f"checkpoint.every must be at least 1 (steps between checkpoints), got {recipe.checkpoint.every}.")
    _require(recipe.checkpoint.keep >= 1, f"checkpoint.keep must be at least 1, got {recipe.checkpoint.keep}.")
    _validate_model_path(recipe.model.path)
    _validate_speculative(recipe.speculative)
    _validate_drafter(recipe.drafter)
    _validate_plugins(recipe.plugins)
    _validate_actor_placement(recipe)
    if recipe.rollout.backend == "sglang":
        _validate_sglang_backend(recipe)


def _validate_actor_placement(recipe: Recipe) -> None:
    """actor.devices, actor.precision and workers.hostfile: possible on some machine (CUDA is checked at run time)."""
    devices, precision = recipe.actor.devices, recipe.actor.precision
    on_gpus = devices != CPU_DEVICES
    if on_gpus:
        _require(isinstance(devices, list) and len(devices) >= 1
                 and all(isinstance(device, int) and not isinstance(device, bool) and device >= 0 for device in devices),
                 f"actor.devices must be cpu or a list of GPU indices like [0, 1], got {devices!r}.")
        _require(len(set(devices)) == len(devices), f"actor.devices lists a GPU twice: {devices}.")
    _require(precision in PRECISIONS, f"actor.precision must be one of {', '.join(PRECISIONS)}, got '{precision}'.")
    _require(precision == "fp32" or on_gpus, f"actor.precision {precision} needs GPUs in actor.devices; on cpu use fp32.")
    if recipe.workers.hostfile is None:
        _require(not on_gpus or len(devices) == recipe.workers.count,
                 f"actor.devices lists {len(devices) if on_gpus else 0} GPUs for workers.count {recipe.workers.count}; "
                 "give one GPU per worker rank.")
        return
    _validate_hostfile(recipe)


def _validate_hostfile(recipe: Recipe) -> None:
    from tlt_cli.processes.hostfile import HostfileError, check_hostfile

    try:
        check_hostfile(recipe)
    except HostfileError as error:
        raise RecipeError(f"workers.hostfile: {error}") from None


def _validate_sglang_backend(recipe: Recipe) -> None:
    """rollout.sglang on its own, then how it fits the workers and the speculative section."""
    from tlt_cli.processes.hostfile import ranks_per_node
    from tlt_cli.sglang.config import validate_sglang_config
    from tlt_cli.sglang.rules import batch_rules

    config = recipe.rollout.sglang
    validate_sglang_config(config)
    # every node runs its own servers for its own ranks
    node_ranks = ranks_per_node(recipe)
    _require(config.server_count % node_ranks == 0,
             f"rollout.sglang.gpus gives {config.server_count} server(s) of tp_size {config.tp_size} for {node_ranks} "
             "worker ranks per node; each worker owns whole servers, so give a multiple of that.")
    _require(recipe.actor.zero_stage <= 2,
             "actor.zero_stage 3 shards the parameters, but each worker pushes its full policy to its SGLang servers; use 0, 1 or 2.")
    _require(not config.colocated or recipe.actor.devices != CPU_DEVICES,
             "rollout.sglang.colocated: true sends the actor's CUDA tensors to the servers, so actor.devices must list GPUs; "
             "with the actor on cpu set rollout.sglang.colocated: false (weights go through a checkpoint on disk).")
    try:
        batch_rules(recipe.speculative)
    except RecipeError as error:
        raise RecipeError(f"speculative.rules: {error}") from None


def _validate_speculative(section: SpeculativeSection) -> None:
    from tlt_cli.adaptive import RuleTableError, build_rules
    from tlt_cli.rollout.types import SpeculativeConfig

    _require(section.mode in SPECULATIVE_MODES, f"speculative.mode must be one of {', '.join(SPECULATIVE_MODES)}, got '{section.mode}'.")
    _check_shape("speculative", SpeculativeConfig(section.steps, section.topk, section.draft_tokens))
    _require(section.collapse_accept_length >= 1.0, f"speculative.collapse_accept_length must be >= 1 (1 means no draft accepted), got {section.collapse_accept_length}.")
    _require(section.reprobe_steps >= 1, f"speculative.reprobe_steps must be at least 1, got {section.reprobe_steps}.")
    _require(0.0 <= section.bandit_epsilon <= 1.0, f"speculative.bandit_epsilon must be in [0, 1], got {section.bandit_epsilon}.")
    if section.mode != "adaptive":
        return
    try:
        rules = build_rules([dict(rule) for rule in section.rules])
    except RuleTableError as error:
        raise RecipeError(f"speculative.rules: {error}") from None
    for number, rule in enumerate(rules, start=1):
        for config in rule.configs:
            if config is not None:
                _check_shape(f"speculative.rules: rule {number}", config)


def _check_shape(where: str, config) -> None:
    """An SD shape the engine can draft (any vocabulary: the model is not loaded here)."""
    from tlt_cli.rollout.speculative import check_speculative_config

    try:
        check_speculative_config(config, vocab_size=2**31)
    except ValueError as error:
        raise RecipeError(f"{where}: {error}") from None


def _validate_drafter(drafter: DrafterConfig) -> None:
    _require(drafter.init in DRAFTER_STARTS or Path(drafter.init).is_dir(),
             f"drafter.init must be warmup, random or a drafter folder, got '{drafter.init}'.")
    for key in ("warmup_steps", "warmup_prompts", "warmup_batch_size", "window_steps", "batch_size"):
        _require(getattr(drafter, key) >= 1, f"drafter.{key} must be at least 1, got {getattr(drafter, key)}.")
    _require(drafter.warmup_lr > 0 and drafter.lr > 0, "drafter.warmup_lr and drafter.lr must be positive.")


def _validate_plugins(plugins: PluginsConfig) -> None:
    from tlt_cli.plugins import PluginError, plugin_factory

    for name in plugins.enabled:
        try:
            plugin_factory(name)
        except PluginError as error:
            raise RecipeError(f"plugins.enabled: {error}") from None
    for name in plugins.options:
        _require(name in plugins.enabled, f"plugins.options.{name} is set but '{name}' is not in plugins.enabled.")


def _validate_model_path(path: str) -> None:
    if path.startswith("builtin:"):
        _require(path == "builtin:tiny-arith", f"model.path '{path}' is not a built-in model; the built-in model is builtin:tiny-arith.")
        return
    _require(Path(path).is_dir(), f"model.path '{path}' is not a local folder; point it at a Hugging Face model folder (no downloads).")


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, as written into every run directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))
