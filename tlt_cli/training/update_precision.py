"""`actor.precision: auto` resolved by measurement: the actor's forward + backward timed in float32 and bfloat16.

`resolve_update_precision(recipe, cache_dir, load_policy)` is what the run's plan is made with
(tlt_cli/training/setup.py `planned_run`, in the driver before any worker starts); it gives the recipe with a
concrete precision and the `UpdatePrecision` (tlt_cli/tuning/run_plan.py) that the console and the trace's run
record show. `fp32` and `bf16` are kept as written. For `auto` on CPU it loads the policy (`load_policy`,
only when no record is cached) and times, in process CPU time, what one micro-batch of the update costs
(`measure_update_seconds`): the actor's own forward (`forward_logprobs` under `update_autocast`,
recomputation as the recipe sets it) and backward, on the micro-batch the actor runs: with
actor.micro_batch_tokens on a model that packs, whole groups of MEASURED_GROUP_SIZE random sequences of
MEASURED_TOKENS tokens sharing their prompt, as many as fit, packed and attending by segments as the actor
packs them (`packed_forward_logprobs`); else micro_batch_size right-padded random sequences of MEASURED_TOKENS
tokens. At most ROUNDS interleaved rounds after a warm-up of each, the best time
of each precision counting, and fewer where a round already decides (`decided`: bf16's time CLEAR_GAP or more of
fp32's away from the margin); bf16 is chosen only if it is at least MARGIN faster, so nothing gets
slower. The figures are cached per machine and model (`<cache_dir>/update_precision/<hash>.json`,
keyed like the linear-form plan: tlt_cli/tuning/cache.py) and read back on the next
run. On GPUs `auto` is bf16 where every actor GPU has compute capability 8.0 or newer, unmeasured.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel

from tlt_cli.config import CPU_DEVICES, ActorConfig, Bfloat16Rounding, Precision, Recipe
from tlt_cli.processes.machine_checks import BF16_MIN_CAPABILITY
from tlt_cli.training.actor import (
    RESOLVED_PRECISIONS,
    enable_recomputation,
    forward_logprobs,
    packed_forward_logprobs,
    update_autocast,
)
from tlt_cli.training.grpo import policy_loss
from tlt_cli.training.memory import model_shape
from tlt_cli.training.packed_forward import packed_attention, packs_micro_batches
from tlt_cli.training.policy_batch import PolicyBatch
from tlt_cli.training.rounded_compute import RoundedLinearWeights
from tlt_cli.tuning.cache import cached_record, machine_key, positive_figures
from tlt_cli.tuning.run_plan import UpdatePrecision
from tlt_cli.tuning.threads import torch_threads
from tlt_cli.tuning.timing import milliseconds

CACHE_FOLDER = "update_precision"
MEASUREMENT_FORMAT = 3
# tokens per measured sequence: a prompt and a response of the lengths real-cpu's task meets (p50 66-85)
MEASURED_TOKENS = 256
# the first tokens of each measured sequence count as its prompt (no log-probs); the rest as its response
MEASURED_PROMPT_TOKENS = 64
# sequences of a measured group when the actor packs: one prompt, this many responses (a GRPO group of 4)
MEASURED_GROUP_SIZE = 4
ROUNDS = 2
# bf16 must be this much faster than fp32 to be chosen (timing noise must not make the update slower)
MARGIN = 0.05
# a round whose bf16 time is this share of fp32's or more away from the margin decides: no more rounds
CLEAR_GAP = 0.2


def resolve_update_precision(
    recipe: Recipe, cache_dir: Path, load_policy: Callable[[], PreTrainedModel]
) -> tuple[Recipe, UpdatePrecision]:
    """The recipe with actor.precision concrete (fp32 or bf16), and how it was chosen (module docstring);
    `load_policy()` gives the recipe's model, called only when auto is measured (no record cached)."""
    actor = recipe.actor
    if actor.precision != Precision.auto:
        return recipe, UpdatePrecision(actor.precision, "as the recipe sets it")
    if actor.bfloat16_rounding == Bfloat16Rounding.nearest:
        reason = "auto: bfloat16 rounded to nearest does not follow small updates (actor.bfloat16_rounding)"
        return replace(recipe, actor=replace(actor, precision=Precision.fp32)), UpdatePrecision(Precision.fp32, reason)
    if actor.devices == CPU_DEVICES:
        choice = measured_choice(recipe, cache_dir, load_policy)
    else:
        choice = gpu_choice(actor.devices)
    return replace(recipe, actor=replace(actor, precision=choice.precision)), choice


