"""Exact acceptance of drafted tokens against the target, batched, one verdict per row.

The speculative decoder calls `accept_chain` or `accept_tree` with the target's logits over the
verified block; both return a `Verdict`: how many drafted tokens each row keeps, the node path
they form, and the bonus token the target adds. Rows are independent (ragged acceptance).

Why this is lossless (the output has exactly the target's distribution under SamplingParams):
- Greedy: a drafted token is kept iff it equals the target's argmax, so the output is the
  target's greedy output.
- Chain with sampling (Leviathan et al. / Chen et al.): token x ~ q is kept with probability
  min(1, p(x)/q(x)); on rejection the replacement is drawn from norm(max(p - q, 0)). Then
  P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - sum_x min(p(x), q(x))) * max(p(y) - q(y), 0) / Z
  = min(p(y), q(y)) + max(p(y) - q(y), 0) = p(y), as Z = 1 - sum_x min(p(x), q(x)). After k
  kept tokens the bonus token is drawn from p at the next position.
- Tree with sampling: tree nodes are chosen deterministically from the drafter (top-k), so the
  proposal for each child c is a point mass delta_c. Multi-draft recursive rejection (SpecInfer)
  tries the children in order: child c is kept with probability min(1, p(c)/delta_c(c)) = p(c),
  and a rejection updates p <- norm(max(p - delta_c, 0)), i.e. p with c removed, renormalised.
  The first child is thus emitted with probability p(c1), the second with (1 - p(c1)) * p(c2) /
  (1 - p(c1)) = p(c2), and so on, and the fallback draw from the final residual emits every
  other token y with probability p(y), so each emitted token is one draw from the target's
  distribution given the tokens before it. `accept_tree` runs exactly this rule at every node
  with uniforms (child c kept iff u_c < p(c) / (1 - p(earlier siblings)) and no earlier sibling
  was), and draws only the bonus token from a whole distribution: the deepest kept node's p with
  its children removed, renormalised (a draw per row, as plain decoding makes, not per node).
- n-gram proposals (tlt_cli/speculative/ngram.py) are deterministic too: a point mass q = delta_x, so x
  is kept with probability p(x) and a rejection draws from norm(max(p - delta_x, 0)), p with x
  removed. A model-free chain and a hybrid tree (the drafter's top-k tree with the n-gram branch
  merged in where tokens coincide, so siblings stay distinct) are trees of point masses, verified
  by `accept_tree` like any tree: a drafter child and an n-gram child of one node are two
  candidates of the same multi-draft rejection, whichever source they came from. Padding nodes
  (tree.valid false) are no candidates at all: past a row's last proposal the bonus token is drawn
  from p itself.
- A sampled drafter chain with an n-gram branch (hybrid with topk 1): at a chain node the drafter's
  child x ~ q is tried first (kept with probability min(1, p(x)/q(x))); after its rejection the
  target's law there is the residual r = norm(max(p - q, 0)), so the n-gram child y comes second as
  a point mass on r (kept with probability r(y)), and the bonus is drawn from r without y. Where y
  equals x the two are one node: after x's rejection r(x) = 0, so a second try could never keep it.
  Elsewhere r is p itself (no drafter child), and `accept_tree` runs the same rule everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_cli.engine.sampling import SamplingParams, apply_sampling, sample
from tlt_cli.speculative.tree import DraftTree


@dataclass
class Verdict:
    """accept_length: [B] drafted tokens kept; path: [B, D + 1] tree indices of the root and the
    kept nodes in depth order (entries past accept_length are unspecified); bonus: [B] the token
    the target emits after the kept ones."""

    accept_length: torch.Tensor
    path: torch.Tensor
    bonus: torch.Tensor


def accept_chain(
    tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Verdict for chains: tree.tokens [B, k + 1] (root first), target_logits [B, k + 1, V]."""
    drafted = tree.tokens[:, 1:]
    batch_size, depth = drafted.shape
    path = torch.arange(depth + 1, device=drafted.device).expand(batch_size, -1)
    if sampling.greedy:
        target_choice = target_logits.argmax(dim=-1)
        # keep a drafted token iff it equals the target's argmax after the kept prefix
        matches = drafted == target_choice[:, :depth]
        accept_length = matches.long().cumprod(dim=1).sum(dim=1)
        return Verdict(accept_length, path, target_choice.gather(1, accept_length[:, None]).squeeze(1))
    target_probs = apply_sampling(target_logits.flatten(0, 1), sampling).view(*target_logits.shape[:2], -1)
    draft_probs = tree.draft_probs
    p_of_draft = target_probs[:, :depth].gather(2, drafted[:, :, None]).squeeze(2)
    q_of_draft = draft_probs.gather(2, drafted[:, :, None]).squeeze(2)
    uniform = torch.rand(batch_size, depth, generator=generator, device=drafted.device)
    # accept with prob min(1, p/q): u < p/q, written u * q < p (q > 0 where x was drawn)
    accepted = uniform * q_of_draft < p_of_draft
    accept_length = accepted.long().cumprod(dim=1).sum(dim=1)
    # q is 0 past the last draft, so the residual there is p itself: the bonus token's law
    rows = torch.arange(batch_size, device=drafted.device)
    p_next = target_probs[rows, accept_length]
    q_next = draft_probs[rows, accept_length.clamp(max=depth - 1)] * (accept_length < depth)[:, None]
    bonus = sample(_residual(p_next, q_next), generator)
    return Verdict(accept_length, path, bonus)


