"""The drafter's training loss (EAGLE): hidden-state regression plus soft next-token cross-entropy.

`drafter_loss` compares a `DrafterOutput` with the target's own next hidden state and logits at
the same positions: SmoothL1(predicted hidden, target_hidden[t+1]) with weight 1.0, plus the soft
cross-entropy -sum_v softmax(target_logits)_v * log_softmax(drafter_logits)_v with weight 0.1.
Only positions in `loss_mask` (response tokens) count. The drafter trainer and the warm-up call it;
its top-1 accuracy (drafter argmax == target argmax) is the greedy acceptance rate at depth 1.

With a reduced draft vocabulary of N tokens (tlt_cli/drafter/vocabulary.py) the drafter's logits
cover those N tokens, and the soft cross-entropy's target is the target distribution restricted to
them and renormalised, softmax(target_logits[kept]), as EAGLE-3 trains its draft head: only the
N kept rows of lm_head are ever computed. Accuracy compares the drafter's argmax, mapped to a
target id, with the target's next token: its argmax over the whole vocabulary when the caller
gives it (evaluation; a target token outside the draft vocabulary is then a miss), else its argmax
over the draft tokens (training steps, where the full head is not computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tlt_cli.drafter.model import DrafterOutput
from tlt_cli.drafter.vocabulary import DraftVocabulary

HIDDEN_LOSS_WEIGHT = 1.0
TOKEN_LOSS_WEIGHT = 0.1


@dataclass
class DrafterLoss:
    """total = 1.0 * hidden_loss + 0.1 * token_loss (scalars, means over counted tokens).

    accuracy: fraction of counted tokens where the drafter's argmax equals the target's argmax;
    token_count: how many tokens were counted; step_skipped: set by the trainer when it refused
    to apply this step (non-finite loss or gradient).
    """

    total: torch.Tensor
    hidden_loss: torch.Tensor
    token_loss: torch.Tensor
    accuracy: torch.Tensor
    token_count: int
    step_skipped: bool = False

    @property
    def is_finite(self) -> bool:
        return bool(torch.isfinite(self.total))

    def detached(self) -> DrafterLoss:
        return DrafterLoss(
            total=self.total.detach(),
            hidden_loss=self.hidden_loss.detach(),
            token_loss=self.token_loss.detach(),
            accuracy=self.accuracy.detach(),
            token_count=self.token_count,
            step_skipped=self.step_skipped,
        )


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
) -> DrafterLoss:
    """Loss of a drafter forward against the target.

    output.hidden / target_hidden_next: [B,T,H]; output.logits / target_logits_next: [B,T,N] over
    the draft tokens; loss_mask: [B,T] bool, true where the position counts (response tokens);
    vocabulary: the drafter's (None: the full vocabulary, N = V); target_tokens_next: [B,T] the
    target's next token ids for the accuracy (None: the argmax of target_logits_next).
    """
    loss_mask = loss_mask.bool()
    target_hidden_next = target_hidden_next.detach().float()
    target_logits_next = target_logits_next.detach().float()
    vocabulary = vocabulary or DraftVocabulary.full(output.logits.shape[-1])
    # SmoothL1 per element, averaged over the hidden dimension: [B,T]
    hidden_loss_per_token = F.smooth_l1_loss(output.hidden.float(), target_hidden_next, reduction="none").mean(-1)
    # the target distribution over the draft tokens (restricted to them, renormalised)
    target_probs = torch.softmax(target_logits_next, dim=-1)
    drafter_log_probs = torch.log_softmax(output.logits.float(), dim=-1)
    # soft cross-entropy: -sum_v p_target(v) * log q_drafter(v), per position [B,T]
    token_loss_per_token = -(target_probs * drafter_log_probs).sum(-1)
    hidden_loss = masked_mean(hidden_loss_per_token, loss_mask)
    token_loss = masked_mean(token_loss_per_token, loss_mask)
    with torch.no_grad():
        if target_tokens_next is None:
            target_tokens_next = vocabulary.to_target_ids(target_logits_next.argmax(-1))
        top1_agrees = vocabulary.to_target_ids(output.logits.argmax(-1)) == target_tokens_next
        accuracy = masked_mean(top1_agrees.float(), loss_mask)
    return DrafterLoss(
        total=HIDDEN_LOSS_WEIGHT * hidden_loss + TOKEN_LOSS_WEIGHT * token_loss,
        hidden_loss=hidden_loss,
        token_loss=token_loss,
        accuracy=accuracy,
        token_count=int(loss_mask.sum()),
    )