def gpu_choice(devices: list[int]) -> UpdatePrecision:
    """bf16 where CUDA shows every device with compute capability 8.0 or newer, else fp32."""
    capable = torch.cuda.is_available() and all(
        device < torch.cuda.device_count() and torch.cuda.get_device_capability(device)[0] >= BF16_MIN_CAPABILITY
        for device in devices
    )
    if capable:
        return UpdatePrecision(Precision.bf16, "auto: GPUs of compute capability 8.0 or newer")
    return UpdatePrecision(Precision.fp32, "auto: not every actor GPU has compute capability 8.0")


def measured_choice(recipe: Recipe, cache_dir: Path, load_policy: Callable[[], PreTrainedModel]) -> UpdatePrecision:
    """The cached (or now measured) seconds of both precisions on this machine and model, and the faster one."""
    with torch_threads(recipe.workers.threads_per_worker):  # as each worker runs the update
        key = measurement_key(recipe, torch.device("cpu"))

        def measure() -> dict:
            return {"seconds": measure_update_seconds(load_policy(), recipe.actor)}

        record, path = cached_record(cache_dir, CACHE_FOLDER, key, measure, valid_record)
        seconds = record["seconds"]
    where = f"cached in {path}" if path is not None else "not cached"
    return UpdatePrecision(faster_precision(seconds), f"auto: measured on this machine, {where}", seconds)


def valid_record(record: dict) -> bool:
    """Whether a stored record holds a finite positive time for each precision (tlt_cli/tuning/cache.py)."""
    return positive_figures(record.get("seconds"), RESOLVED_PRECISIONS)


def faster_precision(seconds: dict[str, float]) -> Precision:
    """bf16 if it measured at least MARGIN faster than fp32, else fp32."""
    return Precision.bf16 if seconds[Precision.bf16] < (1 - MARGIN) * seconds[Precision.fp32] else Precision.fp32


def decided(seconds: dict[str, float]) -> bool:
    """Whether bf16's best time so far is so far from (1 - MARGIN) of fp32's, at least CLEAR_GAP of it either way,
    that another round of timing would not change the choice (faster_precision)."""
    share = seconds[Precision.bf16] / seconds[Precision.fp32]
    return abs(share - (1 - MARGIN)) >= CLEAR_GAP


def measurement_key(recipe: Recipe, device: torch.device) -> dict:
    """What the measurement depends on: this machine, the model's parameter shapes, the micro-batch's shape."""
    return {
        "format": MEASUREMENT_FORMAT,
        **machine_key(device),
        "model": asdict(model_shape(recipe)),
        "micro_batch_size": recipe.actor.micro_batch_size,
        "micro_batch_tokens": recipe.actor.micro_batch_tokens,
        "share_prompt": recipe.actor.share_prompt,
        "tokens": MEASURED_TOKENS,
        "gradient_checkpointing": recipe.actor.gradient_checkpointing,
        "bfloat16_rounding": recipe.actor.bfloat16_rounding.value,
        "rounds": ROUNDS,
    }


def measure_update_seconds(policy: PreTrainedModel, config: ActorConfig, rounds: int = ROUNDS) -> dict[str, float]:
    """Best seconds of one micro-batch's forward + backward in each precision, interleaved, over at most `rounds`
    rounds, fewer once one decides (module docstring)."""
    if config.gradient_checkpointing:
        enable_recomputation(policy)
    policy.train()
    packed = packs_micro_batches(config.micro_batch_tokens, policy.config)
    vocab_size = policy.config.vocab_size
    if packed:
        batch = measured_packed_micro_batch(vocab_size, config.micro_batch_tokens, config.share_prompt)
    else:
        batch = measured_micro_batch(vocab_size, config.micro_batch_size, MEASURED_TOKENS)
    # bf16 as the actor runs it: with its rounded copies, cast in the warm-up round (an update casts once for
    # all its micro-batches), or autocast's per-use casts
    rounded = None
    if config.bfloat16_rounding == Bfloat16Rounding.stochastic:
        rounded = RoundedLinearWeights(policy, skip={policy.get_output_embeddings()})
    best = dict.fromkeys(RESOLVED_PRECISIONS, float("inf"))
    for round_index in range(rounds + 1):  # round 0 warms each precision up and does not count
        order = RESOLVED_PRECISIONS if round_index % 2 == 0 else RESOLVED_PRECISIONS[::-1]
        for precision in order:
            copies = rounded.active() if rounded is not None and precision == Precision.bf16 else nullcontext()
            with copies:
                seconds = _forward_backward_seconds(policy, batch, replace(config, precision=precision), packed)
            if round_index > 0:
                best[precision] = min(best[precision], seconds)
        if round_index > 0 and decided(best):
            break
    policy.zero_grad(set_to_none=True)
    return {precision: round(value, 4) for precision, value in best.items()}


