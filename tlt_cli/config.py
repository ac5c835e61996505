"""Recipes: the schema (typed, frozen dataclasses) and the loader (YAML merged with `key=value` overrides).

`load_recipe(path, overrides)` is the only way a recipe enters the program: it reads the file as
YAML 1.2, merges it and the overrides onto the dataclasses below with OmegaConf, and returns a
`Recipe` whose keys and types are right. Values (ranges, choices, how sections fit together, the
files a recipe names) are checked by tlt_cli/recipe_checks.py, which the commands call before
anything starts. Every problem becomes a `RecipeError` whose message is one sentence naming the
key, which the CLI prints before exiting with code 2.

Each key's default is the default recipe's value (recipes/tiny-cpu.yaml, checked by a test), and
its help text lives once, here, in the field's metadata: `tlt recipes show` prints it above the
key, and the shipped recipes' comments start with it. This module imports no part of tlt and
nothing heavy (no torch).
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
import unicodedata
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from tlt_cli.errors import UserError

# the metadata key of a field's help text
HELP = "help"
# a recipe is a few KB of YAML; refusing bigger files keeps a mistaken path from hanging the parser
MAX_RECIPE_BYTES = 1 << 20
# a recipe's lists and mappings nest a few levels (speculative.rules: 4); deeper is a mistake, and far deeper
# would exhaust the recursion of the YAML parser and of OmegaConf
MAX_NESTING = 32


class RecipeError(UserError):
    """A recipe (or an override) that cannot be run; the message names the key to fix."""


class RecipeChoice(str, Enum):
    """A key that takes one of a few words. Members are named by their recipe spelling (OmegaConf
    matches a recipe's value to a member's name), compare equal to it and print as it."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def choices(cls) -> str:
        """The recipe spellings, as an error message lists them: "off, fixed, adaptive"."""
        return ", ".join(member.value for member in cls)

    @classmethod
    def refusal(cls, key: str, value: Any) -> str:
        """The one sentence that refuses `value` for `key`, listing the choices."""
        return f"{key} must be one of {cls.choices()}, got {_flow_value(value)}."

    @classmethod
    def of(cls, value: Any, key: str) -> RecipeChoice:
        """`value` (a member or its recipe spelling) as a member, for values that do not come through a
        recipe (the TRL integration's Python arguments); RecipeError naming `key` otherwise."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise RecipeError(cls.refusal(key, value)) from None


class SpeculativeMode(RecipeChoice):
    """speculative.mode: how the rollout drafts."""

    off = "off"
    fixed = "fixed"
    adaptive = "adaptive"


class Trainer(RecipeChoice):
    """train.trainer: whose GRPO loop trains the policy."""

    native = "native"
    # Hugging Face TRL's GRPOTrainer with tlt's rollout (tlt_cli/integrations/trl_run.py)
    trl = "trl"


class RolloutBackendName(RecipeChoice):
    """rollout.backend: what generates the rollout (tlt_cli/training/setup.py builds the backend it names)."""

    # the in-process engine on the actor's own weights (tlt_cli/rollout/embedded.py)
    embedded = "embedded"
    # SGLang servers each worker starts and owns (tlt_cli/sglang/rollout.py)
    sglang = "sglang"
    # TRL's own generation, no speculative decoding (train.trainer trl only)
    trl = "trl"


def setting(default: Any, help_text: str) -> Any:
    """A recipe key: its default (copied per instance when mutable) and its help text."""
    metadata = {HELP: help_text}
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata=metadata)
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class RunConfig:
    name: str = setting(
        "run", "name of the run: its directory is <output_dir>/<name> (printable characters, at most 255 bytes)"
    )
    output_dir: str = setting("runs", "folder that holds the run directories (printable characters)")
    seed: int = setting(0, "seeds data order, sampling and initialisation (0 to 2^32 - 1)")


@dataclass(frozen=True)
class ModelConfig:
    path: str = setting(
        "builtin:tiny-arith",
        "a local Hugging Face folder (cache:<path> is one under $TLT_CACHE_DIR or ~/.cache/tlt), or builtin:tiny-arith",
    )
    cache_dir: str | None = setting(
        None, "where warmed-up drafters and compiled ops are cached (null: $TLT_CACHE_DIR or ~/.cache/tlt)"
    )
    trust_remote_code: bool = setting(
        False,
        "run Python code the model folder ships (auto_map in its config.json or tokenizer_config.json); "
        "false refuses such a folder. Only for a folder whose code you trust",
    )


@dataclass(frozen=True)
class TaskConfig:
    name: str = setting(
        "arithmetic",
        "arithmetic (built-in), word_arithmetic (plain-English counting questions, "
        "for instruct models) or jsonl_math (a GSM8K-style JSONL file)",
    )
    options: dict[str, Any] = setting(
        {},
        "options of the task: arithmetic takes min_terms (1), max_terms (48) and "
        "tail_exponent (1.5: P(n) ~ n^-tail_exponent); word_arithmetic takes "
        "max_steps (2: events per story), max_number (20) and tail_exponent (0: "
        "uniform over 1..max_steps); jsonl_math takes path",
    )


@dataclass(frozen=True)
class TrainConfig:
    steps: int = setting(60, "RL steps (1 to 999,999,999: what checkpoint names hold)")
    prompts_per_step: int = setting(
        16,
        "prompts per step across all workers (a multiple of workers.count; a step generates at most 2^40 tokens: "
        "prompts_per_step x group_size x rollout.max_new_tokens)",
    )
    group_size: int = setting(8, "responses sampled per prompt (the GRPO group, at least 2)")
    trainer: Trainer = setting(
        Trainer.native,
        "native (tlt's GRPO loop on DeepSpeed workers) or trl (Hugging Face TRL's "
        "GRPOTrainer with tlt's rollout; its own options in the trl section)",
    )


@dataclass(frozen=True)
class WorkersConfig:
    count: int = setting(2, "worker processes, one DeepSpeed rank each")
    threads_per_worker: int = setting(1, "torch threads per worker")
    hostfile: str | None = setting(
        None,
        "DeepSpeed hostfile, one line per node: <host> slots=<n> (n GPUs or, with "
        "actor.devices cpu, CPU ranks); null: the workers are spawned on this "
        "machine without the DeepSpeed launcher",
    )
    step_timeout_s: float = setting(
        3600.0,
        "seconds one worker may spend in one step (rollout, update, checkpoint; not the start-up) before the "
        "run is stopped naming it; 0: no limit",
    )


@dataclass(frozen=True)
class SGLangConfig:
    """How tlt runs its SGLang rollout servers (one per GPU, or per group of tp_size GPUs)."""

    gpus: tuple[int, ...] = setting(
        (0,),
        "GPU indices on this node the servers use, split into consecutive groups "
        "of tp_size; worker r owns server r (with more servers than workers, "
        "consecutive servers per worker)",
    )
    tp_size: int = setting(1, "tensor-parallel size of each server (1: one server per GPU)")
    port_base: int = setting(
        30100, "first port of the servers' range on 127.0.0.1: server i takes port_base + 2i (HTTP) and the next (NCCL)"
    )
    startup_timeout_s: float = setting(
        900.0, "seconds to wait for every server to answer /health (a first start compiles kernels and CUDA graphs)"
    )
    stop_timeout_s: float = setting(
        30.0, "seconds a server gets to exit after SIGTERM before its process group is killed"
    )
    mem_fraction: float = setting(
        0.6, "share of each GPU's memory for SGLang's weights and KV cache (leave room for a colocated actor)"
    )
    max_running_requests: int = setting(
        256, "most requests one server runs at once (set explicitly: SGLang caps it at 48 when EAGLE is on)"
    )
    dtype: str = setting("bfloat16", "weight and activation dtype of the served model")
    python: str = setting("", 'Python interpreter whose environment has sglang installed ("": the one running tlt)')
    skip_tokenizer_init: bool = setting(True, "send and receive token ids only (the servers load no tokenizer)")
    colocated: bool = setting(
        True, "actor ranks and servers share the GPUs: weights go over CUDA IPC (false: through a checkpoint on disk)"
    )
    request_timeout_s: float = setting(3600.0, "seconds one /generate request may take before the rollout fails")
    max_in_flight_per_server: int = setting(1024, "most requests tlt keeps in flight on one server at a time")
    probe_max_new_tokens: int = setting(
        64, "tokens generated per prompt by the greedy acceptance probe after every weight sync"
    )
    collapse_accept_length: float = setting(
        1.1, "accept length at or below which a drafter that worked before a sync counts as collapsed"
    )
    auto_off_on_collapse: bool = setting(
        True, "let SGLang turn SD off in a batch-size slot whose acceptance collapses (adaptive mode only)"
    )
    extra_args: tuple[str, ...] = setting((), 'more sglang.launch_server flags, e.g. ["--attention-backend", "fa3"]')

    @property
    def server_count(self) -> int:
        return len(self.gpus) // self.tp_size


@dataclass(frozen=True)
class RolloutConfig:
    backend: RolloutBackendName = setting(
        RolloutBackendName.embedded,
        "embedded (the in-process engine sharing the actor's weights), sglang "
        "(SGLang servers each worker starts and owns), or trl (TRL's own generation, "
        "no speculative decoding; train.trainer trl only)",
    )
    max_new_tokens: int = setting(
        320, "longest response in tokens (at least 1; see train.prompts_per_step for the bound)"
    )
    temperature: float = setting(1.0, "sampling temperature (0 is greedy)")
    top_p: float = setting(
        1.0, "nucleus sampling: keep the most likely tokens up to this total probability (1.0 keeps all)"
    )
    top_k: int = setting(0, "keep only the k most likely tokens (0 keeps all)")
    linear_forms: str = setting(
        "auto",
        "auto (the embedded engine computes each linear layer in the form measured fastest on this machine "
        "for the rows of each pass, e.g. x @ W.T with a transposed copy of the weights; measured once, "
        "cached) or off (plain nn.Linear)",
    )
    dtype: str = setting(
        "auto",
        "precision the embedded engine decodes in: auto (measured once per machine and model: bfloat16 where it "
        "makes a 16-token verify cheap or a decode step faster, as on GPUs and CPUs with AMX, else float32), "
        "float32 or bfloat16 (speculative decoding stays exact against the model in that precision)",
    )
    sglang: SGLangConfig = setting(SGLangConfig(), "SGLang servers, used when backend is sglang")


@dataclass(frozen=True)
class ActorConfig:
    lr: float = setting(1e-4, "AdamW learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    zero_stage: int = setting(2, "DeepSpeed ZeRO stage: 0, 1 or 2 (the rollout needs the full policy on every rank)")
    micro_batch_size: int = setting(4, "sequences per forward/backward")
    gradient_checkpointing: bool = setting(
        False,
        "recompute each decoder layer's activations in backward instead of keeping them (less memory in the "
        "update, about one more forward's time)",
    )
    clip_ratio: float = setting(0.2, "PPO clip range of the ratio pi/pi_old")
    kl_coef: float = setting(0.0, "weight of the KL penalty to the initial policy (0 disables the reference model)")
    ppo_epochs: int = setting(1, "optimizer passes over each rollout")
    grad_clip: float = setting(1.0, "gradient norm clip")
    devices: Any = setting("cpu", "cpu, or the GPU indices of this node, one per worker rank (e.g. [0, 1])")
    precision: str = setting(
        "auto",
        "auto (bf16 where this machine's update measured faster in it: timed once per machine and model, "
        "cached; bf16 on GPUs of compute capability 8.0 or newer), fp32, or bf16 (bfloat16 compute with float32 "
        "master weights and AdamW state)",
    )
    rollout_correction: str = setting(
        "token",
        "truncated importance sampling for the rollout/learner mismatch: token (each token's loss weighted by "
        "min(pi_old/pi_rollout, cap)), sequence (one weight per response, the product of its tokens' ratios, "
        "truncated), or off (the mismatch is still measured); with train.trainer trl it sets TRL's "
        "vllm_importance_sampling_*, which TRL 1.16 applies only when it generates with vLLM, not under tlt's rollout",
    )
    rollout_correction_cap: float = setting(2.0, "upper bound (> 1) of the importance weights of rollout_correction")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = setting(5, "steps between checkpoints (the last step always checkpoints)")
    keep: int = setting(2, "complete checkpoints kept")


# the default recipe's rule table, calibrated on a 2-core CPU for builtin:tiny-arith (tlt calibrate writes one)
DEFAULT_RULES = [
    {"batch": [1, 1], "use": "s2-k1-t3", "candidates": ["s3-k1-t4"]},
    {"batch": [2, 15], "use": "s3-k1-t4"},
    {"batch": [16, 31], "use": "s4-k1-t5", "candidates": ["s3-k1-t4"]},
    {"batch": [32, None], "use": "off"},
]


@dataclass(frozen=True)
class SpeculativeSection:
    mode: SpeculativeMode = setting(
        SpeculativeMode.adaptive,
        "off: plain decoding; fixed: the shape below at every decode step; adaptive: the rules below",
    )
    steps: int = setting(4, "draft depth of mode fixed: tokens drafted in a row before a verify pass")
    topk: int = setting(1, "branches per drafted position of mode fixed (1: a chain)")
    draft_tokens: int = setting(0, "tokens verified per pass of mode fixed (0: steps + 1)")
    rules: list[dict[str, Any]] = setting(
        DEFAULT_RULES,
        "running batch size -> SD configuration (off or s<steps>-k<topk>-t<draft tokens>), first match wins",
    )
    collapse_accept_length: float = setting(
        1.15,
        "accept length (tokens per verify pass, moving average) under "
        "which SD counts as collapsed in a batch-size bucket: SD off "
        "there, a warning, a re-probe every reprobe_steps decode steps",
    )
    reprobe_steps: int = setting(64, "decode steps between re-probes of a collapsed bucket")
    bandit_epsilon: float = setting(
        0.0,
        "share of decode steps on which a rule with candidates tries one at random "
        "(epsilon-greedy; 0: always the best measured)",
    )


@dataclass(frozen=True)
class DrafterConfig:
    init: str = setting(
        "warmup",
        "where the drafter starts: warmup (trained offline on the target's generations, "
        "cached), random, or a folder written by tlt (save_drafter)",
    )
    warmup_steps: int = setting(600, "offline warm-up: optimizer steps")
    warmup_lr: float = setting(1e-3, "offline warm-up: learning rate")
    warmup_prompts: int = setting(1024, "offline warm-up: prompts sampled")
    warmup_batch_size: int = setting(16, "offline warm-up: sequences per optimizer step")
    vocab_size: int = setting(
        0,
        "draft vocabulary: the warm-up keeps the N tokens the model emits most often in its "
        "responses, and the drafter's head and loss run over those N only (verification "
        "stays exact); 0: the whole vocabulary up to 4096 tokens, else 8192; a saved "
        "drafter keeps its own, a random one drafts over the whole vocabulary",
    )
    lr: float = setting(1e-3, "online training on idle workers (drafter_sidecar plugin): AdamW learning rate")
    weight_decay: float = setting(0.0, "online training: AdamW weight decay")
    window_steps: int = setting(2, "online training: RL steps of actor hidden states kept")
    batch_size: int = setting(
        4,
        "online training: sequences per drafter step (drawn from one actor micro-batch, so "
        "a step is short and the sidecar yields to the rollout quickly)",
    )


@dataclass(frozen=True)
class PluginsConfig:
    enabled: list[str] = setting(
        ["drafter_sidecar"],
        "plugins injected into every worker: entry-point names (group tlt.plugins) or module:attribute",
    )
    options: dict[str, Any] = setting({}, "options per plugin name, passed to its constructor")


@dataclass(frozen=True)
class Recipe:
    run: RunConfig = setting(RunConfig(), "the run's name, folder and seed")
    model: ModelConfig = setting(ModelConfig(), "the policy model")
    task: TaskConfig = setting(TaskConfig(), "the prompts and their reward")
    train: TrainConfig = setting(TrainConfig(), "the GRPO loop")
    workers: WorkersConfig = setting(WorkersConfig(), "the worker processes")
    rollout: RolloutConfig = setting(RolloutConfig(), "how responses are generated")
    actor: ActorConfig = setting(ActorConfig(), "the policy's DeepSpeed training")
    checkpoint: CheckpointConfig = setting(CheckpointConfig(), "when checkpoints are written")
    speculative: SpeculativeSection = setting(SpeculativeSection(), "speculative decoding in the rollout")
    drafter: DrafterConfig = setting(DrafterConfig(), "the drafter: where it starts and how it trains")
    plugins: PluginsConfig = setting(PluginsConfig(), "hooks injected into every worker process")
    trl: dict[str, Any] = setting(
        {},
        "train.trainer trl: more fields of TRL's GRPOConfig, passed through (e.g. "
        "loss_type: grpo); fields the recipe sets by its own keys are refused",
    )


CPU_DEVICES = "cpu"


class _RecipeYamlLoader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true and false. YAML 1.1 also reads yes/no/on/off as booleans, which
    would turn `speculative.mode: off` or `run.name=off` into False; as words they stay strings, and
    boolean keys still accept them (OmegaConf converts "off" to False for a bool field). A key given
    twice in one mapping is an error, not a silent override, and so is an alias (`*name`): a recipe
    writes its values out, and an alias can nest itself or expand a few lines into billions of nodes."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} is not allowed in a recipe; write the value out", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = []
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)


_RecipeYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_RecipeYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def read_yaml(text: str) -> Any:
    """A recipe file's or an override value's YAML, with YAML 1.2 booleans (see _RecipeYamlLoader); a YAMLError
    when its lists and mappings nest deeper than MAX_NESTING."""
    too_deep = YAMLError(f"its lists and mappings nest more than {MAX_NESTING} deep; a recipe nests a few levels")
    try:
        content = yaml.load(text, Loader=_RecipeYamlLoader)
    except RecursionError:
        raise too_deep from None
    if _nesting(content) > MAX_NESTING:
        raise too_deep
    return content


def _nesting(value: Any) -> int:
    """How deep lists and mappings nest in `value` (a scalar: 0), counted without recursion."""
    deepest, pending = 0, [(value, 0)]
    while pending:
        item, depth = pending.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict | list):
            pending += [(inner, depth + 1) for inner in (item.values() if isinstance(item, dict) else item)]
    return deepest


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe and apply `key=value` overrides: a Recipe with the right keys and types (values unchecked)."""
    recipe_path = Path(path)
    content = _read_sections(recipe_path)
    try:
        loaded = OmegaConf.create(content)
    except OmegaConfBaseException as error:
        raise RecipeError(f"recipe file {recipe_path} is not a valid recipe: {_first_line(error)}.") from None
    _check_sections(loaded, str(recipe_path))
    return recipe_from_config(loaded, overrides, origin=str(recipe_path))


