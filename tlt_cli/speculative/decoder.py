"""Lossless speculative decoding inside the embedded engine: draft, verify, accept, commit.

`EmbeddedEngine(model, eos, pad, speculative=SpeculativeDecoder(drafter, SpeculativeConfig(...)))`
calls `begin` after the prefill and `step` once per decoding step. The config may instead be a
schedule (running batch size -> shape or None), consulted at every step: None makes the step plain
decoding. An SD step, for every running row at once:
  0. catch up: the drafter reads the committed positions it has not seen (the prompt, and tokens
     of plain steps) from the target hidden states the engine keeps in its cache;
  1. draft: the drafter (anything with `EagleDrafter`'s forward, `vocabulary` and
     `refresh_draft_head`) runs `steps` times from the row's root state, building a chain or a
     tree (tlt_cli/speculative/tree.py) in its own `SlotCache`; its logits cover its draft vocabulary
     (N tokens, possibly fewer than the target's) and drafted ids are mapped to target ids;
  2. verify: the target runs once over the root and all drafted nodes, with the tree mask, over
     its whole vocabulary (a draft distribution that is zero outside the draft vocabulary keeps
     acceptance exact: see tlt_cli/speculative/acceptance.py);
  3. accept: tlt_cli/speculative/acceptance.py keeps a prefix per row (ragged: each row keeps its own
     number of tokens) and draws the bonus token;
  4. commit: kept entries move into place in the target cache, the drafter catches up on the
     target's true hidden states for the kept tokens, and the next root state is read off it.
Rejected entries in either cache sit past the row's committed length and are simply overwritten
later. EOS and max_new_tokens inside an accepted run are cut by the engine, which ends the row.

Drafts without a model: a shape with `ngram_tokens` also asks the n-gram index (tlt_cli/speculative/ngram.py)
over the prompt and the sibling responses of each row's group (RolloutRequest.group) for up to that
many tokens. Model-free (`ngram4`: steps 0) skips steps 0, 1 and the drafter's part of 4: the
proposals alone form a chain, and no drafter is needed. Hybrid (`s2-k1-t3+ngram4`) drafts the
drafter's part as usual (a sampled chain, or a tree of point masses) and hangs the proposals from
the root as one more branch, merged where tokens coincide; `accept_tree` verifies drafter and
n-gram nodes under one rule (acceptance.py: a sampled drafter child first, then the n-gram child on
the residual). One source per row (`s2-k1-t3|ngram4`, picks_source) verifies a chain per row instead,
the drafter's or the n-gram index's, whichever has the higher running mean of accepted drafts for
that row (each tried once first; a row without a proposal drafts with the model), so the verify
pass is as narrow as a chain's, and a step where every row picks the index skips the drafter as a
model-free step does. The index learns every emitted token (at the next step that asks
it, and when a row finishes, before it leaves the batch), so finished siblings stay in it.

Drafter positions follow tlt_cli/drafter/trainer.py: drafter entry t reads (token[t+1],
target_hidden[t]) at position t, so the drafter cache holds exactly as many entries as the target
cache after every commit, and the entry of the last committed position yields the root's
prediction of the first drafted token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from tlt_cli.engine.kv_cache import SlotCache, block_attention_mask, keep_rows_of
from tlt_cli.engine.linear_forms import FormedCopy, LinearFormPlan
from tlt_cli.engine.running_batch import DecodeTarget, RunningBatch
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.speculative.acceptance import Verdict, accept_chain, accept_tree
from tlt_cli.speculative.ngram import NgramIndex
from tlt_cli.speculative.shapes import shape_problem, topk_fit_problem
from tlt_cli.speculative.tree import (
    ChainBuilder,
    DraftTree,
    TreeBuilder,
    gather_rows,
    root_only,
    rows_by_source,
    with_chosen_chains,
    with_ngram_branch,
)
from tlt_cli.speculative.types import DRAFT_SOURCES, DecodeStep, SpeculativeConfig, SpeculativeStats

if TYPE_CHECKING:
    from collections.abc import Sequence


class GroupedPrompt(Protocol):
    """What speculative decoding reads of a request (a RolloutRequest has both): the prompt the n-gram
    index starts from, and the group whose responses draft from each other (None: a group of its own)."""

    prompt_ids: tuple[int, ...]
    group: int | None


@dataclass
class DraftState:
    """The decoder's state for the rows of the running batch (B rows, in its order; every tensor
    field is per-row, and `keep_rows_of` selects them all and the drafter cache's rows)."""

    cache: SlotCache  # the drafter's own cache
    drafter_lengths: torch.Tensor  # [B] committed drafter entries (lags the target after plain steps)
    root_hidden: torch.Tensor  # [B, H] drafter hidden of the last committed entry
    root_logits: torch.Tensor  # [B, N] its logits over the draft vocabulary: the first drafted token's
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
    def empty(
        cls,
        batch_size: int,
        capacity: int,
        hidden_size: int,
        draft_vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> DraftState:
        """Fresh rows: an empty drafter cache of `capacity` slots, zero counters, zero root states."""
        counts = torch.zeros(batch_size, dtype=torch.long, device=device)
        return cls(
            cache=SlotCache(batch_size, capacity),
            drafter_lengths=counts,
            root_hidden=torch.zeros(batch_size, hidden_size, dtype=dtype, device=device),
            root_logits=torch.zeros(batch_size, draft_vocab_size, dtype=dtype, device=device),
            verify_passes=counts.clone(),
            accepted_draft_tokens=counts.clone(),
            accepted_by_depth=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            proposed_by_depth=torch.zeros(batch_size, 0, dtype=torch.long, device=device),
            passes_by_source=torch.zeros(batch_size, len(DRAFT_SOURCES), dtype=torch.long, device=device),
            accepted_by_source=torch.zeros(batch_size, len(DRAFT_SOURCES), dtype=torch.long, device=device),
            source_means=torch.full((batch_size, len(DRAFT_SOURCES)), float("nan"), device=device),
        )


@dataclass(frozen=True)
class StepCounts:
    """What the verify pass of one SD step did over the batch, per draft source: rows verified with
    drafts of that source (0 when the shape does not use it), and the accepted tokens it had
    proposed (a token both proposed counts for both)."""

    passes_by_source: dict[str, int]
    accepted_by_source: dict[str, int]


# weight of the newest verify pass in a row's running mean of accepted drafts per source (picks_source shapes)
SOURCE_SMOOTHING = 0.3

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
        # the drafter's decode-time copy computing in the measured linear forms (use_linear_plan), or None
        self.drafter_forms: FormedCopy | None = None
        self.schedule: ConfigSchedule = config if callable(config) else (lambda batch_size: config)
        # whether a shape may ask the n-gram index (None: a fixed shape says, a schedule may): if not, none is kept
        if uses_ngram is None:
            uses_ngram = config.uses_ngram if isinstance(config, SpeculativeConfig) else True
        self.keeps_index = uses_ngram
        # shapes already validated against the drafter's vocabulary
        self._checked: set[SpeculativeConfig] = set()
        if isinstance(config, SpeculativeConfig):
            self._check(config)
        self.state = DraftState.empty(0, 0, 0, 0, torch.float32, torch.device("cpu"))
        self.index = NgramIndex()
        self._indexed_tokens: list[int] = []  # per request of the call: response tokens the index has
        # the latest step's StepCounts (None after a plain step), for the adaptive schedule
        self.last_step: StepCounts | None = None
        # finished siblings of a row -> [verify passes, accepted draft tokens] of its n-gram steps this call
        self.by_finished_siblings: dict[int, list[int]] = {}

    def use_linear_plan(self, plan: LinearFormPlan) -> None:
        """Draft through a decode-time copy of the drafter whose linear layers compute in the plan's forms
        (tlt_cli/engine/linear_forms.py); the drafter the trainer updates is left as it is."""
        if self.drafter is not None:
            self.drafter_forms = FormedCopy(self.drafter, plan)

    @property
    def drafting(self) -> nn.Module | None:
        """The module that drafts: the drafter's formed copy, else the drafter."""
        return self.drafter_forms.module if self.drafter_forms is not None else self.drafter

    def begin(self, batch: RunningBatch, requests: Sequence[GroupedPrompt] = ()) -> None:
        """Start a generate call: the drafter's head (and its formed copy's transposed weights) re-read from the
        target and drafter (whose weights may have changed since the last call), empty drafter cache and counters
        (the drafter reads the prompt at the first SD step, from the target hidden states the engine keeps), and
        a fresh n-gram index over the requests' prompts (requests[i] is batch row i)."""
        device = batch.lengths.device
        if self.drafter is None:
            self.state = DraftState.empty(batch.size, 0, 0, 0, torch.float32, device)
        else:
            if self.drafter_forms is not None:
                self.drafter_forms.refresh()  # a few MiB: cheaper than tracking every way the drafter is updated
            self.drafting.refresh_draft_head()
            self.state = DraftState.empty(
                batch.size,
                batch.cache.capacity,
                self.drafter.config.hidden_size,
                self.drafter.vocabulary.size,
                next(self.drafter.parameters()).dtype,
                device,
            )
        self.index = NgramIndex()
        self._indexed_tokens = [0] * len(requests)
        self.by_finished_siblings = {}
        if self.keeps_index:
            for position, request in enumerate(requests):
                # a request without a group is a group of its own
                group = ("group", request.group) if request.group is not None else ("request", position)
                self.index.add_sequence(group, request.prompt_ids)

    def step(
        self, target: DecodeTarget, batch: RunningBatch, sampling: SamplingParams, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoding step; returns the emitted tokens [B, E] and counts [B]. With a shape: one
        draft-verify-accept-commit round; with None from the schedule: plain decoding."""
        config = self._config_for(batch.size)
        self.last_step = None
        if config is None:
            return target.decode_step(batch, sampling, generator)
        proposals = self._propose(batch, config.ngram_tokens) if config.uses_ngram else None
        # a picks_source shape: which rows verify their n-gram chain this step (the others the drafter's)
        ngram_rows = self._pick_ngram_rows(proposals) if config.picks_source else None
        drafts = config.uses_drafter and (ngram_rows is None or not bool(ngram_rows.all()))
        if drafts:
            self._catch_up(batch)
            tree = self._draft(batch, config, sampling, generator)
        else:
            tree = root_only(batch.pending)
        if ngram_rows is not None:
            tree = with_chosen_chains(tree, proposals, ngram_rows)
        elif proposals is not None:
            tree = with_ngram_branch(tree, proposals)
        hidden = target.forward_block(batch, tree.tokens, batch.lengths[:, None] + tree.depths, tree.ancestors)
        target_logits = target.logits(hidden)
        accept = accept_chain if config.is_chain and not config.uses_ngram else accept_tree
        verdict = accept(tree, target_logits, sampling, generator)
        self._count(batch, config, tree, verdict, ngram_rows)
        emitted = self._commit(batch, config, tree, verdict, hidden, drafts)
        return emitted, verdict.accept_length + 1

    def _pick_ngram_rows(self, proposals: list[list[int]]) -> torch.Tensor:
        """[B] bool: the rows that verify their n-gram proposal rather than the drafter's chain. A row tries
        the drafter first, then the n-gram index, then keeps to the one with the higher running mean of
        accepted drafts (ties: the drafter); a row with no proposal drafts with the model."""
        means = self.state.source_means
        drafter_mean, ngram_mean = means[:, DRAFT_SOURCES.index("drafter")], means[:, DRAFT_SOURCES.index("ngram")]
        proposes = torch.tensor([len(proposal) > 0 for proposal in proposals], device=means.device)
        return proposes & ~drafter_mean.isnan() & (ngram_mean.isnan() | (ngram_mean > drafter_mean))

    def _remember_sources(self, chosen: torch.Tensor, accept_length: torch.Tensor) -> None:
        """Fold each row's accepted drafts into the running mean of the source it verified (chosen: [B,
        len(DRAFT_SOURCES)] bool, `rows_by_source`)."""
        means = self.state.source_means
        observed = accept_length.to(means.dtype)[:, None].expand_as(means)
        updated = torch.where(means.isnan(), observed, (1 - SOURCE_SMOOTHING) * means + SOURCE_SMOOTHING * observed)
        self.state.source_means = torch.where(chosen, updated, means)

    def _config_for(self, batch_size: int) -> SpeculativeConfig | None:
        config = self.schedule(batch_size)
        if config is not None and config not in self._checked:
            self._check(config)
        return config

    def _check(self, config: SpeculativeConfig) -> None:
        if config.uses_drafter and self.drafter is None:
            raise ValueError(f"SD configuration {config.label()} drafts with a model, and there is no drafter.")
        if config.uses_ngram and not self.keeps_index:
            raise ValueError(f"SD configuration {config.label()} drafts n-grams, and this decoder keeps no index.")
        problem = shape_problem(config) or (
            topk_fit_problem(config, self.drafter.vocabulary.size) if config.uses_drafter else None
        )
        if problem is not None:
            raise ValueError(problem)
        self._checked.add(config)

    def _propose(self, batch: RunningBatch, max_tokens: int) -> list[list[int]]:
        """Each row's n-gram proposal (target ids, up to max_tokens) after the index learns its new tokens."""
        self._index_rows(batch, range(batch.size))
        return [self.index.propose(request, max_tokens) for request in batch.request_index.tolist()]

    def _index_rows(self, batch: RunningBatch, rows) -> None:
        """Give the index the response tokens `rows` emitted since it last saw them."""
        requests, prompt_lengths, generated = (
            batch.request_index.tolist(),
            batch.prompt_lengths.tolist(),
            batch.generated.tolist(),
        )
        for row in rows:
            request = requests[row]
            start, end = prompt_lengths[row] + self._indexed_tokens[request], prompt_lengths[row] + generated[row]
            if end > start:
                self.index.extend(request, batch.tokens[row, start:end].tolist())
                self._indexed_tokens[request] = generated[row]

    def _catch_up(self, batch: RunningBatch) -> None:
        """Feed the drafter every committed position it has not seen (the prompt, and whatever
        plain steps decoded): entry t pairs the stored target hidden state at t with token t+1."""
        gap = batch.lengths - self.state.drafter_lengths
        if not bool((gap > 0).any()):
            return
        width = int(gap.max())
        slots = self.state.drafter_lengths[:, None] + torch.arange(width, device=gap.device)
        stored_hidden = batch.cache.extra[:, 0]
        hidden = gather_rows(stored_hidden, slots.clamp(max=stored_hidden.shape[1] - 1))
        # token t+1 of every position up to the pending token at lengths[b]
        next_token_ids = batch.tokens.gather(1, (slots + 1).clamp(max=batch.tokens.shape[1] - 1))
        causal = torch.ones(width, width, dtype=torch.bool, device=gap.device).tril()
        output = self._run_drafter(next_token_ids, hidden, self.state.drafter_lengths, slots, causal, written=0)
        caught_up = gap > 0
        last_entry = (gap - 1).clamp(min=0)
        rows = torch.arange(batch.size, device=gap.device)
        state = self.state
        state.root_hidden = torch.where(caught_up[:, None], output.hidden[rows, last_entry], state.root_hidden)
        state.root_logits = torch.where(caught_up[:, None], output.logits[rows, last_entry], state.root_logits)
        state.drafter_lengths = batch.lengths.clone()

    def _draft(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> DraftTree:
        """Run the drafter `steps` times from each row's root, expanding the chain or tree."""
        vocabulary = self.drafter.vocabulary
        if config.is_chain:
            builder = ChainBuilder(batch.pending, config.steps, sampling, generator, vocabulary)
        else:
            builder = TreeBuilder(batch.pending, config.drafter_part, vocabulary)
        frontier_hidden, frontier_logits = self.state.root_hidden[:, None], self.state.root_logits[:, None]
        written = 0
        for step in range(config.steps):
            frontier = builder.expand(frontier_logits)
            if step == config.steps - 1:
                break
            # each node reads its parent's predicted hidden state, at the parent's position + 1
            parent_hidden = gather_rows(frontier_hidden, frontier.parent_slot)
            positions = (batch.lengths + step)[:, None].expand_as(frontier.tokens)
            output = self._run_drafter(
                frontier.tokens, parent_hidden, batch.lengths, positions, frontier.visible, written
            )
            frontier_hidden, frontier_logits = output.hidden, output.logits
            written += frontier.tokens.shape[1]
        return builder.finish()

    def _run_drafter(self, input_ids, target_hidden, lengths, positions, visible, written: int):
        """Drafter forward on entries written at slots lengths + written + [0, T), seeing the
        committed prefix and the region [lengths, lengths + written + T) as `visible` ([.., T, W]) says."""
        entries = input_ids.shape[1]
        write_slots = lengths[:, None] + written + torch.arange(entries, device=input_ids.device)
        kv_length = int(lengths.max()) + written + entries
        self.state.cache.prepare(write_slots, kv_length)
        mask = block_attention_mask(lengths, visible, kv_length)
        return self.drafting(input_ids, target_hidden, positions, mask, self.state.cache)

    def _commit(
        self,
        batch: RunningBatch,
        config: SpeculativeConfig,
        tree: DraftTree,
        verdict: Verdict,
        hidden: torch.Tensor,
        drafted: bool,
    ) -> torch.Tensor:
        """Move kept entries into place, catch the drafter up (if it drafted this step), advance the rows;
        return the emitted tokens [B, D + 1] (kept drafts, then the bonus at index accept_length)."""
        accept_length, path = verdict.accept_length, verdict.path
        offsets = torch.arange(path.shape[1], device=path.device)
        caught_up = int(accept_length.max()) + 1
        # chains (model-free, the drafter's, one source per row) keep their nodes in place; trees (a hybrid's
        # included) may branch
        branching = not config.is_chain or (config.uses_drafter and config.uses_ngram and not config.picks_source)
        if branching and caught_up > 1:
            # kept node path[j] moves from slot lengths + path[j] to lengths + j; others stay put
            source = torch.where(offsets[None, :] <= accept_length[:, None], path, offsets[None, :])
            batch.cache.move_slots(batch.lengths[:, None] + source, batch.lengths[:, None] + offsets[None, :])
        path_tokens = tree.tokens.gather(1, path)
        emitted = torch.cat([path_tokens[:, 1:], torch.zeros_like(path_tokens[:, :1])], dim=1)
        emitted.scatter_(1, accept_length[:, None], verdict.bonus[:, None])
        if drafted:
            self._drafter_reads(batch, emitted, hidden, verdict)
        batch.lengths = batch.lengths + accept_length + 1
        batch.pending = verdict.bonus
        if drafted:
            self.state.drafter_lengths = batch.lengths.clone()
        return emitted

    def _drafter_reads(
        self, batch: RunningBatch, emitted: torch.Tensor, hidden: torch.Tensor, verdict: Verdict
    ) -> None:
        """The drafter catches up on the kept tokens and the next root state is read off it (a
        model-free step skips this: the drafter catches up at its next step, as after plain steps)."""
        accept_length, path = verdict.accept_length, verdict.path
        offsets = torch.arange(path.shape[1], device=path.device)
        caught_up = int(accept_length.max()) + 1
        # drafter catch-up: entry at position lengths + j pairs target_hidden there with emitted[j]
        path_hidden = gather_rows(hidden, path[:, :caught_up])
        positions = batch.lengths[:, None] + offsets[None, :caught_up]
        causal = torch.ones(caught_up, caught_up, dtype=torch.bool, device=path.device).tril()
        output = self._run_drafter(emitted[:, :caught_up], path_hidden, batch.lengths, positions, causal, written=0)
        rows = torch.arange(path.shape[0], device=path.device)
        self.state.root_hidden = output.hidden[rows, accept_length]
        self.state.root_logits = output.logits[rows, accept_length]

    def _count(
        self,
        batch: RunningBatch,
        config: SpeculativeConfig,
        tree: DraftTree,
        verdict: Verdict,
        ngram_rows: torch.Tensor | None,
    ) -> None:
        """Per-row counters of the step; ngram_rows: a picks_source step's rows that verified n-gram drafts."""
        state = self.state
        missing_depths = max(config.steps, config.ngram_tokens) - state.accepted_by_depth.shape[1]
        if missing_depths > 0:
            state.accepted_by_depth = torch.nn.functional.pad(state.accepted_by_depth, (0, missing_depths))
            state.proposed_by_depth = torch.nn.functional.pad(state.proposed_by_depth, (0, missing_depths))
        depth_index = torch.arange(state.accepted_by_depth.shape[1], device=verdict.accept_length.device)
        state.verify_passes += 1
        state.accepted_draft_tokens += verdict.accept_length
        state.accepted_by_depth += depth_index[None, :] < verdict.accept_length[:, None]
        valid_depths = tree.depths if tree.valid is None else tree.depths.masked_fill(~tree.valid, 0)
        tree_depth = valid_depths.max(dim=1).values
        state.proposed_by_depth += depth_index[None, :] < tree_depth[:, None]
        if ngram_rows is None:
            uses = torch.tensor([config.uses_drafter, config.uses_ngram], device=depth_index.device)
            used = uses[None, :].expand(batch.size, -1)
        else:
            used = rows_by_source(ngram_rows)
            self._remember_sources(used, verdict.accept_length)
        self._count_sources(batch, tree, verdict, used)

    def _count_sources(self, batch: RunningBatch, tree: DraftTree, verdict: Verdict, used: torch.Tensor) -> None:
        """Accepted tokens per draft source (per row, for the step, and by finished siblings); used: [B,
        len(DRAFT_SOURCES)] bool, which sources drafted for each row this step."""
        offsets = torch.arange(verdict.path.shape[1], device=verdict.path.device)
        kept = (offsets[None, :] >= 1) & (offsets[None, :] <= verdict.accept_length[:, None])
        path_sources = tree.drafted_by().gather(1, verdict.path[:, :, None].expand(-1, -1, len(DRAFT_SOURCES)))
        accepted = (path_sources & kept[:, :, None]).sum(dim=1)  # [B, sources]
        self.state.passes_by_source += used.long()
        self.state.accepted_by_source += accepted
        totals, passes = accepted.sum(dim=0).tolist(), used.long().sum(dim=0).tolist()
        self.last_step = StepCounts(dict(zip(DRAFT_SOURCES, passes)), dict(zip(DRAFT_SOURCES, totals)))
        ngram_used = used[:, DRAFT_SOURCES.index("ngram")].tolist()
        if any(ngram_used):
            accepted_per_row = verdict.accept_length.tolist()
            for row, request in enumerate(batch.request_index.tolist()):
                if not ngram_used[row]:
                    continue
                counts = self.by_finished_siblings.setdefault(self.index.finished_siblings(request), [0, 0])
                counts[0] += 1
                counts[1] += accepted_per_row[row]

    def keep_rows(self, batch: RunningBatch, rows: torch.Tensor) -> None:
        """Keep only rows `rows` of the drafter cache and every per-row tensor; the other rows have
        finished: the index learns their last tokens first (call before the batch drops them)."""
        if self.keeps_index:
            leaving = sorted(set(range(batch.size)) - set(rows.tolist()))
            self._index_rows(batch, leaving)
            for row in leaving:
                self.index.finish(int(batch.request_index[row]))
        keep_rows_of(self.state, rows)

    def stats(self, row: int) -> SpeculativeStats:
        """What SD did for the request in `row` (acceptance as judged at verification, before any
        cut at EOS or max_new_tokens)."""
        return SpeculativeStats(
            verify_passes=int(self.state.verify_passes[row]),
            accepted_draft_tokens=int(self.state.accepted_draft_tokens[row]),
            accepted_by_depth=self.state.accepted_by_depth[row].tolist(),
            proposed_by_depth=self.state.proposed_by_depth[row].tolist(),
            passes_by_source=dict(zip(DRAFT_SOURCES, self.state.passes_by_source[row].tolist())),
            accepted_by_source=dict(zip(DRAFT_SOURCES, self.state.accepted_by_source[row].tolist())),
        )
