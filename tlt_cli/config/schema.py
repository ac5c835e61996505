"""The recipe schema: every section as a typed, frozen dataclass, each key with its default and help text.

A `Recipe` holds one dataclass per section (run, model, task, train, workers, rollout with its SGLang
servers, actor, checkpoint, speculative, drafter, plugins) and the free-form `trl` mapping. Each key is
declared once with `setting(default, help)`: its default is the default recipe's value
(recipes/tiny-cpu.yaml, checked by a test) and its help text lives in the field's metadata, which
`tlt recipes show` prints above the key and the shipped recipes' comments start with; a number key's range
is declared there too (`setting(..., minimum=1)`, tlt_cli/config/ranges.py), and its help ends with it. Keys
that take one of a few words are `RecipeChoice` enums. `RecipeError` is the refusal of a recipe: one sentence
naming the key. The loader (tlt_cli/config/loading.py) builds a Recipe from YAML and overrides.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from tlt_cli.config.choices import (
    Bfloat16Rounding,
    DrafterLossKind,
    DrafterStart,
    LinearForms,
    Precision,
    RolloutBackendName,
    RolloutCorrection,
    RolloutDtype,
    ServedDtype,
    SpeculativeMode,
    Trainer,
)
from tlt_cli.config.ranges import RANGE, Range

# the metadata key of a field's help text
HELP = "help"
# the largest run.seed: NumPy's SeedSequence and torch's generator take any seed in [0, 2^32), and
# tlt_cli/rollout/backend.py's `sampling_seed` of it, for 10^9 steps and 2^32 ranks, stays below 2^64
# (torch.Generator.manual_seed's top)
MAX_SEED = 2**32 - 1
# the most steps a run takes (train.steps' bound): its checkpoint names (tlt_cli/checkpoint.py, step_<n>) stay
# within 9 digits, and its sampling seeds within the generators' 64 bits (tlt_cli/rollout/backend.py)
MAX_STEPS = 10**9 - 1


def setting(
    default: Any,
    help_text: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    note: str = "",
) -> Any:
    """A recipe key: its default (copied per instance when mutable), its help text and, for a number, its range
    (tlt_cli/config/ranges.py: an integer key's when the default is one; `note` says why), which the help ends with."""
    metadata: dict[str, Any] = {HELP: help_text}
    if minimum is not None or maximum is not None:
        declared = Range(
            minimum, maximum, exclusive_minimum, exclusive_maximum, integer=type(default) is int, note=note
        )
        metadata = {HELP: f"{help_text}; {declared.described()}", RANGE: declared}
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
    seed: int = setting(
        0,
        "seeds data order, sampling and initialisation",
        minimum=0,
        maximum=MAX_SEED,
        note="2^32 - 1, what the data and sampling generators take",
    )


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
    steps: int = setting(60, "RL steps", minimum=1, maximum=MAX_STEPS, note="what checkpoint names hold")
    prompts_per_step: int = setting(
        16,
        "prompts per step across all workers (a multiple of workers.count; a step generates at most 2^40 tokens: "
        "prompts_per_step x group_size x rollout.max_new_tokens)",
        minimum=1,
    )
    group_size: int = setting(
        8, "responses sampled per prompt (the GRPO group)", minimum=2, note="GRPO compares responses within a group"
    )
    trainer: Trainer = setting(
        Trainer.native,
        "native (tlt's GRPO loop on DeepSpeed workers) or trl (Hugging Face TRL's "
        "GRPOTrainer with tlt's rollout; its own options in the trl section)",
    )


@dataclass(frozen=True)
class WorkersConfig:
    count: int = setting(2, "worker processes, one DeepSpeed rank each", minimum=1)
    threads_per_worker: int = setting(1, "torch threads per worker", minimum=1)
    hostfile: str | None = setting(
        None,
        "DeepSpeed hostfile, one line per node: <host> slots=<n> (n GPUs or, with "
        "actor.devices cpu, CPU ranks); null: the workers are spawned on this "
        "machine without the DeepSpeed launcher",
    )
    step_timeout_s: float = setting(
        3600.0,
        "seconds one worker may spend in one step (rollout, update, checkpoint; not the start-up) before the "
        "run is stopped naming it",
        minimum=0,
        note="0: no limit",
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
    tp_size: int = setting(1, "tensor-parallel size of each server (1: one server per GPU)", minimum=1)
    port_base: int = setting(
        30100, "first port of the servers' range on 127.0.0.1: server i takes port_base + 2i (HTTP) and the next (NCCL)"
    )
    startup_timeout_s: float = setting(
        900.0,
        "seconds to wait for every server to answer /health (a first start compiles kernels and CUDA graphs)",
        minimum=0,
        exclusive_minimum=True,
    )
    stop_timeout_s: float = setting(
        30.0,
        "seconds a server gets to exit after SIGTERM before its process group is killed",
        minimum=0,
        exclusive_minimum=True,
    )
    mem_fraction: float = setting(
        0.6,
        "share of each GPU's memory for SGLang's weights and KV cache (leave room for a colocated actor)",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )
    max_running_requests: int = setting(
        256,
        "most requests one server runs at once (set explicitly: SGLang caps it at 48 when EAGLE is on)",
        minimum=1,
    )
    dtype: ServedDtype = setting(ServedDtype.bfloat16, "weight and activation dtype of the served model")
    python: str = setting("", 'Python interpreter whose environment has sglang installed ("": the one running tlt)')
    skip_tokenizer_init: bool = setting(True, "send and receive token ids only (the servers load no tokenizer)")
    colocated: bool = setting(
        True, "actor ranks and servers share the GPUs: weights go over CUDA IPC (false: through a checkpoint on disk)"
    )
    request_timeout_s: float = setting(
        3600.0,
        "seconds one /generate request may take before the rollout fails",
        minimum=0,
        exclusive_minimum=True,
    )
    max_in_flight_per_server: int = setting(
        1024, "most requests tlt keeps in flight on one server at a time", minimum=1
    )
    probe_max_new_tokens: int = setting(
        64,
        "tokens generated per prompt by the greedy acceptance probe after every weight sync",
        minimum=2,
        note="a probe needs decode steps",
    )
    collapse_accept_length: float = setting(
        1.1,
        "accept length at or below which a drafter that worked before a sync counts as collapsed",
        minimum=1,
        note="1 = no draft token accepted",
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
        320, "longest response in tokens (train.prompts_per_step says how many tokens a step may take)", minimum=1
    )
    temperature: float = setting(1.0, "sampling temperature", minimum=0, note="0 is greedy, else at least 0.001")
    top_p: float = setting(
        1.0,
        "nucleus sampling: keep the most likely tokens up to this total probability (1.0 keeps all)",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
    )
    top_k: int = setting(0, "keep only the k most likely tokens", minimum=0, note="0 keeps all tokens")
    linear_forms: LinearForms = setting(
        LinearForms.auto,
        "auto (the embedded engine computes each linear layer in the form measured fastest on this machine "
        "for the rows of each pass, e.g. x @ W.T with a transposed copy of the weights; measured once, "
        "cached) or off (plain nn.Linear)",
    )
    dtype: RolloutDtype = setting(
        RolloutDtype.auto,
        "precision the embedded engine decodes in: auto (measured once per machine, model and batch: bfloat16 "
        "where it makes a rollout, a worker's batch then its tail, at least 10% faster, else float32), "
        "float32 or bfloat16 (speculative decoding stays exact against the model in that precision)",
    )
    sglang: SGLangConfig = setting(SGLangConfig(), "SGLang servers, used when backend is sglang")


@dataclass(frozen=True)
class ActorConfig:
    lr: float = setting(1e-4, "AdamW learning rate", minimum=0, exclusive_minimum=True)
    weight_decay: float = setting(0.0, "AdamW weight decay", minimum=0)
    zero_stage: int = setting(
        2, "DeepSpeed ZeRO stage", minimum=0, maximum=2, note="the rollout needs the full policy on every rank"
    )
    micro_batch_size: int = setting(
        4,
        "sequences per forward/backward: right-padded rows when micro_batch_tokens is 0, and TRL's per-device batch "
        "under train.trainer trl",
        minimum=1,
    )
    micro_batch_tokens: int = setting(
        2048,
        "tokens per forward/backward: whole GRPO groups laid back to back with no padding, up to this many (a "
        "larger group alone); 0: micro_batch_size right-padded rows instead",
        minimum=0,
    )
    share_prompt: bool = setting(
        True,
        "with micro_batch_tokens, compute each group's prompt once for all its responses in the update's forward "
        "and backward (the same gradients, fewer tokens)",
    )
    gradient_checkpointing: bool = setting(
        False,
        "recompute each decoder layer's activations in backward instead of keeping them (less memory in the "
        "update, about one more forward's time)",
    )
    clip_ratio: float = setting(
        0.2,
        "PPO clip range of the ratio pi/pi_old",
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        exclusive_maximum=True,
    )
    kl_coef: float = setting(
        0.0, "weight of the KL penalty to the initial policy (0 disables the reference model)", minimum=0
    )
    ppo_epochs: int = setting(1, "optimizer passes over each rollout", minimum=1)
    grad_clip: float = setting(1.0, "gradient norm clip", minimum=0, exclusive_minimum=True)
    devices: Any = setting("cpu", "cpu, or the GPU indices of this node, one per worker rank (e.g. [0, 1])")
    precision: Precision = setting(
        Precision.auto,
        "auto (bf16 where this machine's update measured faster in it: timed once per machine and model, "
        "cached; bf16 on GPUs of compute capability 8.0 or newer), fp32, or bf16 (bfloat16 compute with float32 "
        "master weights and AdamW state)",
    )
    bfloat16_rounding: Bfloat16Rounding = setting(
        Bfloat16Rounding.stochastic,
        "how the bfloat16 copies of the float32 policy are rounded, the rollout's decode copy (rollout.dtype "
        "bfloat16) and the learner's compute copy (precision bf16 on CPU): stochastic (each weight up with "
        "probability equal to its remainder, from fixed thresholds, so the copies follow updates far below a "
        "bfloat16 ulp and the rollout samples the weights the learner computes with) or nearest (round-to-nearest, "
        "as torch casts; a 1e-6 update moves such a copy ~300x more than the policy)",
    )
    rollout_correction: RolloutCorrection = setting(
        RolloutCorrection.token,
        "truncated importance sampling for the rollout/learner mismatch: token (each token's loss weighted by "
        "min(pi_old/pi_rollout, cap)), sequence (one weight per response, the product of its tokens' ratios, "
        "truncated), or off (the mismatch is still measured); with train.trainer trl the same weights, applied to "
        "TRL's loss through its per-token advantages (docs/trl.md)",
    )
    rollout_correction_cap: float = setting(
        2.0,
        "upper bound of the importance weights of rollout_correction",
        minimum=1,
        exclusive_minimum=True,
        # a weight, times a log-ratio and summed over a batch's tokens, must stay far inside float32's range
        maximum=10_000,
        note="importance weights are truncated at it",
    )


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = setting(5, "steps between checkpoints (the last step always checkpoints)", minimum=1)
    keep: int = setting(2, "complete checkpoints kept", minimum=1)


# mode adaptive's table when the recipe gives none: calibrated on a 2-core CPU for builtin:tiny-arith in float32
# (tlt calibrate writes one)
DEFAULT_RULES = [
    {"batch": [1, 1], "use": "s2-k1-t3", "candidates": ["s3-k1-t4"]},
    {"batch": [2, 15], "use": "s3-k1-t4"},
    {"batch": [16, 31], "use": "s4-k1-t5", "candidates": ["s3-k1-t4"]},
    {"batch": [32, None], "use": "off"},
]


@dataclass(frozen=True)
class SpeculativeSection:
    mode: SpeculativeMode = setting(
        SpeculativeMode.auto,
        "auto: per decode step, the configuration (or plain decoding) predicted fastest from the pass costs "
        "measured on this machine and the acceptance measured in this run; off: plain decoding; fixed: the "
        "shape below at every decode step; adaptive: the rule table below",
    )
    steps: int = setting(4, "draft depth of mode fixed: tokens drafted in a row before a verify pass")
    topk: int = setting(1, "branches per drafted position of mode fixed (1: a chain)")
    draft_tokens: int = setting(0, "tokens verified per pass of mode fixed (0: steps + 1)")
    rules: list[dict[str, Any]] = setting(
        [],
        "a rule table: running batch size -> SD configuration (off or s<steps>-k<topk>-t<draft tokens>), "
        "first match wins; a table given here wins over mode auto's cost model; empty: none (mode adaptive "
        "then uses tlt's default table)",
    )
    collapse_accept_length: float = setting(
        1.15,
        "accept length (tokens per verify pass, moving average) under "
        "which SD counts as collapsed in a batch-size bucket: SD off "
        "there, a warning, a re-probe every reprobe_steps decode steps",
        minimum=1,
        note="1 means no draft accepted",
    )
    reprobe_steps: int = setting(64, "decode steps between re-probes of a collapsed bucket", minimum=1)
    bandit_epsilon: float = setting(
        0.0,
        "share of decode steps on which a rule with candidates tries one at random "
        "(epsilon-greedy; 0: always the best measured)",
        minimum=0,
        maximum=1,
    )


# drafter.init values that start from a fresh drafter, with no offline warm-up before step 0
FRESH_DRAFTER_STARTS = (DrafterStart.online, DrafterStart.random)


@dataclass(frozen=True)
class DrafterConfig:
    init: str = setting(
        DrafterStart.auto.value,
        "where the drafter starts: auto (the newest drafter tlt holds for this model on this machine, written by "
        "an earlier run or warm-up, else as online), online (a fresh drafter, no wait: mode auto drafts model-free "
        "n-grams until the drafter, trained by drafter_sidecar from step 0's rollouts on, pays), warmup (trained "
        "offline on the target's generations before step 0, cached), random, or a drafter folder: tlt's own "
        "(save_drafter, a run checkpoint's drafter/) or an EAGLE folder `tlt export-drafter` wrote (EAGLE-3 "
        "drafters are refused: they read three of the target's layers)",
    )
    loss: DrafterLossKind = setting(
        DrafterLossKind.acceptance,
        "the drafter's next-token objective, offline and online: acceptance (soft cross-entropy and total "
        "variation at the rollout's temperature, what lossless sampling accepts) or eagle (soft cross-entropy "
        "at temperature 1, weight 0.1)",
    )
    train_depths: int = setting(
        3,
        "draft depths the drafter trains at, offline and online: depth d reads its own prediction from depth d-1, "
        "as it does while drafting its d-th token (training-time test; 1: the target's states only, EAGLE-1)",
        minimum=1,
        maximum=8,
    )
    warmup_steps: int = setting(600, "offline warm-up: optimizer steps", minimum=1)
    warmup_lr: float = setting(1e-3, "offline warm-up: learning rate", minimum=0, exclusive_minimum=True)
    warmup_prompts: int = setting(1024, "offline warm-up: prompts sampled", minimum=1)
    warmup_batch_size: int = setting(16, "offline warm-up: sequences per optimizer step", minimum=1)
    vocab_size: int = setting(
        0,
        "draft vocabulary: the warm-up keeps the N tokens the model emits most often in its "
        "responses, and the drafter's head and loss run over those N only (verification "
        "stays exact); 0: the whole vocabulary up to 4096 tokens, else 8192; a saved "
        "drafter keeps its own, an online one drafts over the N most frequent in the task's prompts, a random one "
        "over the whole vocabulary",
        minimum=0,
        note="0: the default",
    )
    lr: float = setting(
        1e-3,
        "online training on idle workers (drafter_sidecar plugin): AdamW learning rate",
        minimum=0,
        exclusive_minimum=True,
    )
    weight_decay: float = setting(0.0, "online training: AdamW weight decay", minimum=0)
    window_steps: int = setting(2, "online training: RL steps of actor hidden states kept", minimum=1)
    batch_size: int = setting(
        4,
        "online training: sequences per drafter step (drawn from one actor micro-batch, so "
        "a step is short and the sidecar yields to the rollout quickly)",
        minimum=1,
    )
    idle_duty: float = setting(
        1.0,
        "online training on idle workers: the share of the wait the sidecar trains in, pausing between steps for "
        "the rest, so a worker still decoding the tail shares the memory bus with it less (training all the time "
        "slowed a one-row decode next door 7.4% on a 2-core EPYC; at 0.35 the slowdown was within that "
        "measurement's noise, 6-8%); 0: no training on idle workers",
        minimum=0,
        maximum=1,
    )
    update_share: float = setting(
        0.05,
        "online training in the update: the drafter trains on each actor micro-batch's hidden states as the "
        "update computes them (every response token of the step first), for at most this share of the update's "
        "own time; 0: only on idle workers",
        minimum=0,
        maximum=1,
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

    @property
    def prompts_per_worker(self) -> int:
        """Each worker's prompts of one step: train.prompts_per_step split evenly over workers.count."""
        return self.train.prompts_per_step // self.workers.count

    @property
    def samples_per_worker(self) -> int:
        """Each worker's completions of one step (its prompts x train.group_size): what its rollout decodes at once."""
        return self.prompts_per_worker * self.train.group_size


CPU_DEVICES = "cpu"