def _read_sections(recipe_path: Path) -> dict:
    """The recipe file's top-level mapping, or a RecipeError naming the file (and the line, for bad YAML)."""
    if not recipe_path.is_file():
        kind = "is a folder, not a file" if recipe_path.is_dir() else "does not exist"
        raise RecipeError(f"recipe file {recipe_path} {kind}; pass the path of a YAML recipe (see `tlt recipes list`).")
    if recipe_path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"recipe file {recipe_path} is {recipe_path.stat().st_size} bytes; a recipe is a few KB of "
            f"YAML (at most {MAX_RECIPE_BYTES})."
        )
    raw = recipe_path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise RecipeError(
            f"recipe file {recipe_path} is not UTF-8 text (byte 0x{raw[error.start]:02x} at line {line}); "
            "save it as UTF-8."
        ) from None
    try:
        content = read_yaml(text)
    except YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"recipe file {recipe_path} is not valid YAML{where}: {_first_line(error)}.") from None
    if content is None:
        raise RecipeError(
            f"recipe file {recipe_path} is empty; start from a shipped recipe (`tlt recipes show tiny-cpu`)."
        )
    if not isinstance(content, dict):
        raise RecipeError(
            f"recipe file {recipe_path} must hold a mapping of sections (run:, model:, ...), not a list or a scalar."
        )
    return content