def _residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) per row ([B, V]); p itself where that is all zero (then p = q and a
    rejection had probability 0, so the row's draw never depends on it)."""
    residual = (target_probs - draft_probs).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), target_probs)


def accept_tree(
    tree: DraftTree, target_logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Verdict for trees: tree with N nodes, target_logits [B, N, V] at every node.

    Sampled, the rule needs only a few numbers per node (p, q and the residual at its parent, at its own
    token) and one whole distribution per row (the bonus token's); the full-vocabulary residual
    norm(max(p - q, 0)) exists only at the S nodes of a sampled chain (elsewhere q is 0 and it is p)."""
    batch_size, node_count = tree.tokens.shape
    valid = tree.valid if tree.valid is not None else torch.ones_like(tree.tokens, dtype=torch.bool)
    if sampling.greedy:
        target_choice = target_logits.argmax(dim=-1)
        # a node is kept when its token is the target's argmax at its parent
        kept = tree.tokens == target_choice.gather(1, tree.parents)
    else:
        target_probs = apply_sampling(target_logits.flatten(0, 1), sampling).view(batch_size, node_count, -1)
        chain_residuals = _chain_residuals(tree, target_probs)
        kept = _kept_by_recursive_rejection(tree, target_probs, chain_residuals, valid, generator)
    kept = kept & valid  # padding nodes are never reached
    kept[:, 0] = True
    # a node is reachable when it and all its ancestors are kept
    reachable = ~(tree.ancestors & ~kept[:, None, :]).any(dim=2)
    # at most one child of a node is kept, so at most one node per depth is reachable: take the deepest
    deepest = torch.where(reachable, tree.depths, -1).argmax(dim=1)
    rows = torch.arange(batch_size, device=tree.tokens.device)
    accept_length = tree.depths[rows, deepest]
    on_path = tree.ancestors[rows, deepest]
    node_index = torch.arange(node_count, device=tree.tokens.device)
    # path nodes in tree order (parents come before children) = depth order
    path = torch.where(on_path, node_index, node_count + node_index).sort(dim=1).values % node_count
    max_depth = int(tree.depths.max())
    if sampling.greedy:
        bonus = target_choice[rows, deepest]
    else:
        left_at_deepest = target_probs[rows, deepest]
        if chain_residuals is not None:
            chain_length = chain_residuals.shape[1]
            at_chain_node = ((deepest < chain_length) & _drawn_rows(tree))[:, None]
            residual = chain_residuals[rows, deepest.clamp(max=chain_length - 1)]
            left_at_deepest = torch.where(at_chain_node, residual, left_at_deepest)
        bonus = _bonus_after_children(tree, left_at_deepest, deepest, valid, generator)
    return Verdict(accept_length, path[:, : max_depth + 1], bonus)


def _chain_residuals(tree: DraftTree, target_probs: torch.Tensor) -> torch.Tensor | None:
    """[B, S, V]: what is left of p at the S nodes of a sampled chain (nodes 0..S-1, each the parent of a
    child drawn from tree.draft_probs) once that child is rejected, norm(max(p - q, 0)); None for a tree of
    point masses only (there every node's residual is p itself)."""
    if tree.draft_probs is None:
        return None
    chain_length = tree.draft_probs.shape[1]
    chain_probs = target_probs[:, :chain_length]
    return _residual(chain_probs.flatten(0, 1), tree.draft_probs.flatten(0, 1)).view_as(chain_probs)


def _drawn_rows(tree: DraftTree) -> torch.Tensor:
    """[B] bool: the rows whose chain nodes 1..S were drawn from tree.draft_probs."""
    if tree.drawn_rows is not None:
        return tree.drawn_rows
    return torch.ones(tree.tokens.shape[0], dtype=torch.bool, device=tree.tokens.device)


def _at_parent_token(values: torch.Tensor, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """values [B, M, V] read at (parent, token) of every node: [B, N] (parents < M)."""
    vocab_size = values.shape[2]
    return values.flatten(1).gather(1, parents * vocab_size + tokens)


def _kept_by_recursive_rejection(
    tree: DraftTree,
    target_probs: torch.Tensor,
    chain_residuals: torch.Tensor | None,
    valid: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """Which nodes [B, N] the recursive rejection keeps at their parent (target_probs: [B, N, V] at every
    node); children of a node are tried in node order (a sampled drafter child first)."""
    batch_size, node_count = tree.tokens.shape
    p_node = _at_parent_token(target_probs, tree.parents, tree.tokens)
    sampled = torch.zeros(batch_size, node_count, dtype=torch.bool, device=tree.tokens.device)
    if chain_residuals is None:
        # every candidate is a point mass on p (nothing sampled at its parent): r = p, q unused
        q_node, r_node = torch.zeros_like(p_node), p_node
    else:
        chain_length = chain_residuals.shape[1]
        drawn = _drawn_rows(tree)
        sampled[:, 1 : chain_length + 1] = drawn[:, None]
        # at a chain node q is the drafter's and r = norm(max(p - q, 0)); elsewhere q = 0 and r = p
        under_chain = (tree.parents < chain_length) & drawn[:, None]
        chain_parent = tree.parents.clamp(max=chain_length - 1)
        q_node = torch.where(under_chain, _at_parent_token(tree.draft_probs, chain_parent, tree.tokens), 0.0)
        r_node = torch.where(under_chain, _at_parent_token(chain_residuals, chain_parent, tree.tokens), p_node)
    r_node = r_node * valid
    node_index = torch.arange(node_count, device=tree.tokens.device)
    earlier_sibling = (
        (tree.parents[:, :, None] == tree.parents[:, None, :])
        & (node_index[None, :, None] > node_index[None, None, :])
        & valid[:, None, :]
    )
    earlier_sibling[:, :, 0] = False  # the root is nobody's sibling
    # point masses on the residual r: keep c with r(c) / (1 - r's mass on earlier point-mass siblings)
    earlier_point_masses = earlier_sibling & ~sampled[:, None, :]
    left = (1.0 - (earlier_point_masses.float() @ r_node[:, :, None]).squeeze(2)).clamp(
        min=torch.finfo(r_node.dtype).tiny
    )
    uniform = torch.rand(batch_size, node_count, generator=generator, device=tree.tokens.device)
    # a sampled child x ~ q: keep with min(1, p(x)/q(x)), written u * q < p
    accepted = torch.where(sampled, uniform * q_node < p_node, uniform * left < r_node) & valid
    # only the first accepted child of a node is tried and kept; later ones are never reached
    return accepted & ~(earlier_sibling & accepted[:, None, :]).any(dim=2)


def _bonus_after_children(
    tree: DraftTree, deepest_probs: torch.Tensor, deepest: torch.Tensor, valid: torch.Tensor, generator
) -> torch.Tensor:
    """The token after the deepest kept node: one draw from what is left of its p after its sampled child's
    rejection (deepest_probs [B, V]: norm(max(p - q, 0)), or p) with every child it has (all rejected)
    removed, renormalised; p itself for a leaf."""
    children = (tree.parents == deepest[:, None]) & valid
    children[:, 0] = False
    # scatter_add: padding nodes may carry the token of a real child, and must not hide it
    removed = torch.zeros_like(deepest_probs, dtype=torch.long).scatter_add_(1, tree.tokens, children.long()) > 0
    residual = deepest_probs.masked_fill(removed, 0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # no mass left only if the children held all of it, and then one was kept with probability 1
    return sample(
        torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), deepest_probs), generator
    )
