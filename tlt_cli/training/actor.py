"""The policy as a DeepSpeed engine: log-prob recomputation and the GRPO update.

Each worker process builds one `Actor` around its copy of the policy. The rollout engine uses
`actor.policy` (the very module DeepSpeed trains, no copy), so after `update` the next rollout
samples from the new weights. ZeRO stages 0-2 keep full parameters on every rank, which is what
the embedded rollout engine (and the SGLang weight sync) needs. DeepSpeed moves the policy to the
rank's device (`cuda:<local rank>` on GPUs); the reference model and every batch follow it.

`actor.precision: bf16` (`auto` is resolved before, tlt_cli/training/update_precision.py): on GPUs
DeepSpeed's bf16 mode casts the module to bfloat16 and keeps float32 master weights in its
optimizer. On CPU the module stays float32 (its own master weights; AdamW state float32) and every
forward runs under `torch.autocast(cpu, bfloat16)`, backward outside it: the embedded rollout
shares these weights and decodes in a dtype of its own (DeepSpeed's bf16 mode also runs on CPU and
measured as fast, with about 0.2 GB less at a worker's peak on SmolLM2-135M, but it would turn the
rollout's weights bfloat16 too: BENCHMARKS.md "The update in bfloat16"). The log-prob head runs in
float32 either way (logprobs.py). The caller must have initialised torch.distributed
(`tlt_cli.processes.distributed.init_worker_process`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from tlt_cli.checkpoint import CheckpointError, load_checkpoint_file, unloadable_checkpoint
from tlt_cli.config import CPU_DEVICES, ActorConfig, Bfloat16Rounding, Precision
from tlt_cli.errors import TrainingDiverged
from tlt_cli.processes.distributed import import_deepspeed
from tlt_cli.rollout.types import Completion
from tlt_cli.training.grpo import PolicyLoss, policy_loss
from tlt_cli.training.logprobs import token_logprobs
from tlt_cli.training.packed_forward import (
    attention_segments,
    micro_batch_count,
    packed_attention,
    packed_hidden,
    packed_micro_batches,
    packing_supported,
    packs_micro_batches,
)
from tlt_cli.training.policy_batch import PolicyBatch, build_policy_batch, micro_batches
from tlt_cli.training.rollout_correction import MismatchTotals, importance_weights, k3_total
from tlt_cli.training.rounded_compute import RoundedLinearWeights

ADAMW_BETAS = (0.9, 0.999)
# what `actor.precision` is once `auto` is resolved (tlt_cli/training/update_precision.py)
RESOLVED_PRECISIONS = (Precision.fp32, Precision.bf16)
CHECKPOINT_TAG = "actor"
# the file DeepSpeed writes the (ZeRO 0-2) module state into, under CHECKPOINT_TAG (`tlt export-drafter` reads it)
ACTOR_WEIGHTS_FILE = "mp_rank_00_model_states.pt"

# Called with (micro_batch, last_hidden_state [B,T,H]) during the log-prob pass.
HiddenStatesCallback = Callable[[PolicyBatch, torch.Tensor], None]


@dataclass(frozen=True)
class UpdateMetrics:
    """What one GRPO update did, averaged over its micro-batches and epochs; mismatch: the rollout/learner
    mismatch of its batch (rollout_correction.py's metrics, empty when the rollout gave no log-probs)."""

    loss: float
    clip_fraction: float
    kl: float
    ratio_mean: float
    grad_norm: float
    mismatch: dict[str, float] = field(default_factory=dict)
    # bfloat16 on CPU: K3 KL of the bfloat16 learner from its float32 master weights, on the first micro-batch
    precision_kl_k3: float | None = None

    def as_dict(self) -> dict[str, float]:
        """Every number under one flat name (the step record's actor_* fields)."""
        numbers = {item.name: getattr(self, item.name) for item in fields(self) if item.name != "mismatch"}
        return {**{name: value for name, value in numbers.items() if value is not None}, **self.mismatch}


class Actor:
    """A DeepSpeed engine around the policy; `update` runs ppo_epochs optimizer steps on a rollout."""

    def __init__(
        self,
        policy: PreTrainedModel,
        config: ActorConfig,
        sequences_per_update: int,
        reference: PreTrainedModel | None = None,
    ):
        if config.precision == Precision.auto:
            raise ValueError(f"the actor runs in fp32 or bf16, not '{config.precision}' (resolve auto first).")
        self.config = config
        self.packs = packs(config, policy.config)
        self.accumulation_steps = math.ceil(sequences_per_update / config.micro_batch_size)
        if config.gradient_checkpointing:
            enable_recomputation(policy)
        # fused: one pass over each tensor (on CPU too) instead of a dozen, each writing a temporary as large as
        # the weights: ZeRO 1-2 hand it one flat float32 partition of every weight. It equals torch's per-tensor
        # AdamW within float32 rounding (tests/test_actor.py), and is 5-9x faster on it (BENCHMARKS.md)
        optimizer = torch.optim.AdamW(
            policy.parameters(), lr=config.lr, betas=ADAMW_BETAS, weight_decay=config.weight_decay, fused=True
        )
        self.engine, _, _, _ = import_deepspeed().initialize(
            model=policy, optimizer=optimizer, config=deepspeed_config(config, self.accumulation_steps)
        )
        self.reference = reference.to(self.device, self.dtype) if reference is not None else None
        # bfloat16 on CPU: the policy's linear layers compute with the rollout's rounding (rounded_compute.py)
        self.rounded = None
        if (
            config.precision == Precision.bf16
            and self.device.type == "cpu"
            and config.bfloat16_rounding == Bfloat16Rounding.stochastic
        ):
            self.rounded = RoundedLinearWeights(policy, skip={policy.get_output_embeddings()})

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.policy.parameters()).dtype

    @property
    def policy(self) -> PreTrainedModel:
        """The trained module itself; rollout engines share these weights."""
        return self.engine.module

    @torch.no_grad()
    def logprobs(
        self, batch: PolicyBatch, on_hidden_states: HiddenStatesCallback | None = None, include_policy: bool = True
    ) -> PolicyBatch:
        """The batch with old (and, with a reference model, reference) log-probs recomputed by the actor."""
        old_parts, reference_parts = [], []
        self._forget_copies()
        for micro_batch in self.micro_batches(batch):
            if include_policy:
                with self.precision(rounded=True):
                    hidden, logprobs = self.forward_logprobs(self.policy, micro_batch)
                if on_hidden_states is not None:
                    on_hidden_states(micro_batch, hidden)
                old_parts.append(_pad_to(logprobs, batch))
            if self.reference is not None:
                with self.precision():
                    _, reference_logprobs = self.forward_logprobs(self.reference, micro_batch)
                reference_parts.append(_pad_to(reference_logprobs, batch))
        old = torch.cat(old_parts) if old_parts else None
        reference = torch.cat(reference_parts) if reference_parts else None
        return batch.with_logprobs(old, reference)

    def policy_batch(
        self, completions: list[Completion], advantages: torch.Tensor, pad_token_id: int, group_size: int
    ) -> PolicyBatch:
        """The completions as this actor's batch: by groups when it packs micro-batches (they take whole groups),
        else rows by length (policy_batch.py `build_policy_batch`)."""
        by_group = group_size if self.packs else None
        return build_policy_batch(completions, advantages, pad_token_id, by_group)

    def packed_segments(self, parts: list[PolicyBatch]) -> list[list[tuple[int, int]]] | None:
        """The (queries, keys) of each micro-batch's attention segments when the actor packs them
        (packed_forward.py `attention_segments`); None when it pads rows."""
        if not self.packs:
            return None
        return [attention_segments(part, self.config.share_prompt) for part in parts]

    def micro_batches(self, batch: PolicyBatch) -> list[PolicyBatch]:
        """The batch's micro-batches: packed whole groups up to actor.micro_batch_tokens (every rank the same count,
        as ZeRO 2 reduces gradients at each micro-batch), or micro_batch_size right-padded rows."""
        if not self.packs:
            return micro_batches(batch, self.config.micro_batch_size)
        share = self.config.share_prompt
        count = micro_batch_count(batch, self.config.micro_batch_tokens, share)
        return packed_micro_batches(batch, self.config.micro_batch_tokens, share, count=_agreed_count(count, batch))

    def forward_logprobs(self, model: PreTrainedModel, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_logprobs` over the micro-batch's packed layout (packed_forward.py) when the actor packs."""
        if not self.packs:
            return forward_logprobs(model, batch)
        return packed_forward_logprobs(model, batch, self.config.share_prompt)

    def precision(self, rounded: bool = False) -> contextlib.AbstractContextManager:
        """The context of the actor's forwards: bfloat16 autocast on CPU with `actor.precision: bf16`; rounded:
        the policy's forward, whose linear layers then use the rounded copies (rounded_compute.py)."""
        context = contextlib.ExitStack()
        if rounded:
            context.enter_context(self._rounded_copies())
        context.enter_context(update_autocast(self.config.precision, self.device))
        return context

    def _rounded_copies(self) -> contextlib.AbstractContextManager:
        """Where the policy's linear layers use their rounded bfloat16 copies (nothing without them)."""
        return self.rounded.active() if self.rounded is not None else contextlib.nullcontext()

    def _packed_attention(self) -> contextlib.AbstractContextManager:
        """Where packed micro-batches attend by segments (packed_forward.py); nothing when the actor pads rows."""
        return packed_attention(self.policy) if self.packs else contextlib.nullcontext()

    def _forget_copies(self) -> None:
        """The weights may have moved (or the update ended): drop the rounded copies."""
        if self.rounded is not None:
            self.rounded.forget()

    def update(self, batch: PolicyBatch, on_hidden_states: HiddenStatesCallback | None = None) -> UpdateMetrics:
        """ppo_epochs optimizer steps over the whole batch (one step = all its micro-batches).

        With one epoch the weights do not move until every micro-batch has been seen (gradients
        accumulate to one optimizer step), so the old log-probs are exactly the current ones,
        detached, from the training forward itself: one forward per micro-batch instead of two.
        With more epochs they are recomputed first, before any step.
        """
        batch = _to_device(batch, self.device)
        single_pass = self.config.ppo_epochs == 1
        if not single_pass or self.reference is not None:
            batch = self.logprobs(batch, on_hidden_states, include_policy=not single_pass)
        self.engine.train()
        totals = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "ratio_mean": 0.0, "grad_norm": 0.0}
        parts = self.micro_batches(batch)
        self._forget_copies()  # the weights moved since the last pass: the copies follow them
        precision_kl = self._precision_kl(parts[0])
        total_tokens = max(batch.response_token_count, 1)
        mismatch = MismatchTotals(self.config.rollout_correction, self.config.rollout_correction_cap)
        for epoch in range(self.config.ppo_epochs):
            if epoch > 0:
                self._forget_copies()  # one optimizer step an epoch: the copies follow it
            for index, micro_batch in enumerate(parts):
                # one optimizer step an epoch, after its last micro-batch (their count varies with packing)
                self.engine.set_gradient_accumulation_boundary(index == len(parts) - 1)
                result = self._micro_batch_loss(
                    micro_batch,
                    total_tokens,
                    on_hidden_states if single_pass else None,
                    mismatch if epoch == 0 else None,
                )
                loss = float(result.loss.detach())
                if not math.isfinite(loss):  # checked before the step, so the weights never take it
                    raise TrainingDiverged(f"the policy loss is {loss}")
                # the loss is already normalised over the whole batch: no extra 1/accumulation scaling
                # recomputation in backward runs the forward again: with the same copies and attention
                with self._rounded_copies(), self._packed_attention():
                    self.engine.backward(result.loss, scale_wrt_gas=False)
                self.engine.step()
                totals["loss"] += loss
                totals["clip_fraction"] += result.clip_fraction / len(parts)
                totals["kl"] += result.kl / len(parts)
                totals["ratio_mean"] += result.ratio_mean / len(parts)
            totals["grad_norm"] += float(self.engine.get_global_grad_norm() or 0.0)
        self._forget_copies()
        self.engine.eval()
        epochs = self.config.ppo_epochs
        return UpdateMetrics(
            **{name: value / epochs for name, value in totals.items()},
            mismatch=mismatch.metrics(),
            precision_kl_k3=precision_kl,
        )

    @torch.no_grad()
    def _precision_kl(self, micro_batch: PolicyBatch) -> float | None:
        """With bfloat16 compute on CPU: how far the learner's bfloat16 log-probs are from its float32 master
        weights' on one micro-batch (K3 KL per response token); None otherwise. A round-to-nearest copy jumps
        here after a small update (tlt_cli/engine/rounding.py), which the rollout/learner KL cannot show when
        both sides round alike."""
        if self.config.precision != Precision.bf16 or self.device.type != "cpu":
            return None
        with self.precision(rounded=True):
            _, learner = self.forward_logprobs(self.policy, micro_batch)
        _, master = self.forward_logprobs(self.policy, micro_batch)
        tokens = int(micro_batch.response_mask.sum())
        return k3_total(master, learner, micro_batch.response_mask) / tokens if tokens else None

    def _micro_batch_loss(
        self,
        micro_batch: PolicyBatch,
        total_tokens: int,
        on_hidden_states: HiddenStatesCallback | None,
        mismatch: MismatchTotals | None,
    ) -> PolicyLoss:
        """The micro-batch's loss; with the rollout's log-probs, weighted for the mismatch (counted into
        `mismatch` when given: the first epoch, before any step, when old log-probs are the rollout's pi_old)."""
        with self.precision(rounded=True):
            hidden, logprobs = self.forward_logprobs(self.policy, micro_batch)
        old_logprobs = micro_batch.old_logprobs
        if old_logprobs is None:  # single pass: the policy has not moved yet
            old_logprobs = logprobs.detach()
            if on_hidden_states is not None:
                on_hidden_states(micro_batch, hidden.detach())
        weights = None
        if micro_batch.rollout_logprobs is not None:
            if mismatch is not None:
                mismatch.add(old_logprobs, micro_batch.rollout_logprobs, micro_batch.response_mask)
            weights = importance_weights(
                old_logprobs,
                micro_batch.rollout_logprobs,
                micro_batch.response_mask,
                self.config.rollout_correction,
                self.config.rollout_correction_cap,
            )
        return policy_loss(
            logprobs=logprobs,
            old_logprobs=old_logprobs,
            advantages=micro_batch.advantages,
            response_mask=micro_batch.response_mask,
            clip_ratio=self.config.clip_ratio,
            total_response_tokens=total_tokens,
            ref_logprobs=micro_batch.ref_logprobs,
            kl_coef=self.config.kl_coef,
            importance_weights=weights,
        )

    def save(self, directory: Path) -> None:
        """Collective: every rank writes its part (weights, ZeRO optimizer shards) under directory."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        """Collective: restore weights and optimizer state saved by `save`, every file read weights-only."""
        if not isinstance(self.engine.checkpoint_engine, WeightsOnlyLoads):
            self.engine.checkpoint_engine = WeightsOnlyLoads(self.engine.checkpoint_engine)
        try:
            load_path, _ = self.engine.load_checkpoint(
                str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - an emptied shard, another model's shapes: one sentence
            raise CheckpointError(unloadable_checkpoint(directory, error)) from error
        if load_path is None:
            raise CheckpointError(unloadable_checkpoint(directory, FileNotFoundError("no actor weights in it")))


class WeightsOnlyLoads:
    """DeepSpeed's checkpoint engine with its `load` replaced by tlt's weights-only one (tlt_cli/checkpoint.py).

    DeepSpeed's TorchCheckpointEngine unpickles arbitrary objects (torch.load without weights-only), so
    a copied run directory could run code on --resume. A ZeRO 1-2 optimizer shard holds, besides
    tensors and plain data, the DeepSpeed classes named in `deepspeed_checkpoint_classes`; saving is DeepSpeed's own.
    """

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_checkpoint_file(Path(path), deepspeed_checkpoint_classes(), map_location)


def deepspeed_checkpoint_classes() -> tuple[type, ...]:
    """The DeepSpeed classes a ZeRO 1-2 optimizer shard pickles (as get_unsafe_globals_in_checkpoint lists them)."""
    import_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return (fragment_address, ZeroStageEnum, LossScaler, DynamicLossScaler)


def enable_recomputation(policy: PreTrainedModel) -> None:
    """Each decoder layer keeps only its input for backward and recomputes the rest there (non-reentrant
    checkpoints: no input needs requires_grad, and the last hidden state comes out as usual)."""
    settings = {"use_reentrant": False}
    if hasattr(policy, "activation_checkpointing_enable"):  # transformers 5.24's name; the old one warns there
        policy.activation_checkpointing_enable(activation_checkpointing_kwargs=settings)
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings)


def packs(config: ActorConfig, model_config) -> bool:
    """Whether the actor packs its micro-batches (packed_forward.py `packs_micro_batches`); when
    actor.micro_batch_tokens asks it to and the model cannot, one line says so and the update pads rows."""
    packed = packs_micro_batches(config.micro_batch_tokens, model_config)
    if config.micro_batch_tokens and not packed:
        print(
            f"actor: training right-padded rows of actor.micro_batch_size, not packed micro-batches: "
            f"{model_config.model_type} cannot pack ({packing_supported(model_config)})",
            flush=True,
        )
    return packed


def deepspeed_config(config: ActorConfig, accumulation_steps: int) -> dict:
    """The DeepSpeed config of the actor: ZeRO stage, clipping, micro-batching and precision from the recipe."""
    settings = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_clipping": config.grad_clip,
        "zero_optimization": {"stage": config.zero_stage},
        # a torch optimizer on CPU: do not let DeepSpeed swap in its compiled CPU Adam
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31,
    }
    if policy_dtype(config) == torch.bfloat16:
        # DeepSpeed casts the module to bfloat16 and keeps fp32 master weights in its optimizer wrapper
        settings["bf16"] = {"enabled": True}
    return settings


def policy_dtype(config: ActorConfig) -> torch.dtype:
    """The dtype of the trained module's weights: bfloat16 only under DeepSpeed's bf16 mode (bf16 on GPUs)."""
    return torch.bfloat16 if config.precision == Precision.bf16 and config.devices != CPU_DEVICES else torch.float32


def update_autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast for a CPU forward with precision bf16 (float32 weights stay the master copy); no change
    elsewhere (fp32, or GPUs, where DeepSpeed's bf16 mode made the module itself bfloat16)."""
    if precision == Precision.bf16 and device.type == "cpu":
        # no cache of the weights' bfloat16 copies: each is cast where it is used (a forward uses each once, and
        # recomputation drops what it saved), so a forward never holds a copy of every weight at once
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext()


def forward_logprobs(model: PreTrainedModel, batch: PolicyBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states [b,t,H] and the response tokens' float32 log-probs [b,t] (0 elsewhere)."""
    output = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    hidden = output.last_hidden_state
    return hidden, _response_logprobs(model, hidden, batch)


def packed_forward_logprobs(
    model: PreTrainedModel, batch: PolicyBatch, share_prompt: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward_logprobs` computed over the micro-batch's packed layout (packed_forward.py), each group's prompt
    once with `share_prompt`; call it where the model attends by segments (`packed_attention`)."""
    hidden = packed_hidden(model.get_decoder(), batch, share_prompt)
    return hidden, _response_logprobs(model, hidden, batch)


def _agreed_count(count: int, batch: PolicyBatch) -> int:
    """The micro-batch count every rank of the update runs: the largest any rank wants, at most the fewest groups
    any rank has."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return count
    wanted = torch.tensor([count, -len(batch.group_spans())], device=batch.input_ids.device)
    torch.distributed.all_reduce(wanted, op=torch.distributed.ReduceOp.MAX)
    return min(int(wanted[0]), -int(wanted[1]))


def _to_device(batch: PolicyBatch, device: torch.device) -> PolicyBatch:
    """The batch with every tensor on `device` (the same tensors when they are there already)."""
    moved = {item.name: getattr(batch, item.name) for item in fields(batch)}
    return replace(batch, **{name: tensor.to(device) for name, tensor in moved.items() if tensor is not None})


def _response_logprobs(model: PreTrainedModel, hidden: torch.Tensor, batch: PolicyBatch) -> torch.Tensor:
    """[b,t] log-probs of the response tokens from the decoder's hidden [b,t,H], 0 elsewhere, chunked over
    tokens through the model's head (logprobs.py): the loss only reads response tokens."""
    return token_logprobs(hidden, model.get_output_embeddings(), batch.input_ids, needed=batch.response_mask)


def _pad_to(values: torch.Tensor, batch: PolicyBatch) -> torch.Tensor:
    """Right-pad a micro-batch's [b,t] values to the full batch width T."""
    return torch.nn.functional.pad(values, (0, batch.input_ids.shape[1] - values.shape[1]), value=0.0)