def _check_sections(loaded: DictConfig, origin: str) -> None:
    sections = [section.name for section in dataclasses.fields(Recipe)]
    for section, value in loaded.items():
        _require(
            section in sections,
            f"{origin}: section '{section}' is not a recipe section; sections are: {', '.join(sections)}.",
        )
        _require(
            isinstance(value, DictConfig), f"{origin}: section '{section}' must be a mapping of keys, got {value!r}."
        )


def recipe_from_config(
    loaded: DictConfig, overrides: list[str] | tuple[str, ...] = (), origin: str = "recipe"
) -> Recipe:
    """Merge a loaded config and overrides onto the schema: a Recipe with the right keys and types."""
    schema = OmegaConf.structured(Recipe)
    try:
        merged = OmegaConf.merge(schema, loaded)
    except (OmegaConfBaseException, TypeError) as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None
    for override in overrides:
        merged = _apply_override(merged, override)
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise RecipeError(f"{origin}: {_describe(error)}") from None


def _apply_override(merged: DictConfig, override: str) -> DictConfig:
    shown = _shortened(override)
    if "=" not in override:
        raise RecipeError(f"override '{shown}' must have the form key=value, e.g. train.steps=10.")
    key, _, value = override.partition("=")
    key = key.strip()
    if key.count(".") >= MAX_NESTING:  # OmegaConf recurses once a level (a RecursionError at about a thousand)
        raise RecipeError(
            f"override key '{_shortened(key)}' nests more than {MAX_NESTING} deep; a recipe nests a few levels."
        )
    free_form = key.startswith(FREE_FORM_SECTIONS)
    if not free_form and OmegaConf.select(merged, key, default=_MISSING_KEY) is _MISSING_KEY:
        raise RecipeError(f"override key '{_shortened(key)}' is not a recipe key; {_suggest(key)}")
    # YAML folds a line break of a plain word into a space (`run.name=$'a\nb'` would silently become "a b") and
    # stops at a tab or an escape: either way the sentence names the character
    holds_control = RecipeError(
        f"override '{shown}': the value holds a control character (a line break, a tab), which YAML would turn "
        "into a space or refuse; use printable characters only."
    )
    control = any(is_control_character(character) for character in value)
    try:
        content = read_yaml(value)
        parsed = OmegaConf.create()
        OmegaConf.update(parsed, key, content)
    except (YAMLError, OmegaConfBaseException) as error:
        if control:
            raise holds_control from None
        raise RecipeError(f"override '{shown}': the value is not valid YAML ({_first_line(error)}).") from None
    if isinstance(content, str) and control:
        raise holds_control
    try:
        return OmegaConf.merge(merged, parsed)
    except (OmegaConfBaseException, TypeError) as error:
        raise RecipeError(f"override '{shown}': {_describe(error)}") from None


