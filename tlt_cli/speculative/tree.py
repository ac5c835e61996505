"""Draft shapes for speculative decoding: a chain (topk 1) or an EAGLE-2 / SGLang-style tree.

The drafter's proposer (tlt_cli/speculative/drafter_proposer.py) runs the drafter `steps` times; after
each run it hands the drafter's logits for the current frontier to a builder, which picks the tokens to
draft next and says which earlier draft entries each new one may attend to. `finish` returns a
`DraftTree`: node 0 is the root (the row's pending token, already emitted), nodes are ordered so
parents come before their children, and `ancestors` is the tree attention mask the target verifies with.

Tree (SGLang's steps / topk / draft_tokens): each step expands every frontier node into its topk
most likely children, scores a node by the sum of draft log-probabilities along its path, keeps
the topk best new nodes as the next frontier, and at the end keeps the draft_tokens - 1 best of
all candidates. A child never scores above its parent and ties go to the shallower node, so the
kept set always contains every kept node's parent.

Both builders read the drafter's logits over its draft vocabulary (N tokens, possibly fewer than
the target's V: tlt_cli/drafter/vocabulary.py) and hand back target token ids; a chain's draft
distribution is handed back over all V target tokens, zero outside the draft vocabulary.

`with_ngram_branch` adds the n-gram index's proposals (tlt_cli/speculative/ngram.py) to a tree as one
more branch, merged into the tree where its tokens coincide with drafted ones (siblings always
carry distinct tokens), or makes a chain of them alone from a root-only tree (`root_only`). Rows
propose different numbers of tokens: the shorter ones are padded with invalid nodes that the
acceptance never reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tlt_cli.engine.sampling import SamplingParams, apply_sampling, sample
from tlt_cli.speculative.types import DRAFT_SOURCES, DRAFTER_SOURCE, NGRAM_SOURCE, SpeculativeConfig


class DraftVocabulary(Protocol):
    """What the builders need of a draft vocabulary (tlt_cli/drafter/vocabulary.py's DraftVocabulary)."""

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft token ids -> the target's token ids."""

    def to_target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over the N draft tokens -> the same over the V target tokens (zero elsewhere)."""


@dataclass
class DraftTree:
    """N = 1 + drafted tokens per row; node 0 is the root.

    tokens: [B, N]; parents: [B, N] tree index of each node's parent (the root points at itself);
    depths: [B, N] (root 0); ancestors: [B, N, N] or a shared [N, N] bool, ancestors[.., n, m] iff m
    is n or an ancestor of n; draft_probs: [B, S, V] the distribution each drafted token of a chain
    (nodes 1..S) was sampled from, over the target's V tokens (None for greedy chains and for trees,
    whose nodes are chosen, not drawn: each node is a point mass on its token; an n-gram branch
    grafted onto a sampled chain comes after its S nodes); valid: [B, N] bool, the nodes that exist
    (None: all; padding nodes of shorter rows are never accepted); sources: [B, N, len(DRAFT_SOURCES)]
    bool, which sources proposed each node (None: every drafted node is the drafter's); drawn_rows: [B]
    bool, the rows whose nodes 1..S were drawn from draft_probs (None: every row; a row of
    `with_chosen_chains` that verifies n-gram proposals has point masses there instead).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestors: torch.Tensor
    draft_probs: torch.Tensor | None
    valid: torch.Tensor | None = None
    sources: torch.Tensor | None = None
    drawn_rows: torch.Tensor | None = None

    def drafted_by(self) -> torch.Tensor:
        """[B, N, len(DRAFT_SOURCES)] bool: which sources proposed each node (the root: none)."""
        if self.sources is not None:
            return self.sources
        drafted = torch.ones_like(self.tokens, dtype=torch.bool)
        drafted[:, 0] = False
        none = torch.zeros_like(drafted)
        return torch.stack([drafted if source == DRAFTER_SOURCE else none for source in DRAFT_SOURCES], dim=2)


@dataclass
class Frontier:
    """The draft nodes the drafter runs on next. tokens: [B, F]; parent_slot: [B, F] which node of
    the previous frontier each extends (its drafter output is the new node's input hidden state);
    visible: [B, F, W] which of the W draft entries written so far (plus this block, the last F)
    each node attends to."""

    tokens: torch.Tensor
    parent_slot: torch.Tensor
    visible: torch.Tensor


class ChainBuilder:
    """A chain of `steps` drafted tokens: the argmax when greedy, else one draw from q, the
    drafter's distribution under the same SamplingParams as the target (zero outside the draft
    vocabulary)."""

    def __init__(
        self,
        root_tokens: torch.Tensor,
        steps: int,
        sampling: SamplingParams,
        generator: torch.Generator,
        vocabulary: DraftVocabulary,
    ):
        self.root_tokens = root_tokens
        self.steps = steps
        self.sampling = sampling
        self.generator = generator
        self.vocabulary = vocabulary
        self.tokens: list[torch.Tensor] = []
        self.draft_probs: list[torch.Tensor] = []

    def expand(self, frontier_logits: torch.Tensor) -> Frontier:
        """Draft the next token from the drafter's logits [B, 1, N] of the last one."""
        logits = frontier_logits[:, 0]
        if self.sampling.greedy:
            draft_token = logits.argmax(dim=-1)
        else:
            draft_probs = apply_sampling(logits, self.sampling)
            draft_token = sample(draft_probs, self.generator)
            # q over the target's tokens: the draft tokens' probabilities, 0 everywhere else
            self.draft_probs.append(self.vocabulary.to_target_probs(draft_probs))
        token = self.vocabulary.to_target_ids(draft_token)
        self.tokens.append(token)
        written = len(self.tokens)
        batch_size = token.shape[0]
        visible = torch.ones(batch_size, 1, written, dtype=torch.bool, device=token.device)
        return Frontier(token[:, None], torch.zeros_like(token)[:, None], visible)

    def finish(self) -> DraftTree:
        tokens = torch.stack([self.root_tokens, *self.tokens], dim=1)
        node_count = tokens.shape[1]
        index = torch.arange(node_count, device=tokens.device)
        return DraftTree(
            tokens=tokens,
            parents=(index - 1).clamp(min=0).expand_as(tokens),
            depths=index.expand_as(tokens),
            ancestors=torch.ones(node_count, node_count, dtype=torch.bool, device=tokens.device).tril(),
            draft_probs=torch.stack(self.draft_probs, dim=1) if self.draft_probs else None,
        )


class TreeBuilder:
    """An EAGLE-2 tree: topk children per frontier node, the best draft_tokens - 1 nodes kept."""

    def __init__(self, root_tokens: torch.Tensor, config: SpeculativeConfig, vocabulary: DraftVocabulary):
        self.root_tokens = root_tokens
        self.config = config
        self.vocabulary = vocabulary
        batch_size, device = root_tokens.shape[0], root_tokens.device
        self.candidate_tokens: list[torch.Tensor] = []
        self.candidate_scores: list[torch.Tensor] = []
        # candidate index of each candidate's parent; -1 is the root
        self.candidate_parents: list[torch.Tensor] = []
        self.candidate_count = 0
        self.own_entry = torch.eye(config.topk, dtype=torch.bool, device=device).expand(batch_size, -1, -1)
        self.frontier_index = torch.full((batch_size, 1), -1, dtype=torch.long, device=device)
        self.frontier_scores = torch.zeros(batch_size, 1, device=device)
        self.frontier_visible = torch.zeros(batch_size, 1, 0, dtype=torch.bool, device=device)

    def expand(self, frontier_logits: torch.Tensor) -> Frontier:
        """Add the topk children of every frontier node (drafter logits [B, F, N]); return the new frontier."""
        topk = self.config.topk
        batch_size, frontier_size, _ = frontier_logits.shape
        child_logprobs, child_draft_tokens = torch.log_softmax(frontier_logits.float(), dim=-1).topk(topk, dim=-1)
        child_tokens = self.vocabulary.to_target_ids(child_draft_tokens)
        # a node's score is the sum of draft log-probs on its path: parent score + log q(child)
        scores = (self.frontier_scores[:, :, None] + child_logprobs).reshape(batch_size, frontier_size * topk)
        tokens = child_tokens.reshape(batch_size, frontier_size * topk)
        parents = self.frontier_index.repeat_interleave(topk, dim=1)
        self._add_candidates(tokens, scores, parents)
        kept = scores.topk(topk, dim=-1).indices  # [B, topk] into this step's candidates
        parent_slot = kept // topk
        self.frontier_index = self.candidate_count - tokens.shape[1] + kept
        self.frontier_scores = scores.gather(1, kept)
        inherited = gather_rows(self.frontier_visible, parent_slot)
        self.frontier_visible = torch.cat([inherited, self.own_entry], dim=2)
        return Frontier(tokens.gather(1, kept), parent_slot, self.frontier_visible)

    def _add_candidates(self, tokens, scores, parents) -> None:
        self.candidate_tokens.append(tokens)
        self.candidate_scores.append(scores)
        self.candidate_parents.append(parents)
        self.candidate_count += tokens.shape[1]

    def finish(self) -> DraftTree:
        """Keep the draft_tokens - 1 best candidates, in candidate order (parents first)."""
        scores = torch.cat(self.candidate_scores, dim=1)
        kept_count = min(self.config.verified_tokens - 1, scores.shape[1])
        # stable sort: equal scores keep candidate order, so a parent ranks before its children
        best = scores.sort(dim=1, descending=True, stable=True).indices[:, :kept_count]
        kept = best.sort(dim=1).values
        batch_size, device = scores.shape[0], scores.device
        # tree index of every candidate (shifted by one so the root's -1 maps to node 0)
        tree_index_of = torch.zeros(batch_size, scores.shape[1] + 1, dtype=torch.long, device=device)
        tree_index_of.scatter_(1, kept + 1, torch.arange(1, kept_count + 1, device=device).expand(batch_size, -1))
        candidate_parents = torch.cat(self.candidate_parents, dim=1).gather(1, kept)
        zeros = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        parents = torch.cat([zeros, tree_index_of.gather(1, candidate_parents + 1)], dim=1)
        tokens = torch.cat([self.root_tokens[:, None], torch.cat(self.candidate_tokens, dim=1).gather(1, kept)], dim=1)
        # the candidates of expansion d (1-based) all have depth d
        candidate_depths = torch.cat(
            [
                torch.full((step_tokens.shape[1],), depth, device=device)
                for depth, step_tokens in enumerate(self.candidate_tokens, start=1)
            ]
        )
        depths = torch.cat([zeros, candidate_depths[kept]], dim=1)
        return DraftTree(tokens, parents, depths, ancestor_mask(parents, self.config.steps), None)


def root_only(root_tokens: torch.Tensor) -> DraftTree:
    """A tree of the root alone (root_tokens: [B]), to graft a model-free n-gram chain onto."""
    zeros = torch.zeros_like(root_tokens)[:, None]
    mask = torch.ones(1, 1, dtype=torch.bool, device=root_tokens.device)
    return DraftTree(root_tokens[:, None], zeros, zeros, mask, None)


def with_ngram_branch(tree: DraftTree, proposals: list[list[int]]) -> DraftTree:
    """`tree` (point masses, or a sampled chain) with proposals[b] (target ids) hung from row b's root as one
    more branch: it follows existing nodes while their tokens coincide, then goes on as new nodes.
    Rows are padded to one width with invalid nodes (children of the root, never accepted)."""
    batch_size, node_count = tree.tokens.shape
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    from_ngram = []
    for row in range(batch_size):
        row_tokens, row_parents, row_depths = tokens[row], parents[row], depths[row]
        proposed = [False] * node_count
        child_of = {(row_parents[node], row_tokens[node]): node for node in range(1, node_count)}
        node = 0
        for token in proposals[row]:
            child = child_of.get((node, token))
            if child is None:
                # a new node: the drafter did not propose this token here
                child = len(row_tokens)
                row_tokens.append(token)
                row_parents.append(node)
                row_depths.append(row_depths[node] + 1)
                proposed.append(False)
                child_of[(node, token)] = child
            proposed[child] = True
            node = child
        from_ngram.append(proposed)
    width = max(len(row) for row in tokens)
    valid = [[True] * len(row) + [False] * (width - len(row)) for row in tokens]
    device = tree.tokens.device

    def padded(rows: list[list], fill) -> torch.Tensor:
        return torch.tensor([row + [fill] * (width - len(row)) for row in rows], device=device)

    valid_nodes = torch.tensor(valid, device=device)
    parent_index = padded(parents, 0)
    node_depths = padded(depths, 1)
    # the nodes the tree had besides its root (a root-only tree has none)
    node_index = torch.arange(width, device=device)[None, :].expand(batch_size, -1)
    by_drafter = (node_index > 0) & (node_index < node_count)
    by_ngram = padded(from_ngram, False)
    sources = torch.stack([by_drafter if source == DRAFTER_SOURCE else by_ngram for source in DRAFT_SOURCES], dim=2)
    return DraftTree(
        tokens=padded(tokens, 0),
        parents=parent_index,
        depths=node_depths,
        ancestors=ancestor_mask(parent_index, int(node_depths.max())),
        # a sampled chain keeps its nodes 1..S and their q; the grafted nodes come after them
        draft_probs=tree.draft_probs,
        valid=valid_nodes,
        sources=sources,
    )


def with_chosen_chains(chain: DraftTree, proposals: list[list[int]], ngram_rows: torch.Tensor) -> DraftTree:
    """One chain per row: proposals[b] (target ids) where ngram_rows[b], else the drafter's chain of `chain` (a
    ChainBuilder's, or `root_only` when no row drafted). Rows are padded to one width with invalid nodes; the
    n-gram rows' nodes are point masses (drawn_rows false), the drafter rows' keep their draft_probs."""
    batch_size, chain_nodes = chain.tokens.shape
    device = chain.tokens.device
    chosen = ngram_rows.tolist()
    proposal_lengths = [len(proposal) if use else 0 for proposal, use in zip(proposals, chosen)]
    width = max(chain_nodes, 1 + max(proposal_lengths))
    proposed = torch.tensor(
        [
            (proposal if use else []) + [0] * (width - 1 - length)
            for proposal, use, length in zip(proposals, chosen, proposal_lengths)
        ],
        dtype=chain.tokens.dtype,
        device=device,
    ).view(batch_size, width - 1)
    drafted = torch.nn.functional.pad(chain.tokens[:, 1:], (0, width - chain_nodes))
    tokens = torch.cat([chain.tokens[:, :1], torch.where(ngram_rows[:, None], proposed, drafted)], dim=1)
    node_index = torch.arange(width, device=device)
    row_nodes = torch.where(ngram_rows, 1 + torch.tensor(proposal_lengths, device=device), chain_nodes)
    valid = node_index[None, :] < row_nodes[:, None]
    drafted_node = valid & (node_index[None, :] > 0)
    sources = drafted_node[:, :, None] & rows_by_source(ngram_rows)[:, None, :]
    return DraftTree(
        tokens=tokens,
        parents=(node_index - 1).clamp(min=0).expand(batch_size, -1),
        depths=node_index.expand(batch_size, -1),
        ancestors=torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(batch_size, -1, -1),
        draft_probs=chain.draft_probs,
        valid=valid,
        sources=sources,
        drawn_rows=None if chain.draft_probs is None else ~ngram_rows,
    )


def rows_by_source(ngram_rows: torch.Tensor) -> torch.Tensor:
    """[B, len(DRAFT_SOURCES)] bool: the one source each row drafts from in a one-source-per-row step
    (ngram_rows [B]: the rows verifying n-gram proposals; the others the drafter's chain)."""
    return torch.stack([ngram_rows if source == NGRAM_SOURCE else ~ngram_rows for source in DRAFT_SOURCES], dim=1)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool: node n sees m iff m is n or an ancestor of n (parents: [B, N], root -> 0)."""
    batch_size, node_count = parents.shape
    mask = torch.eye(node_count, dtype=torch.bool, device=parents.device).expand(batch_size, -1, -1)
    parent_rows = parents[:, :, None].expand(-1, -1, node_count)
    for _ in range(max_depth):
        # each pass adds one more generation: n inherits everything its parent sees
        mask = mask | mask.gather(1, parent_rows)
    return mask


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [B, N, D] and index [B, K] -> [B, K, D] with out[b, k] = values[b, index[b, k]]."""
    return values.gather(1, index[:, :, None].expand(-1, -1, values.shape[2]))
