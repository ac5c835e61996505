"""The drafter unrolled over its own predictions, as it drafts (training-time test).

While drafting (tlt_cli/speculative/drafter_proposer.py) the drafter's first step reads the target's
hidden state, and each later step reads the drafter's own prediction from one position back. Trained on
the target's states alone (depth 1), its second and later draft tokens see inputs it never trained on,
and their acceptance falls with depth. `unrolled_outputs` runs the drafter `depths` times over a whole
DrafterBatch, as EAGLE-3 and HASS train it, so every depth trains on what it reads while drafting:

  entry e_d[t] (depth d, position t) reads (token[t+1], h_{d-1}[t-1]), where h_0 = the target's hidden
  states and h_{d-1}[t-1] is the prediction of its parent e_{d-1}[t-1] in the chain; it attends to what
  the chain rooted at r = t-d+1 sees while drafting: depth 1's entries e_1[0..r] (committed positions,
  read from the target) and the chain's own entries e_k[r+k-1] for 2 <= k <= d.

Every depth predicts the same things at the same position as depth 1 (h[t+1] and the token at t+2), so
`drafter_loss` compares each depth with the same targets; a depth-d position counts where its chain's
root counts too. The drafter trainer weighs the depths' losses and evaluation reports each depth's
acceptance (tlt_cli/drafter/trainer.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from tlt_cli.drafter.model import DrafterOutput, EagleDrafter


def unrolled_attention_mask(valid_mask: torch.Tensor, depth: int) -> torch.Tensor:
    """[B,1,T,depth*T] bool, True = attend: depth `depth`'s queries over the keys of depths 1..depth, in
    that order (valid_mask: [B,T], a key of depth 1 counts only where it is valid); see the module docstring.
    Every query sees its own entry (k = depth, j = t), so no row is empty."""
    length = valid_mask.shape[1]
    query = torch.arange(length, device=valid_mask.device)[:, None]
    key = torch.arange(length, device=valid_mask.device)[None, :]
    root = query - depth + 1
    committed = (key <= root)[None] & valid_mask[:, None, :]
    chain = [(key == root + k - 1)[None].expand_as(committed) for k in range(2, depth + 1)]
    return torch.cat((committed, *chain), dim=-1)[:, None]


def unrolled_loss_mask(loss_mask: torch.Tensor, depth: int) -> torch.Tensor:
    """[B,T] bool: depth `depth`'s position t counts where t and its chain's root t-depth+1 both count."""
    root_counts = torch.zeros_like(loss_mask)
    root_counts[:, depth - 1 :] = loss_mask[:, : loss_mask.shape[1] - depth + 1]
    return loss_mask & root_counts


def from_parent(hidden: torch.Tensor) -> torch.Tensor:
    """[B,T,H] -> [B,T,H]: entry t's input state, its parent's prediction at t-1 (zero at t = 0)."""
    return torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)


def unrolled_outputs(
    drafter: EagleDrafter,
    input_ids: torch.Tensor,
    target_hidden: torch.Tensor,
    position_ids: torch.Tensor,
    valid_mask: torch.Tensor,
    first_mask: torch.Tensor,
    depths: int,
) -> list[DrafterOutput]:
    """The drafter's outputs at depths 1..`depths` over one batch (the module docstring's entries): depth 1
    reads the target's states under `first_mask` [B,1,T,T]; each later depth its parent's predictions,
    attending through one cache of every depth's keys. input_ids, position_ids, valid_mask: [B,T];
    target_hidden: [B,T,H]."""
    cache = DynamicCache() if depths > 1 else None
    outputs = [drafter(input_ids, target_hidden, position_ids, first_mask, cache)]
    for depth in range(2, depths + 1):
        mask = unrolled_attention_mask(valid_mask, depth)
        outputs.append(drafter(input_ids, from_parent(outputs[-1].hidden), position_ids, mask, cache))
    return outputs