def _shortened(text: str, limit: int = 80) -> str:
    """`text` as an error message quotes it, on one line: control characters escaped (a newline as \\n), whole up
    to `limit` characters, else its start and an ellipsis."""
    text = "".join(repr(character)[1:-1] if is_control_character(character) else character for character in text)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def is_control_character(character: str) -> bool:
    """A control character (newline, tab, escape, DEL, ...): one a terminal does not show as itself."""
    return unicodedata.category(character) == "Cc"


_MISSING_KEY = object()
# keys under these take any name (options passed through to the chosen task or plugin)
FREE_FORM_SECTIONS = ("task.options.", "plugins.options.", "trl.")


def _describe(error: OmegaConfBaseException | TypeError) -> str:
    if isinstance(error, TypeError):  # OmegaConf's merge of a list into a section, or a section into a list
        return "a list cannot take the place of a section, nor a section the place of a list or value."
    key = getattr(error, "full_key", None) or "?"
    message = _first_line(error)
    choice = _key_type(key)
    if isinstance(choice, type) and issubclass(choice, RecipeChoice):
        return choice.refusal(key, getattr(error, "value", None))
    if "not in struct" in message or ("Key '" in message and "not in" in message):
        return f"key '{key}' is not a recipe key; {_suggest(key)}"
    if "Value '" in message or "Invalid type" in message or "could not convert" in message.lower():
        return f"key '{key}' has the wrong type ({message})."
    if "Incompatible value 'None'" in message:  # YAML reads an empty value as null, which this key does not take
        return f"gives {key} no value; write {key}=<value>."
    if "Missing mandatory value" in message:
        return f"key '{key}' must be set."
    return f"key '{key}': {message}."


def _key_type(key: str) -> Any:
    """The schema's type of a dotted recipe key, or None for a key the schema does not have."""
    kind: Any = Recipe
    for name in key.split("."):
        if not (isinstance(kind, type) and dataclasses.is_dataclass(kind)):
            return None
        kind = typing.get_type_hints(kind).get(name)
    return kind


def _flow_value(value: Any) -> str:
    """A recipe value as one quoted word or one line of YAML, for an error message."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, dict | list):
        return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return f"'{value}'"


def _suggest(key: str) -> str:
    section = key.split(".")[0]
    section_types = {section_field.name: section_field.type for section_field in dataclasses.fields(Recipe)}
    if section not in section_types:
        return f"sections are: {', '.join(section_types)}."
    section_type = section_types[section]
    section_class = globals()[section_type] if isinstance(section_type, str) else section_type
    names = [key_field.name for key_field in dataclasses.fields(section_class)]
    return f"keys of '{section}' are: {', '.join(names)}."


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML, as written into every run directory."""
    return OmegaConf.to_yaml(OmegaConf.structured(recipe))


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain values (nested dicts, lists, str, numbers): what loggers record as config."""
    return OmegaConf.to_container(OmegaConf.structured(recipe), enum_to_str=True)
