"""A worker's memory: its resident set read from /proc, and its peak estimated before a run starts.

Measured (Linux /proc, no psutil): `resident_bytes` (VmRSS), `peak_resident_bytes` (VmHWM, the
high-water mark since the process started or since `reset_peak_resident`, which writes 5 to
/proc/self/clear_refs), `available_bytes` (MemAvailable). The worker loop resets the mark at each
step's start and reports the step's peak (`memory_peak_gb` in the trace's worker records).

Estimated: `worker_peak_estimate(recipe, parameter_count)` adds up what one native worker holds at
its peak: the runtime (Python, torch, transformers, DeepSpeed), the policy's weights (and a
reference copy with a KL term), gradients and AdamW state as the ZeRO stage splits them over the
workers, the drafter (with its gradients and AdamW state when the sidecar trains it) and the sidecar's window of
hidden states, the rollout's KV cache and hidden states (with the rollout log-probs' chunk; bfloat16 when
`rollout.dtype` says so, float32 for `auto`, which may choose either) with the decode model's own weight copies
(freed before the update, tlt_cli/rollout/embedded.py), or else the update's saved activations for its largest
micro-batch (`micro_batch_extent`: padded rows, or packed groups where the model packs, attending by segments
or, on a kernel that does not, over the whole square with its dense masks, `dense_mask_bytes`; with
`actor.gradient_checkpointing`, each layer's input and a few layers' activations) and the log-prob chunk.
With `actor.precision: bf16` on CPU the module, its gradients and AdamW state stay float32 (the master copy),
the update's forward adds autocast's bfloat16 copy of the weights, the saved activations weigh as float32's (autocast
keeps most of them float32) and ideep's and oneDNN's kernel caches add their bounded share; on
GPUs DeepSpeed's bf16 mode makes the module itself bfloat16. The per-token
constants are costs measured on SmolLM2-135M (BENCHMARKS.md "Memory per worker") and
scale with the model's shape; the runtime and the kernel caches were measured on tiny-cpu workers whose every phase
returns its freed memory (BENCHMARKS.md "Memory flat per step (issue 63)"). `memory_problem(recipe)` says, in one
sentence, when a run's workers on this machine would not fit in MemAvailable; the checks when a run starts
(tlt_cli/preflight.py `check_memory`) refuse the run with it.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, replace
from pathlib import Path

from tlt_cli.config import CPU_DEVICES, Bfloat16Rounding, Precision, Recipe, RolloutDtype, Trainer
from tlt_cli.plugins import plugins_train_drafter
from tlt_cli.training.drafter_use import drafter_needed
from tlt_cli.training.logprobs import CHUNK_TOKENS

GB = 1e9
FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2
# Python, torch, transformers, DeepSpeed and gloo imported and initialised, with what malloc keeps beyond the parts
# below at a phase's peak once each phase's freed memory goes back (tlt_cli/memory_hygiene.py): a tiny-cpu worker
# holds 0.49 GB besides its tensors after a float32 step (BENCHMARKS.md "Memory flat per step (issue 63)")
RUNTIME_BYTES = 0.55e9
# bfloat16 on CPU: ideep's and oneDNN's kernel caches (64 shapes each) with their compiled code; a tiny-cpu worker's
# base after a step is 0.15 GB higher in bf16 than in fp32 (same BENCHMARKS.md section)
KERNEL_CACHE_BYTES = 0.15e9
# AdamW keeps two float32 moments per parameter; ZeRO 1-2 also keep a float32 master copy of their part
ADAM_MOMENTS = 2
# float32 values the decoder saves for backward per token and layer, in units of (hidden, intermediate)
# sizes: norms, q/k/v/o, attention output, residuals; gate, up, activation and product (measured)
SAVED_PER_HIDDEN = 7
SAVED_PER_INTERMEDIATE = 5
# with recomputation, backward holds about this many layers' worth of the values above at once: the recomputed
# layer's and their gradients, with what the allocator keeps (fitted to SmolLM2-135M at 652 and 2608 tokens a
# micro-batch, never under; the one layer that theory says is 2-3x under what was measured)
RECOMPUTED_LAYERS = 7
# bytes the attention saves per layer per (query, key) pair of a sequence (fitted: updates at 646-2182 tokens)
ATTENTION_PAIR_BYTES = 9
# [chunk, V] float32 buffers alive at once in the chunked log-prob backward (logits, their gradient)
LOGPROB_BUFFERS = 2
# bytes per (query, key) pair of the dense masks a packed micro-batch keeps when its decoder does not attend by
# segments (packed_forward.py `packed_layout`): a boolean and its additive float32 copy, for full and windowed layers
DENSE_MASK_PAIR_BYTES = 2 * (1 + FLOAT32_BYTES)
# the drafter sidecar keeps, per token besides its hidden state, the token id (int64) and two boolean masks
SIDECAR_TOKEN_BYTES = 8 + 2
PROC_STATUS = Path("/proc/self/status")
PROC_MEMINFO = Path("/proc/meminfo")
PROC_CLEAR_REFS = Path("/proc/self/clear_refs")


def resident_bytes() -> int:
    """This process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS") or 0


