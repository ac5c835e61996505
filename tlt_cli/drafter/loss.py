"""The drafter's training loss: hidden-state regression plus a next-token term matched to acceptance.

`drafter_loss` compares a `DrafterOutput` with the target's own next hidden state and logits at
the same positions: SmoothL1(predicted hidden, target_hidden[t+1]) with weight 1.0, plus the token
terms of a `DrafterObjective` over the two distributions at the run's sampling temperature T,
p = softmax(target_logits / T) and q = softmax(drafter_logits / T):
  - soft cross-entropy -sum_v p_v log q_v (EAGLE's term, which EAGLE computes at T = 1, weight 0.1);
  - total variation 1 - sum_v min(p_v, q_v): lossless sampling accepts a draft token with probability
    min(1, p/q), so sum_v min(p_v, q_v) is the chance a sampled draft token is accepted, and this term
    is one minus it (DistillSpec's observation: train the quantity verification rewards).
`EAGLE_OBJECTIVE` is the paper's loss; `acceptance_objective(T)` the default, matched to sampling at T.
An objective also says over how many draft depths the drafter trains (`depths`, tlt_cli/drafter/unrolled.py):
`combined_loss` weighs depth d's loss by DEPTH_WEIGHT_DECAY ** (d - 1), as EAGLE-3 weighs its steps.
Only positions in `loss_mask` (response tokens) count. The drafter trainer and the warm-up call it;
its top-1 accuracy (drafter argmax == target argmax) is the greedy acceptance rate at depth 1, and its
`acceptance` (sum_v min(p_v, q_v)) the sampled one at T.

With a reduced draft vocabulary of N tokens (tlt_cli/drafter/vocabulary.py) the drafter's logits
cover those N tokens, and the soft cross-entropy's target is the target distribution restricted to
them and renormalised, softmax(target_logits[kept]), as EAGLE-3 trains its draft head: only the
N kept rows of lm_head are ever computed. Accuracy compares the drafter's argmax, mapped to a
target id, with the target's next token: its argmax over the whole vocabulary when the caller
gives it (evaluation; a target token outside the draft vocabulary is then a miss), else its argmax
over the draft tokens (training steps, where the full head is not computed).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt_cli.drafter.model import DrafterOutput
from tlt_cli.drafter.vocabulary import DraftVocabulary

HIDDEN_LOSS_WEIGHT = 1.0


@dataclass(frozen=True)
class DrafterObjective:
    """What the drafter trains for: the next-token terms (both distributions at `temperature`, the soft
    cross-entropy weighted `cross_entropy_weight`, the total variation `total_variation_weight`; module
    docstring) at each of `depths` draft depths (1: the target's states only)."""

    temperature: float = 1.0
    cross_entropy_weight: float = 0.1
    total_variation_weight: float = 0.0
    depths: int = 1


# EAGLE's loss: soft cross-entropy at T = 1, weight 0.1, no acceptance term
EAGLE_OBJECTIVE = DrafterObjective()
# the acceptance objective's weights, chosen, not tuned: on SmolLM2-135M at T=0.7 it matched EAGLE's loss (38.7% vs
# 39.0% held-out acceptance after 300 steps; BENCHMARKS.md, "A drafter that pays at T=0.7"); on a peaked tiny target
# it trained faster (tests/test_drafter_library.py)
ACCEPTANCE_CROSS_ENTROPY_WEIGHT = 1.0
ACCEPTANCE_TOTAL_VARIATION_WEIGHT = 1.0
# depth d's share of the unrolled loss, relative to depth 1's (EAGLE-3's 0.8 per step)
DEPTH_WEIGHT_DECAY = 0.8


def objective_named(kind: str, temperature: float, depths: int = 1) -> DrafterObjective:
    """drafter.loss's objective for a rollout sampled at `temperature`: "eagle" or "acceptance", trained over
    `depths` draft depths (drafter.train_depths)."""
    objective = EAGLE_OBJECTIVE if kind == "eagle" else acceptance_objective(temperature)
    return dataclasses.replace(objective, depths=depths)


def acceptance_objective(temperature: float, depths: int = 1) -> DrafterObjective:
    """The token terms matched to lossless sampling at `temperature` (greedy runs: 1.0, whose argmax is the same)."""
    return DrafterObjective(
        temperature=temperature if temperature > 0 else 1.0,
        cross_entropy_weight=ACCEPTANCE_CROSS_ENTROPY_WEIGHT,
        total_variation_weight=ACCEPTANCE_TOTAL_VARIATION_WEIGHT,
        depths=depths,
    )


@dataclass
class DrafterLoss:
    """total = 1.0 * hidden_loss + the objective's weighted token_loss and total_variation (scalars, means over
    counted tokens; token_loss is the soft cross-entropy at the objective's temperature).

    acceptance: mean sum_v min(p_v, q_v), the chance a token sampled from the drafter at the objective's
    temperature is accepted (1 - total_variation); accuracy: fraction of counted tokens where the drafter's
    argmax equals the target's argmax;
    token_count: how many tokens were counted; step_skipped: set by the trainer when it refused
    to apply this step (non-finite loss or gradient); later_depths: the losses of draft depths 2, 3, ... of an
    unrolled forward (`combined_loss`: then total weighs every depth, and the other fields are depth 1's).
    """

    total: torch.Tensor
    hidden_loss: torch.Tensor
    token_loss: torch.Tensor
    total_variation: torch.Tensor
    accuracy: torch.Tensor
    token_count: int
    step_skipped: bool = False
    later_depths: tuple[DrafterLoss, ...] = ()

    @property
    def acceptance(self) -> torch.Tensor:
        return 1.0 - self.total_variation

    @property
    def by_depth(self) -> tuple[DrafterLoss, ...]:
        """Depth 1's loss (this one's own fields), then each later depth's."""
        return (self, *self.later_depths)

    @property
    def is_finite(self) -> bool:
        return bool(torch.isfinite(self.total))

    def detached(self) -> DrafterLoss:
        return DrafterLoss(
            total=self.total.detach(),
            hidden_loss=self.hidden_loss.detach(),
            token_loss=self.token_loss.detach(),
            total_variation=self.total_variation.detach(),
            accuracy=self.accuracy.detach(),
            token_count=self.token_count,
            step_skipped=self.step_skipped,
            later_depths=tuple(loss.detached() for loss in self.later_depths),
        )


def combined_loss(losses: list[DrafterLoss]) -> DrafterLoss:
    """One DrafterLoss of an unrolled forward's per-depth losses (depth 1 first): its total is their mean
    weighted DEPTH_WEIGHT_DECAY ** (d - 1), its other fields are depth 1's, and later_depths holds the rest."""
    if len(losses) == 1:
        return losses[0]
    weights = [DEPTH_WEIGHT_DECAY**depth for depth in range(len(losses))]
    total = sum(weight * loss.total for weight, loss in zip(weights, losses, strict=True)) / sum(weights)
    return dataclasses.replace(losses[0], total=total, later_depths=tuple(losses[1:]))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of values [B,T] over positions where mask [B,T] is true (0 when none is).

    Uses `where`, not a product, so a non-finite value at an uncounted (padding) position is ignored.
    """
    counted = torch.where(mask, values, torch.zeros_like(values))
    return counted.sum() / mask.sum().clamp(min=1).to(values.dtype)


def drafter_loss(
    output: DrafterOutput,
    target_hidden_next: torch.Tensor,
    target_logits_next: torch.Tensor,
    loss_mask: torch.Tensor,
    vocabulary: DraftVocabulary | None = None,
    target_tokens_next: torch.Tensor | None = None,
    objective: DrafterObjective = EAGLE_OBJECTIVE,
    target_log_normalizer: torch.Tensor | None = None,
) -> DrafterLoss:
    """Loss of a drafter forward against the target.

    output.hidden / target_hidden_next: [B,T,H]; output.logits / target_logits_next: [B,T,N] over
    the draft tokens; loss_mask: [B,T] bool, true where the position counts (response tokens);
    vocabulary: the drafter's (None: the full vocabulary, N = V); target_tokens_next: [B,T] the
    target's next token ids for the accuracy (None: the argmax of target_logits_next); objective: the token terms;
    target_log_normalizer: [B,T] logsumexp over the whole vocabulary of target_logits / T (evaluation), so p is the
    target's true distribution on the draft tokens, not renormalised over them (None: renormalised, as training is).
    """
    loss_mask = loss_mask.bool()
    target_hidden_next = target_hidden_next.detach().float()
    target_logits_next = target_logits_next.detach().float()
    vocabulary = vocabulary or DraftVocabulary.full(output.logits.shape[-1])
    # SmoothL1 per element, averaged over the hidden dimension: [B,T]
    hidden_loss_per_token = F.smooth_l1_loss(output.hidden.float(), target_hidden_next, reduction="none").mean(-1)
    # both distributions at the sampling temperature; the target's over the draft tokens (restricted to them,
    # renormalised unless the whole vocabulary's normaliser is given)
    tempered_target = target_logits_next / objective.temperature
    if target_log_normalizer is None:
        target_probs = torch.softmax(tempered_target, dim=-1)
    else:
        target_probs = torch.exp(tempered_target - target_log_normalizer[..., None])
    drafter_log_probs = torch.log_softmax(output.logits.float() / objective.temperature, dim=-1)
    # soft cross-entropy: -sum_v p_target(v) * log q_drafter(v), per position [B,T]
    token_loss_per_token = -(target_probs * drafter_log_probs).sum(-1)
    # total variation: 1 - sum_v min(p_v, q_v), one minus the chance a sampled draft token is accepted
    total_variation_per_token = 1.0 - torch.minimum(target_probs, drafter_log_probs.exp()).sum(-1)
    hidden_loss = masked_mean(hidden_loss_per_token, loss_mask)
    token_loss = masked_mean(token_loss_per_token, loss_mask)
    total_variation = masked_mean(total_variation_per_token, loss_mask)
    with torch.no_grad():
        if target_tokens_next is None:
            target_tokens_next = vocabulary.to_target_ids(target_logits_next.argmax(-1))
        top1_agrees = vocabulary.to_target_ids(output.logits.argmax(-1)) == target_tokens_next
        accuracy = masked_mean(top1_agrees.float(), loss_mask)
    return DrafterLoss(
        total=HIDDEN_LOSS_WEIGHT * hidden_loss
        + objective.cross_entropy_weight * token_loss
        + objective.total_variation_weight * total_variation,
        hidden_loss=hidden_loss,
        token_loss=token_loss,
        total_variation=total_variation,
        accuracy=accuracy,
        token_count=int(loss_mask.sum()),
    )
