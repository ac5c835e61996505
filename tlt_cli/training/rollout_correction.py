"""The rollout/learner mismatch: measured per step, and corrected by truncated importance sampling.

The rollout samples from pi_rollout (the engine's decode model, maybe in bfloat16, or SGLang) while the
GRPO loss assumes the learner's old policy pi_old (the DeepSpeed actor in float32). Both log-probs of each
response token are at hand: the rollout's from its Completion (tlt_cli/engine/logprobs.py, the learner's
definition), the learner's from the actor's forward. The actor (actor.py) asks `importance_weights` for each
micro-batch's weights, which grpo.py's `policy_loss` multiplies into the surrogate, and adds the micro-batch to
a `MismatchTotals`, whose `metrics()` go into the step record (actor_rollout_*), the live table and
`tlt profile`. As verl's Rollout Correction (token-level truncated IS, threshold 2.0), with rejection of
outliers left out: truncation bounds every weight, and the truncated fraction shows when that bites.

  mode      weight of response token t of sequence i (detached)
  token     min(pi_old(t) / pi_rollout(t), cap)
  sequence  min(prod_t pi_old(t) / pi_rollout(t), cap), the same for every token of the sequence
  off       1 (the mismatch is still measured)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlt_cli.config import RolloutCorrection


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: RolloutCorrection,
    cap: float,
) -> torch.Tensor | None:
    """[B,T] detached truncated weights min(pi_old / pi_rollout, cap) by `mode` (module table); None for off.

    old_logprobs, rollout_logprobs, response_mask: [B,T]; entries outside the mask are 1."""
    if mode == RolloutCorrection.off:
        return None
    log_ratio = _log_ratios(old_logprobs, rollout_logprobs, response_mask, mode)
    # truncate in log space first: exp never overflows, whatever a sequence's summed log-ratio
    weights = torch.exp(log_ratio.clamp(max=math.log(cap))).float()
    return weights.expand_as(response_mask).detach()


@dataclass
class MismatchTotals:
    """Sums over the micro-batches of one update, for the step's mismatch metrics.

    k3: KL(pi_rollout || pi_old) estimated on the rollout's own samples, exp(x) - x - 1 with
    x = log pi_old - log pi_rollout, averaged over response tokens. The weights are the untruncated ratios
    pi_old / pi_rollout at the mode's grain (sequences for `sequence`, else tokens); truncated: the share
    above the cap.
    """

    mode: RolloutCorrection
    cap: float
    tokens: int = 0
    k3_sum: float = 0.0
    weights: int = 0
    weight_sum: float = 0.0
    weight_min: float = math.inf
    weight_max: float = -math.inf
    truncated: int = 0

    @torch.no_grad()
    def add(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor) -> None:
        """Count one micro-batch: [B,T] each."""
        self.k3_sum += k3_total(old_logprobs, rollout_logprobs, response_mask)
        mask = response_mask.bool()
        self.tokens += int(mask.sum())
        log_ratio = _log_ratios(old_logprobs.double(), rollout_logprobs.double(), response_mask, self.mode)
        ratios = torch.exp(log_ratio.flatten() if self.mode == RolloutCorrection.sequence else log_ratio[mask])
        if ratios.numel() == 0:
            return
        self.weights += ratios.numel()
        self.weight_sum += float(ratios.sum())
        self.weight_min = min(self.weight_min, float(ratios.min()))
        self.weight_max = max(self.weight_max, float(ratios.max()))
        self.truncated += int((ratios > self.cap).sum())

    def metrics(self) -> dict[str, float]:
        """rollout_kl_k3, rollout_weight_mean/_min/_max and rollout_weight_truncated (a share); empty when no
        response token was counted."""
        if self.tokens == 0 or self.weights == 0:
            return {}
        return {
            "rollout_kl_k3": self.k3_sum / self.tokens,
            "rollout_weight_mean": self.weight_sum / self.weights,
            "rollout_weight_min": self.weight_min,
            "rollout_weight_max": self.weight_max,
            "rollout_weight_truncated": self.truncated / self.weights,
        }


@torch.no_grad()
def k3_total(reference_logprobs: torch.Tensor, sampled_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """The K3 estimate of KL(sampled || reference), summed over the masked tokens ([B,T] each): the tokens were
    drawn from `sampled`; k3 = exp(x) - x - 1 >= 0 for x = log(reference / sampled), zero only where they agree."""
    token_log_ratio = (reference_logprobs.double() - sampled_logprobs.double())[mask.bool()]
    return float((torch.exp(token_log_ratio) - token_log_ratio - 1.0).sum())


def _log_ratios(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor, mode: RolloutCorrection
) -> torch.Tensor:
    """log(pi_old / pi_rollout) per token [B,T] (0 off the mask), or per sequence [B,1] for `sequence`."""
    log_ratio = (old_logprobs - rollout_logprobs) * response_mask
    return log_ratio.sum(dim=1, keepdim=True) if mode == RolloutCorrection.sequence else log_ratio