def measured_micro_batch(vocab_size: int, sequences: int, tokens: int) -> PolicyBatch:
    """`sequences` rows of `tokens` random tokens, the first MEASURED_PROMPT_TOKENS a prompt, the rest a response."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab_size, (sequences, tokens), generator=generator)
    response_mask = torch.zeros(sequences, tokens)
    response_mask[:, MEASURED_PROMPT_TOKENS:] = 1.0
    return PolicyBatch(
        input_ids=input_ids,
        attention_mask=torch.ones(sequences, tokens, dtype=torch.long),
        response_mask=response_mask,
        advantages=torch.randn(sequences, generator=generator),
    )


def measured_packed_micro_batch(vocab_size: int, micro_batch_tokens: int, share_prompt: bool) -> PolicyBatch:
    """Whole groups of MEASURED_GROUP_SIZE random sequences of MEASURED_TOKENS tokens, the first
    MEASURED_PROMPT_TOKENS of a group's sequences one shared prompt: as many groups as fit `micro_batch_tokens`
    packed (each prompt once with share_prompt), at least one, as the actor packs a micro-batch."""
    response_tokens = MEASURED_TOKENS - MEASURED_PROMPT_TOKENS
    packed_group = (
        MEASURED_PROMPT_TOKENS + MEASURED_GROUP_SIZE * response_tokens
        if share_prompt
        else MEASURED_GROUP_SIZE * MEASURED_TOKENS
    )
    groups = max(1, micro_batch_tokens // packed_group)
    batch = measured_micro_batch(vocab_size, groups * MEASURED_GROUP_SIZE, MEASURED_TOKENS)
    group_ids = torch.arange(groups).repeat_interleave(MEASURED_GROUP_SIZE)
    prompts = batch.input_ids[::MEASURED_GROUP_SIZE, :MEASURED_PROMPT_TOKENS]
    batch.input_ids[:, :MEASURED_PROMPT_TOKENS] = prompts.repeat_interleave(MEASURED_GROUP_SIZE, dim=0)
    return replace(batch, group_ids=group_ids)


def _forward_backward_seconds(policy: PreTrainedModel, batch: PolicyBatch, config: ActorConfig, packed: bool) -> float:
    """CPU seconds of the actor's single-pass micro-batch: forward in config.precision, the GRPO loss, backward;
    packed: over its packed layout, attending by segments in forward and in backward's recomputation. Process time
    (tuning/timing.py `milliseconds`, the dtype probe's clock): the time this process waited for a core on a loaded
    machine does not count."""

    def run() -> None:
        with packed_attention(policy) if packed else nullcontext():
            _forward_backward(policy, batch, config, packed)
        policy.zero_grad(set_to_none=True)

    return milliseconds(run, 1) / 1e3


def _forward_backward(policy: PreTrainedModel, batch: PolicyBatch, config: ActorConfig, packed: bool) -> None:
    """The actor's forward in config.precision (packed or padded rows), the GRPO loss and its backward."""
    with update_autocast(config.precision, batch.input_ids.device):
        if packed:
            _, logprobs = packed_forward_logprobs(policy, batch, config.share_prompt)
        else:
            _, logprobs = forward_logprobs(policy, batch)
    loss = policy_loss(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        advantages=batch.advantages,
        response_mask=batch.response_mask,
        clip_ratio=config.clip_ratio,
        total_response_tokens=batch.response_token_count,
    ).loss
    loss.backward()