def peak_resident_bytes() -> int:
    """This process's resident high-water mark (VmHWM; getrusage's ru_maxrss where /proc is missing)."""
    peak = _status_bytes("VmHWM")
    if peak is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def reset_peak_resident() -> bool:
    """Start a new high-water mark at the current resident set; False where the kernel does not allow it."""
    try:
        PROC_CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def available_bytes() -> int | None:
    """What the kernel can give without swapping (MemAvailable), or None where /proc/meminfo is missing."""
    try:
        lines = PROC_MEMINFO.read_text().splitlines()
    except OSError:
        return None
    return _field_bytes(lines, "MemAvailable")


def _status_bytes(name: str) -> int | None:
    try:
        return _field_bytes(PROC_STATUS.read_text().splitlines(), name)
    except OSError:
        return None


def _field_bytes(lines: list[str], name: str) -> int | None:
    """A '<name>:   1234 kB' line's value in bytes."""
    for line in lines:
        key, _, value = line.partition(":")
        if key == name:
            return int(value.split()[0]) * 1024
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its parameter count and the shapes its activations take."""

    parameters: int
    layers: int
    hidden: int
    intermediate: int
    attention_heads: int
    query_width: int
    key_value_width: int
    vocab_size: int
    # whether the actor can pack the model's micro-batches (packed_forward.py `packing_supported`); else it pads rows
    packs: bool = True
    # whether a packed micro-batch attends by segments (packed_forward.py `attends_by_segments`): no [L,L] mask is
    # built; else its dense masks are, and its attention covers the whole square
    by_segments: bool = True


@dataclass(frozen=True)
class MemoryEstimate:
    """One worker's resident peak, by copy, in bytes. The rollout (its cache and the decode model's weight copies)
    and the update (its activations and autocast's casts) do not overlap; the rest lives through both."""

    runtime: int
    weights: int
    gradients: int
    optimizer: int
    drafter: int
    sidecar: int
    rollout: int
    decode_copies: int
    update: int
    autocast_casts: int = 0
    kernel_caches: int = 0

    @property
    def training_state(self) -> int:
        """The policy's gradients and AdamW state (with ZeRO's master copy) on this worker."""
        return self.gradients + self.optimizer

    @property
    def total_bytes(self) -> int:
        resident = self.runtime + self.kernel_caches + self.weights + self.training_state + self.drafter + self.sidecar
        return resident + max(self.rollout + self.decode_copies, self.update + self.autocast_casts)

    def describe(self) -> str:
        parts = (
            f"runtime {self.runtime / GB:.2f}, kernel caches {self.kernel_caches / GB:.2f}, "
            f"weights {self.weights / GB:.2f}, gradients {self.gradients / GB:.2f}, "
            f"optimizer {self.optimizer / GB:.2f}, drafter and its optimizer {self.drafter / GB:.2f}, "
            f"sidecar buffers {self.sidecar / GB:.2f}; rollout cache {self.rollout / GB:.2f} and decode copies "
            f"{self.decode_copies / GB:.2f}, or update activations {self.update / GB:.2f} and autocast casts "
            f"{self.autocast_casts / GB:.2f}"
        )
        return f"{self.total_bytes / GB:.1f} GB ({parts})"


def _bfloat16_weight_copies(recipe: Recipe, shape: ModelShape, kept_layers: int) -> int:
    """Bytes of the update's bfloat16 weight copies on CPU. Stochastically rounded: one of every decoder layer's
    linear weights for the whole update (tlt_cli/training/rounded_compute.py). Rounded to nearest: autocast's,
    saved for backward by every layer that keeps its activations (with recomputation only the few layers
    recomputed at once hold theirs)."""
    if recipe.actor.bfloat16_rounding == Bfloat16Rounding.stochastic:
        return shape.layers * layer_linear_parameters(shape) * BFLOAT16_BYTES
    return shape.parameters * BFLOAT16_BYTES * min(kept_layers, shape.layers) // shape.layers


def model_shape(recipe: Recipe) -> ModelShape:
    """The recipe's model shape from its config, the parameters counted on the meta device (no weights read)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tlt_cli.models.loading import load_config_and_tokenizer
    from tlt_cli.training.packed_forward import attends_by_segments, packing_supported

    config, _ = load_config_and_tokenizer(recipe.model.path, trust_remote_code=recipe.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShape(
        parameters=parameters,
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        attention_heads=heads,
        query_width=heads * head_dim,
        key_value_width=getattr(config, "num_key_value_heads", heads) * head_dim,
        vocab_size=config.vocab_size,
        packs=packing_supported(config) is None,
        by_segments=attends_by_segments(model.config),
    )


def worker_peak_estimate(recipe: Recipe, shape: ModelShape, prompt_tokens: int) -> MemoryEstimate:
    """One native worker's peak resident bytes for `recipe` on a model of `shape` (module docstring); with
    actor.precision auto, the larger of fp32's and bf16's (either may run)."""
    if recipe.actor.precision == Precision.auto:
        from tlt_cli.training.actor import RESOLVED_PRECISIONS

        estimates = [
            worker_peak_estimate(
                replace(recipe, actor=replace(recipe.actor, precision=precision)), shape, prompt_tokens
            )
            for precision in RESOLVED_PRECISIONS
        ]
        return max(estimates, key=lambda estimate: estimate.total_bytes)
    workers = recipe.workers.count
    bf16 = recipe.actor.precision == Precision.bf16
    on_cpu = recipe.actor.devices == CPU_DEVICES
    # the module's own dtype (the rollout's KV cache follows it) and that of the update's saved activations: on CPU
    # autocast keeps most saved values float32 (norms, residuals, attention), so a bf16 update's peak measured as
    # float32's (tiny-cpu: 0.35 against 0.37 GB over the worker's base, BENCHMARKS.md issue 63)
    weight_bytes = BFLOAT16_BYTES if bf16 and not on_cpu else FLOAT32_BYTES
    activation_bytes = BFLOAT16_BYTES if bf16 and not on_cpu else FLOAT32_BYTES
    copies = 2 if recipe.actor.kl_coef > 0 else 1
    parameters = shape.parameters
    # ZeRO 1-2 split the AdamW state and its float32 master copy over the workers; ZeRO 2 keeps its part of
    # the gradients in a buffer of its own, besides the whole gradient that backward makes
    zero = recipe.actor.zero_stage
    optimizer = parameters * FLOAT32_BYTES * (ADAM_MOMENTS + (1 if zero >= 1 else 0)) // (workers if zero >= 1 else 1)
    gradients = parameters * FLOAT32_BYTES + (parameters * FLOAT32_BYTES // workers if zero >= 2 else 0)
    sequence_tokens = prompt_tokens + recipe.rollout.max_new_tokens
    samples = recipe.samples_per_worker
    logprob_chunk = LOGPROB_BUFFERS * CHUNK_TOKENS * shape.vocab_size * FLOAT32_BYTES
    # keys and values of every layer and the last hidden state (which the rollout log-probs and the drafter read)
    # for every sample, prompt and response, in the rollout's dtype, and the head's chunk of the rollout log-probs
    rollout_bytes = BFLOAT16_BYTES if recipe.rollout.dtype == RolloutDtype.bfloat16 else FLOAT32_BYTES
    per_token = shape.layers * 2 * shape.key_value_width + shape.hidden
    rollout = samples * sequence_tokens * per_token * rollout_bytes + logprob_chunk
    micro_batch_tokens, attention_pairs = micro_batch_extent(recipe, prompt_tokens, shape.packs, shape.by_segments)
    saved_per_layer = SAVED_PER_HIDDEN * shape.hidden + SAVED_PER_INTERMEDIATE * shape.intermediate
    # recomputation keeps each layer's input, and in backward a few layers' activations at a time
    kept_layers = RECOMPUTED_LAYERS if recipe.actor.gradient_checkpointing else shape.layers
    inputs = shape.layers * shape.hidden if recipe.actor.gradient_checkpointing else 0
    saved_per_token = inputs + kept_layers * saved_per_layer
    attention = attention_pairs * kept_layers * ATTENTION_PAIR_BYTES + dense_mask_bytes(
        recipe, shape, micro_batch_tokens
    )
    activations = micro_batch_tokens * saved_per_token * activation_bytes
    autocast_weights = _bfloat16_weight_copies(recipe, shape, kept_layers) if bf16 and on_cpu else 0
    return MemoryEstimate(
        runtime=int(RUNTIME_BYTES),
        weights=parameters * weight_bytes * copies,
        gradients=gradients,
        optimizer=optimizer,
        drafter=drafter_bytes(recipe, shape),
        sidecar=sidecar_bytes(recipe, shape, sequence_tokens),
        rollout=rollout,
        decode_copies=shape.layers * layer_linear_parameters(shape) * rollout_bytes,
        update=activations + attention + logprob_chunk,
        autocast_casts=autocast_weights,
        kernel_caches=int(KERNEL_CACHE_BYTES) if bf16 and on_cpu else 0,
    )


def micro_batch_extent(
    recipe: Recipe, prompt_tokens: int, packs: bool = True, by_segments: bool = True
) -> tuple[int, int]:
    """The tokens and (query, key) pairs of the update's largest micro-batch, every response max_new_tokens long:
    micro_batch_size padded rows, or as many whole groups as micro_batch_tokens holds (one at least), packed
    with each prompt once under share_prompt and attending by segments (tlt_cli/training/packed_forward.py; every
    pair of the packed square where it does not, `by_segments` False); padded rows also when the model cannot pack
    (`packs` False, as the actor decides)."""
    response, group_size = recipe.rollout.max_new_tokens, recipe.train.group_size
    sequence = prompt_tokens + response
    if not recipe.actor.micro_batch_tokens or not packs:  # padded rows
        rows = min(recipe.actor.micro_batch_size, recipe.samples_per_worker)
        return rows * sequence, rows * sequence**2
    if recipe.actor.share_prompt:
        group_tokens = prompt_tokens + group_size * response
        group_pairs = prompt_tokens**2 + group_size * response * sequence
    else:
        group_tokens, group_pairs = group_size * sequence, group_size * sequence**2
    groups = min(max(1, recipe.actor.micro_batch_tokens // group_tokens), recipe.prompts_per_worker)
    tokens = groups * group_tokens
    return tokens, groups * group_pairs if by_segments else tokens**2


def dense_mask_bytes(recipe: Recipe, shape: ModelShape, micro_batch_tokens: int) -> int:
    """The dense [L,L] masks of the largest packed micro-batch, where its decoder does not attend by segments;
    nothing where it does (no mask is built) or where the update pads rows."""
    if shape.by_segments or not (recipe.actor.micro_batch_tokens and shape.packs):
        return 0
    return micro_batch_tokens**2 * DENSE_MASK_PAIR_BYTES


def layer_linear_parameters(shape: ModelShape) -> int:
    """Weights of one decoder layer's linear layers: q, k, v, o, gate, up and down."""
    attention = 2 * shape.hidden * shape.query_width + 2 * shape.hidden * shape.key_value_width
    return attention + 3 * shape.hidden * shape.intermediate


def drafter_bytes(recipe: Recipe, shape: ModelShape) -> int:
    """The drafter (one decoder layer of the policy's shape and its input projection from two hidden states; it
    shares the policy's embedding and head) in float32, with gradients and AdamW's moments when a plugin trains
    it online; nothing when the run needs no drafter."""
    if not drafter_needed(recipe):
        return 0
    parameters = layer_linear_parameters(shape) + 2 * shape.hidden * shape.hidden
    trained = plugins_train_drafter(recipe.plugins.enabled)
    return parameters * FLOAT32_BYTES * (1 + (1 + ADAM_MOMENTS if trained else 0))


def sidecar_bytes(recipe: Recipe, shape: ModelShape, sequence_tokens: int) -> int:
    """The drafter sidecar's window: drafter.window_steps steps of the actor's float32 last hidden states with the
    tokens and masks of each of the worker's sequences (plugins/drafter_sidecar.py); nothing without the plugin."""
    if not plugins_train_drafter(recipe.plugins.enabled):
        return 0
    per_token = shape.hidden * FLOAT32_BYTES + SIDECAR_TOKEN_BYTES
    return recipe.drafter.window_steps * recipe.samples_per_worker * sequence_tokens * per_token


def memory_problem(recipe: Recipe) -> str | None:
    """One sentence naming what to change when this machine's workers would not fit in MemAvailable; else None.

    Only for CPU actors of the native trainer spawned on this machine (a hostfile's ranks run on
    other nodes; GPU workers hold the model in GPU memory; TRL computes its own loss).
    """
    if (
        recipe.actor.devices != CPU_DEVICES
        or recipe.workers.hostfile is not None
        or recipe.train.trainer != Trainer.native
    ):
        return None
    available = available_bytes()
    if available is None:
        return None
    shape = model_shape(recipe)
    # without the prompts first: a run too big for memory even so is refused before a step's prompts are encoded
    # (one by one, train.prompts_per_step of them; once this fits, memory bounds their number)
    estimate = worker_peak_estimate(recipe, shape, prompt_tokens=0)
    if estimate.total_bytes * recipe.workers.count <= available:
        estimate = worker_peak_estimate(recipe, shape, longest_prompt_tokens(recipe))
    needed = estimate.total_bytes * recipe.workers.count
    if needed <= available:
        return None
    return (
        f"{recipe.workers.count} workers would need about {needed / GB:.1f} GB at their peak but this machine has "
        f"{available / GB:.1f} GB available (each worker: {estimate.describe()}); lower workers.count, "
        f"train.prompts_per_step or rollout.max_new_tokens, or free memory."
    )


def longest_prompt_tokens(recipe: Recipe) -> int:
    """The longest prompt, in tokens, of the run's first step (the task's prompts through its template)."""
    from tlt_cli.models.loading import load_config_and_tokenizer
    from tlt_cli.tasks.prompts import encode_prompt
    from tlt_cli.tasks.registry import build_task

    _, tokenizer = load_config_and_tokenizer(recipe.model.path, trust_remote_code=recipe.model.trust_remote_code)
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    return max(
        len(encode_prompt(tokenizer, task.problem(index).prompt)) for index in range(recipe.train.prompts_per_step)
    )
