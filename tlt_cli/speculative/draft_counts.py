"""What speculative decoding did per row and per step, by draft source, and the per-row choice of source.

The speculative decoder (tlt_cli/speculative/decoder.py) keeps one `DraftCounts` per generate call, a
row per row of the running batch. `count` folds in each verify pass and returns its `StepCounts`
(the adaptive schedule learns from them); `stats(row)` is the request's SpeculativeStats. A shape
with one source per row (`s2-k1-t3|ngram4`, picks_source) asks `ngram_rows` which rows verify their
n-gram proposal rather than the drafter's chain: each row keeps a running mean of the drafts it
accepted per verify pass from each source, tries the drafter first, then the n-gram index, then keeps
to the one with the higher mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tlt_cli.speculative.acceptance import Verdict
from tlt_cli.speculative.tree import DraftTree
from tlt_cli.speculative.types import DRAFT_SOURCES, DRAFTER_SOURCE, NGRAM_SOURCE, SpeculativeConfig, SpeculativeStats

# weight of the newest verify pass in a row's running mean of accepted drafts per source (picks_source shapes)
SOURCE_SMOOTHING = 0.3


@dataclass(frozen=True)
class StepCounts:
    """What the verify pass of one SD step did over the batch, per draft source: rows verified with
    drafts of that source (0 when the shape does not use it), and the accepted tokens it had
    proposed (a token both proposed counts for both)."""

    passes_by_source: dict[str, int]
    accepted_by_source: dict[str, int]
    # per verified row, the drafted tokens it accepted (the cost-model schedule's acceptance by depth reads them)
    accepted_per_row: tuple[int, ...] = ()
    # tokens per row the verify pass ran through the target, root included: the widest row's (rows are padded)
    verified_width: int = 0


@dataclass
class DraftCounts:
    """Counters for the rows of the running batch (B rows, in its order; every field is per-row, and
    `keep_rows_of` selects them all)."""

    verify_passes: torch.Tensor  # [B]
    accepted_draft_tokens: torch.Tensor  # [B]
    accepted_by_depth: torch.Tensor  # [B, deepest steps so far]
    proposed_by_depth: torch.Tensor  # [B, deepest steps so far]
    passes_by_source: torch.Tensor  # [B, len(DRAFT_SOURCES)] verify passes of shapes using each source
    accepted_by_source: torch.Tensor  # [B, len(DRAFT_SOURCES)] accepted tokens each source had proposed
    # [B, len(DRAFT_SOURCES)] running mean of the drafts accepted per verify pass when the row verified that
    # source's chain alone (a picks_source shape: s2-k1-t3|ngram4); NaN until the row has tried it
    source_means: torch.Tensor

    @classmethod
    def empty(cls, batch_size: int, device: torch.device) -> DraftCounts:
        """Fresh rows: zero counters, no running means."""
        counts = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(
            verify_passes=counts,
            accepted_draft_tokens=counts.clone(),
            accepted_by_depth=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            proposed_by_depth=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            passes_by_source=torch.zeros(batch_size, len(DRAFT_SOURCES), dtype=torch.long, device=device),
            accepted_by_source=torch.zeros(batch_size, len(DRAFT_SOURCES), dtype=torch.long, device=device),
            source_means=torch.full((batch_size, len(DRAFT_SOURCES)), float("nan"), device=device),
        )

    def ngram_rows(self, proposals: list[list[int]]) -> torch.Tensor:
        """[B] bool: the rows that verify their n-gram proposal rather than the drafter's chain. A row tries
        the drafter first, then the n-gram index, then keeps to the one with the higher running mean of
        accepted drafts (ties: the drafter); a row with no proposal drafts with the model."""
        means = self.source_means
        drafter_mean, ngram_mean = (
            means[:, DRAFT_SOURCES.index(DRAFTER_SOURCE)],
            means[:, DRAFT_SOURCES.index(NGRAM_SOURCE)],
        )
        proposes = torch.tensor([len(proposal) > 0 for proposal in proposals], device=means.device)
        return proposes & ~drafter_mean.isnan() & (ngram_mean.isnan() | (ngram_mean > drafter_mean))

    def count(
        self, config: SpeculativeConfig, tree: DraftTree, verdict: Verdict, row_sources: torch.Tensor
    ) -> StepCounts:
        """Fold in one verify pass of `tree`; row_sources: [B, len(DRAFT_SOURCES)] bool, which sources drafted
        for each row (one per row in a picks_source step, whose running means learn from it)."""
        missing_depths = max(config.steps, config.ngram_tokens) - self.accepted_by_depth.shape[1]
        if missing_depths > 0:
            self.accepted_by_depth = torch.nn.functional.pad(self.accepted_by_depth, (0, missing_depths))
            self.proposed_by_depth = torch.nn.functional.pad(self.proposed_by_depth, (0, missing_depths))
        depth_index = torch.arange(self.accepted_by_depth.shape[1], device=verdict.accept_length.device)
        self.verify_passes += 1
        self.accepted_draft_tokens += verdict.accept_length
        self.accepted_by_depth += depth_index[None, :] < verdict.accept_length[:, None]
        valid_depths = tree.depths if tree.valid is None else tree.depths.masked_fill(~tree.valid, 0)
        tree_depth = valid_depths.max(dim=1).values
        self.proposed_by_depth += depth_index[None, :] < tree_depth[:, None]
        if config.picks_source:
            self._remember_sources(row_sources, verdict.accept_length)
        return self._count_sources(tree, verdict, row_sources)

    def _remember_sources(self, chosen: torch.Tensor, accept_length: torch.Tensor) -> None:
        """Fold each row's accepted drafts into the running mean of the source it verified (chosen: [B,
        len(DRAFT_SOURCES)] bool)."""
        means = self.source_means
        observed = accept_length.to(means.dtype)[:, None].expand_as(means)
        updated = torch.where(means.isnan(), observed, (1 - SOURCE_SMOOTHING) * means + SOURCE_SMOOTHING * observed)
        self.source_means = torch.where(chosen, updated, means)

    def _count_sources(self, tree: DraftTree, verdict: Verdict, row_sources: torch.Tensor) -> StepCounts:
        """Accepted tokens per draft source, per row and for the step."""
        offsets = torch.arange(verdict.path.shape[1], device=verdict.path.device)
        kept = (offsets[None, :] >= 1) & (offsets[None, :] <= verdict.accept_length[:, None])
        path_sources = tree.drafted_by().gather(1, verdict.path[:, :, None].expand(-1, -1, len(DRAFT_SOURCES)))
        accepted = (path_sources & kept[:, :, None]).sum(dim=1)  # [B, sources]
        self.passes_by_source += row_sources.long()
        self.accepted_by_source += accepted
        totals, passes = accepted.sum(dim=0).tolist(), row_sources.long().sum(dim=0).tolist()
        return StepCounts(
            dict(zip(DRAFT_SOURCES, passes)),
            dict(zip(DRAFT_SOURCES, totals)),
            tuple(verdict.accept_length.tolist()),
            tree.tokens.shape[1],
        )

    def stats(self, row: int) -> SpeculativeStats:
        """What SD did for the request in `row` (acceptance as judged at verification, before any
        cut at EOS or max_new_tokens)."""
        return SpeculativeStats(
            verify_passes=int(self.verify_passes[row]),
            accepted_draft_tokens=int(self.accepted_draft_tokens[row]),
            accepted_by_depth=self.accepted_by_depth[row].tolist(),
            proposed_by_depth=self.proposed_by_depth[row].tolist(),
            passes_by_source=dict(zip(DRAFT_SOURCES, self.passes_by_source[row].tolist())),
            accepted_by_source=dict(zip(DRAFT_SOURCES, self.accepted_by_source[row].tolist())),
        )
