"""TRL's GRPOTrainer as `tlt train` runs it: each generation batch timed, and the rollout/learner mismatch measured
and corrected.

`TimedGRPOTrainer` is `trl.GRPOTrainer` with three methods wrapped: each generation batch gets a
`GenerationTimes` with
  start       generation begins (`_generate`: the rollout_func, or TRL's own generation);
  busy_end    this process's completions are done (TRL's own generation: `_generate_single_turn`
              returned; tlt's rollout reports its own, tlt_cli/integrations/trl.py);
  idle_end    `_generate` returned: TRL's first gather after generation waited for every process;
  scored_end  `_generate_and_score_completions` returned: rewards, advantages and any
              reference/old log-prob forwards done.
What follows until the optimizer step (the loss forward/backward per micro-batch and the step
itself) is the update. tlt_cli/integrations/trl_run.py reads them with `take_generations()`.

The mismatch (tlt_cli/training/rollout_correction.py, as the native loop): when the rollout returned log-probs
(tlt's rollout does; TRL's own generation is the learner itself and returns none), the learner's log-probs of the
batch (TRL's `old_per_token_logps`, computed by one no-grad forward when TRL has not) and the rollout's give the
step's `mismatch` (K3 KL, the importance weights' mean / min / max / truncated share), and, unless
`vllm_importance_sampling_correction` is off (the recipe's actor.rollout_correction), the truncated weights
min(pi_old / pi_rollout, cap) of the recipe's mode. TRL 1.16 multiplies its loss by such weights only when vLLM
generates; here they go into the advantages, per token: every TRL loss but vespo is -w * f(ratio, A) with f
keeping the sign of A, so A_t = w_t * A is the same loss (the KL term is added unweighted, as in the native loss).
Only a TRL process imports this module (it imports TRL).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing

from tlt_cli.training.rollout_correction import MismatchTotals, importance_weights
from tlt_cli.training.rounded_compute import RoundedLinearWeights

# TRL's vllm_importance_sampling_mode (as tlt_cli/integrations/trl_recipe.py sets it) -> tlt's correction mode
CORRECTION_MODES = {"token_truncate": "token", "sequence_truncate": "sequence"}
# TRL losses whose per-token loss is -w * f(ratio, A), f keeping A's sign: weights fold into the advantages
WEIGHTED_LOSSES = frozenset({"grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo"})


@dataclass
class GenerationTimes:
    """One generation batch in this process (time.time() seconds; see the module docstring)."""

    start: float
    busy_end: float | None = None
    idle_end: float = 0.0
    scored_end: float = 0.0
    prompt_lengths: list[int] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    # the rollout/learner mismatch (MismatchTotals.metrics; empty when the rollout returned no log-probs)
    mismatch: dict[str, float] = field(default_factory=dict)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer recording a `GenerationTimes` per generation batch, correcting the rollout/learner mismatch."""

    # tlt's rollout reads it (tlt_cli/integrations/trl.py): this trainer reaches its loss, so a bfloat16 rollout
    # may be chosen
    corrects_rollout_mismatch = True

    def __init__(self, *arguments: Any, stochastic_rounding: bool = True, **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        self.generations: list[GenerationTimes] = []
        # bfloat16 autocast on CPU: the policy's linear layers compute with the rollout's rounded copies
        # (tlt_cli/training/rounded_compute.py) in every log-prob forward and the backward that recomputes them
        self.rounded = None
        if stochastic_rounding and self.args.bf16 and self.accelerator.device.type == "cpu":
            self.rounded = RoundedLinearWeights(self.accelerator.unwrap_model(self.model), skip=set())

    def _rounded_copies(self) -> contextlib.AbstractContextManager:
        return self.rounded.active() if self.rounded is not None else contextlib.nullcontext()

    def training_step(self, *arguments: Any, **keywords: Any) -> torch.Tensor:
        with self._rounded_copies():
            return super().training_step(*arguments, **keywords)

    def _get_per_token_logps_and_entropies(self, *arguments: Any, **keywords: Any) -> tuple:
        with self._rounded_copies():
            return super()._get_per_token_logps_and_entropies(*arguments, **keywords)

    def take_generations(self) -> list[GenerationTimes]:
        """The generation batches since the last call, oldest first."""
        generations, self.generations = self.generations, []
        return generations

    def _generate(self, prompts: list) -> tuple:
        times = GenerationTimes(start=time.time())
        self.generations.append(times)
        result = super()._generate(prompts)
        times.idle_end = time.time()
        times.prompt_lengths = [len(ids) for ids in result[0]]
        times.completion_ids = [list(ids) for ids in result[1]]
        return result

    def _generate_single_turn(self, *arguments: Any, **keywords: Any) -> tuple:
        result = super()._generate_single_turn(*arguments, **keywords)
        self.generations[-1].busy_end = time.time()
        return result

    def _generate_and_score_completions(self, inputs: list) -> dict:
        output = super()._generate_and_score_completions(inputs)
        rollout_logprobs = output.get("sampling_per_token_logps")
        if rollout_logprobs is not None and not self.use_vllm:
            self.generations[-1].mismatch = self._correct_mismatch(output, rollout_logprobs)
        self.generations[-1].scored_end = time.time()
        return output

    def _correct_mismatch(self, output: dict, rollout_logprobs: torch.Tensor) -> dict[str, float]:
        """Measure the batch's mismatch and fold the truncated weights into its advantages (module docstring)."""
        mask = output["completion_mask"]
        old_logprobs = output.get("old_per_token_logps")
        if old_logprobs is None:
            old_logprobs = self._learner_logprobs(output)
        mode = CORRECTION_MODES[self.vllm_importance_sampling_mode]
        cap = self.vllm_importance_sampling_clip_max
        totals = MismatchTotals(mode, cap)
        totals.add(old_logprobs, rollout_logprobs, mask)
        if self.vllm_importance_sampling_correction and self.loss_type in WEIGHTED_LOSSES:
            weights = importance_weights(old_logprobs, rollout_logprobs, mask, mode, cap)
            output["advantages"] = output["advantages"].reshape(-1, 1) * weights
        return totals.metrics()

    def _learner_logprobs(self, output: dict) -> torch.Tensor:
        """[B, T] the learner's log-probs of the completions (TRL's definition, at its temperature), no grad."""
        completion_ids = output["completion_ids"]
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            logprobs, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                torch.cat([output["prompt_ids"], completion_ids], dim=1),
                torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1),
                completion_ids.size(1),
                batch_size=self.args.per_device_train_batch_size,
            )
        return logprobs
