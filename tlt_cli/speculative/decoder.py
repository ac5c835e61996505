"""Lossless speculative decoding inside the embedded engine: draft, verify, accept, commit.

`EmbeddedEngine(model, eos, pad, speculative=SpeculativeDecoder(drafter, SpeculativeConfig(...)))`
calls `begin` after the prefill and `step` once per decoding step. The config may instead be a
schedule (running batch size -> shape or None), consulted at every step: None makes the step plain
decoding. An SD step, for every running row at once:
  1. draft: each draft source the shape uses proposes, behind one interface
     (tlt_cli/speculative/proposer.py): the drafter its chain or tree (drafter_proposer.py: catch-up on
     committed positions, then `steps` drafter runs in its own cache), the n-gram index up to
     `ngram_tokens` tokens per row (ngram_proposer.py: the prompt and the sibling responses of the
     row's group, RolloutRequest.group); the proposals become one tree (tlt_cli/speculative/tree.py);
  2. verify: the target runs once over the root and all drafted nodes, with the tree mask, over
     its whole vocabulary (a draft distribution that is zero outside the draft vocabulary keeps
     acceptance exact: see tlt_cli/speculative/acceptance.py);
  3. accept: tlt_cli/speculative/acceptance.py keeps a prefix per row (ragged: each row keeps its own
     number of tokens) and draws the bonus token; draft_counts.py counts it per row and per source;
  4. commit: kept entries move into place in the target cache, the rows advance, and each proposer
     that drafted reads what was kept (the drafter its next root state, off the target's true hidden
     states for the kept tokens).
Rejected entries in either cache sit past the row's committed length and are simply overwritten
later. EOS and max_new_tokens inside an accepted run are cut by the engine, which ends the row.

A drafter that diverged (its logits, or the draft distribution acceptance draws with, not finite: NonFiniteDrafts)
costs the call nothing it keeps: that step has committed nothing yet (its verify entries sit past the committed
lengths), so every row decodes it plainly from its last committed token, and the rest of the call drafts without
the drafter (a shape's n-gram part, else plain decoding): the target still samples every token. `drafter_diverged`
tells the caller (the worker resets the drafter: tlt_cli/training/drafter_divergence.py); `drafter_off` keeps the
drafter out of every later step.

Shapes (SpeculativeConfig labels): a drafter's chain or tree (`s4-k1-t5`, `s4-k2-t8`); model-free
(`ngram4`: steps 0) has no drafter run, and needs no drafter; hybrid (`s2-k1-t3+ngram4`) hangs the
n-gram proposals from the root of the drafter's chain or tree as one more branch, merged where tokens
coincide, and `accept_tree` verifies drafter and n-gram nodes under one rule (acceptance.py: a sampled
drafter child first, then the n-gram child on the residual). One source per row (`s2-k1-t3|ngram4`,
picks_source) verifies a chain per row instead, the drafter's or the n-gram index's, whichever has
the higher running mean of accepted drafts for that row (draft_counts.py; each tried once first; a
row without a proposal drafts with the model), so the verify pass is as narrow as a chain's, and a
step where every row picks the index skips the drafter as a model-free step does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tlt_cli.engine.kv_cache import keep_rows_of
from tlt_cli.engine.linear_forms import FormedCopy, LinearFormPlan
from tlt_cli.engine.running_batch import DecodeTarget, RunningBatch
from tlt_cli.engine.sampling import NonFiniteDrafts, NonFiniteLogits, SamplingParams
from tlt_cli.speculative.acceptance import Verdict, accept_chain, accept_tree
from tlt_cli.speculative.draft_counts import DraftCounts, StepCounts
from tlt_cli.speculative.drafter_proposer import DrafterProposer
from tlt_cli.speculative.ngram_proposer import NgramProposer
from tlt_cli.speculative.proposer import Commit, GroupedPrompt, Proposer
from tlt_cli.speculative.shapes import shape_problem, topk_fit_problem
from tlt_cli.speculative.tree import DraftTree, root_only, rows_by_source, with_chosen_chains, with_ngram_branch
from tlt_cli.speculative.types import (
    DRAFT_SOURCES,
    DRAFTER_SOURCE,
    NGRAM_SOURCE,
    DecodeStep,
    SpeculativeConfig,
    SpeculativeStats,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

# what a decode step whose drafts could not be sampled says (caught in `step`, which decodes that step plainly)
DRAFTS_NOT_FINITE = "the drafter's logits are not finite"


@dataclass(frozen=True)
class Draft:
    """The tree one SD step verifies and where its drafts came from."""

    tree: DraftTree
    row_sources: torch.Tensor  # [B, len(DRAFT_SOURCES)] bool, which sources drafted for each row
    proposers: tuple[Proposer, ...]  # the proposers that drafted for some row, in DRAFT_SOURCES order


# running batch size -> the SD shape for this step, or None for a plain decoding step
ConfigSchedule = Callable[[int], "SpeculativeConfig | None"]


class SpeculativeDecoder:
    """Drafts with `drafter` and the n-gram index in the shape of `config` and verifies exactly (see
    the module docstring).

    drafter: None when only model-free shapes are used (a shape that needs it is then refused).
    uses_ngram: whether any shape may draft with the n-gram index (None: a fixed shape says; a
    schedule may); without, the index is not kept.
    config: one SpeculativeConfig for every step, or a ConfigSchedule the engine consults before
    each step with the running batch size (the adaptive rule table). Committed state does not
    depend on the shape, so shapes may change, and SD may go off and on, from one step to the next.
    """

    # the engine calls it with every DecodeStep it timed with this decoder (None: nothing learns from them)
    observe_step: Callable[[DecodeStep], None] | None = None

    def __init__(
        self,
        drafter: nn.Module | None,
        config: SpeculativeConfig | ConfigSchedule,
        uses_ngram: bool | None = None,
    ) -> None:
        self.drafter = drafter
        self.schedule: ConfigSchedule = config if callable(config) else (lambda batch_size: config)
        # whether a shape may ask the n-gram index (None: a fixed shape says, a schedule may): if not, none is kept
        if uses_ngram is None:
            uses_ngram = config.uses_ngram if isinstance(config, SpeculativeConfig) else True
        self.drafter_proposer = DrafterProposer(drafter) if drafter is not None else None
        self.ngram_proposer = NgramProposer() if uses_ngram else None
        self.proposers: tuple[Proposer, ...] = tuple(
            proposer for proposer in (self.drafter_proposer, self.ngram_proposer) if proposer is not None
        )
        # shapes already validated against the drafter's vocabulary
        self._checked: set[SpeculativeConfig] = set()
        if isinstance(config, SpeculativeConfig):
            self._check(config)
        self.counts = DraftCounts.empty(0, torch.device("cpu"))
        # the latest step's StepCounts (None after a plain step), for the adaptive schedule
        self.last_step: StepCounts | None = None
        # the drafter's drafts stopped being finite in this generate call (begin clears it): no later step uses it
        self.drafter_diverged = False
        # the run turned the drafter off (it diverged again soon after a reset): no step drafts with it
        self.drafter_off = False

    def use_linear_plan(self, plan: LinearFormPlan) -> None:
        """Draft through a decode-time copy of the drafter whose linear layers compute in the plan's forms
        (tlt_cli/engine/linear_forms.py); the drafter the trainer updates is left as it is."""
        if self.drafter_proposer is not None:
            self.drafter_proposer.use_linear_plan(plan)

    @property
    def drafter_forms(self) -> FormedCopy | None:
        """The drafter's decode-time copy computing in the measured linear forms (use_linear_plan), or None."""
        return self.drafter_proposer.forms if self.drafter_proposer is not None else None

    @property
    def drafting(self) -> nn.Module | None:
        """The module that drafts: the drafter's formed copy, else the drafter."""
        return self.drafter_proposer.drafting if self.drafter_proposer is not None else None

    @property
    def by_finished_siblings(self) -> dict[int, list[int]]:
        """Finished siblings of a row -> [verify passes, accepted draft tokens] of its n-gram steps this call."""
        return self.ngram_proposer.by_finished_siblings if self.ngram_proposer is not None else {}

    def begin(self, batch: RunningBatch, requests: Sequence[GroupedPrompt] = ()) -> None:
        """Start a generate call: zero counters, and each proposer's fresh state (requests[i] is batch row i):
        the drafter's head re-read and an empty drafter cache, a new n-gram index over the prompts."""
        self.counts = DraftCounts.empty(batch.size, batch.lengths.device)
        self.drafter_diverged = False
        for proposer in self.proposers:
            proposer.begin(batch, requests)

    def step(
        self, target: DecodeTarget, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step; returns the emitted tokens [B, E] and counts [B]. With a shape: one
        draft-verify-accept-commit round; with None from the schedule: plain decoding. A shape that drafts with a
        drafter that diverged or is off keeps only its n-gram part (none: plain decoding)."""
        config = self._config_for(batch.size)
        self.last_step = None
        if config is not None and config.uses_drafter and (self.drafter_diverged or self.drafter_off):
            config = config.model_free_part
        if config is None:
            return target.decode_step(batch, sampling, generator)
        try:
            return self._speculative_step(target, batch, config, sampling, generator)
        except NonFiniteDrafts:
            # nothing is committed yet: every row decodes this step plainly from its last committed token
            self.drafter_diverged = True
            return target.decode_step(batch, sampling, generator)

    def _speculative_step(
        self,
        target: DecodeTarget,
        batch: RunningBatch,
        config: SpeculativeConfig,
        sampling: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft, verify, accept, commit; NonFiniteDrafts (before any commit) when the drafter's distribution is not
        finite."""
        try:
            draft = self._draft(batch, config, sampling, generator)
        except NonFiniteLogits as error:  # sampled from the drafter's logits: the drafter diverged, not the policy
            raise NonFiniteDrafts(DRAFTS_NOT_FINITE) from error
        tree = draft.tree
        hidden = target.forward_block(batch, tree.tokens, batch.lengths[:, None] + tree.depths, tree.ancestors)
        accept = accept_chain if config.is_chain and not config.uses_ngram else accept_tree
        logits = target.logits(hidden)
        try:
            verdict = accept(tree, logits, sampling, generator)
        except NonFiniteLogits as error:
            # the target's logits are finite: what was not is the drafter's distribution the acceptance drew with
            if config.uses_drafter and bool(torch.isfinite(logits).all()):
                raise NonFiniteDrafts(DRAFTS_NOT_FINITE) from error
            raise
        self.last_step = self.counts.count(config, tree, verdict, draft.row_sources)
        emitted = self._commit(batch, config, draft, verdict, hidden)
        return emitted, verdict.accept_length + 1

    def _draft(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> Draft:
        """Ask the sources `config` drafts with and merge their proposals into the tree to verify."""
        proposals = self.ngram_proposer.propose(batch, config, sampling, generator) if config.uses_ngram else None
        # a picks_source shape: which rows verify their n-gram chain this step (the others the drafter's)
        ngram_rows = self.counts.ngram_rows(proposals) if config.picks_source else None
        model_drafts = config.uses_drafter and (ngram_rows is None or not bool(ngram_rows.all()))
        if model_drafts:
            tree = self.drafter_proposer.propose(batch, config, sampling, generator)
        else:
            tree = root_only(batch.pending)
        drafted = {DRAFTER_SOURCE: model_drafts, NGRAM_SOURCE: config.uses_ngram}
        if ngram_rows is not None:
            tree, row_sources = with_chosen_chains(tree, proposals, ngram_rows), rows_by_source(ngram_rows)
        else:
            if proposals is not None:
                tree = with_ngram_branch(tree, proposals)
            # every row verifies the drafts of every source that drafted
            sources = torch.tensor([drafted[source] for source in DRAFT_SOURCES], device=batch.lengths.device)
            row_sources = sources[None, :].expand(batch.size, -1)
        return Draft(tree, row_sources, tuple(proposer for proposer in self.proposers if drafted[proposer.source]))

    def _config_for(self, batch_size: int) -> SpeculativeConfig | None:
        config = self.schedule(batch_size)
        if config is not None and config not in self._checked:
            self._check(config)
        return config

    def _check(self, config: SpeculativeConfig) -> None:
        if config.uses_drafter and self.drafter is None:
            raise ValueError(f"SD configuration {config.label()} drafts with a model, and there is no drafter.")
        if config.uses_ngram and self.ngram_proposer is None:
            raise ValueError(f"SD configuration {config.label()} drafts n-grams, and this decoder keeps no index.")
        problem = shape_problem(config) or (
            topk_fit_problem(config, self.drafter.vocabulary.size) if config.uses_drafter else None
        )
        if problem is not None:
            raise ValueError(problem)
        self._checked.add(config)

    def _commit(
        self, batch: RunningBatch, config: SpeculativeConfig, draft: Draft, verdict: Verdict, hidden: torch.Tensor
    ) -> torch.Tensor:
        """Move kept entries into place, advance the rows, let the proposers that drafted read what was kept;
        return the emitted tokens [B, D + 1] (kept drafts, then the bonus at index accept_length)."""
        accept_length, path = verdict.accept_length, verdict.path
        offsets = torch.arange(path.shape[1], device=path.device)
        # chains (model-free, the drafter's, one source per row) keep their nodes in place; trees (a hybrid's
        # included) may branch
        branching = not config.is_chain or (config.uses_drafter and config.uses_ngram and not config.picks_source)
        if branching and int(accept_length.max()) > 0:
            # kept node path[j] moves from slot lengths + path[j] to lengths + j; others stay put
            source = torch.where(offsets[None, :] <= accept_length[:, None], path, offsets[None, :])
            batch.cache.move_slots(batch.lengths[:, None] + source, batch.lengths[:, None] + offsets[None, :])
        path_tokens = draft.tree.tokens.gather(1, path)
        emitted = torch.cat([path_tokens[:, 1:], torch.zeros_like(path_tokens[:, :1])], dim=1)
        emitted.scatter_(1, accept_length[:, None], verdict.bonus[:, None])
        commit = Commit(batch.lengths, emitted, hidden, verdict, draft.row_sources)
        batch.lengths = batch.lengths + accept_length + 1
        batch.pending = verdict.bonus
        for proposer in draft.proposers:
            proposer.after_commit(batch, commit)
        return emitted

    def keep_rows(self, batch: RunningBatch, rows: torch.Tensor) -> None:
        """Keep only rows `rows` of the counters and every proposer's per-row state; the other rows have
        finished (call before the batch drops them: the n-gram index learns their last tokens first)."""
        for proposer in self.proposers:
            proposer.keep_rows(batch, rows)
        keep_rows_of(self.counts, rows)

    def stats(self, row: int) -> SpeculativeStats:
        """What SD did for the request in `row` (acceptance as judged at verification, before any
        cut at EOS or max_new_tokens)."""
        return self.counts.stats(row)
