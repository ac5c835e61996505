"""The n-gram index as a draft source: each row's group of prompt and sibling responses, growing and finished,
and the earlier responses to its prompt (RolloutRequest.history).

The speculative decoder (tlt_cli/speculative/decoder.py) keeps one `NgramProposer` behind the `Proposer`
hooks (tlt_cli/speculative/proposer.py) when a shape may draft n-grams. `begin` starts a fresh
`NgramIndex` (tlt_cli/speculative/ngram.py) over the call's prompts, one sequence per request, the
requests of one group (RolloutRequest.group) sharing one table. The index learns every emitted token:
at the next step that asks it (`propose`), and when a row finishes, before it leaves the batch
(`keep_rows`), so finished siblings stay in it. `propose` returns each row's proposal (target ids, up
to the shape's ngram_tokens; a point mass per token, possibly none). After a step that verified n-gram
drafts (`after_commit`) it counts, by the number of the row's finished siblings, the verify passes and
accepted drafts: `by_finished_siblings`, which `tlt bench rollout` writes to its JSON.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tlt_cli.speculative.ngram import NgramIndex
from tlt_cli.speculative.types import DRAFT_SOURCES, NGRAM_SOURCE

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import torch

    from tlt_cli.engine.running_batch import RunningBatch
    from tlt_cli.engine.sampling import SamplingParams
    from tlt_cli.speculative.proposer import Commit, GroupedPrompt
    from tlt_cli.speculative.types import SpeculativeConfig


class NgramProposer:
    """Proposes what followed each row's last tokens in its group (see the module docstring)."""

    source = NGRAM_SOURCE

    def __init__(self) -> None:
        self.index = NgramIndex()
        self._indexed_tokens: list[int] = []  # per request of the call: response tokens the index has
        # finished siblings of a row -> [verify passes, accepted draft tokens] of its n-gram steps this call
        self.by_finished_siblings: dict[int, list[int]] = {}

    def begin(self, batch: RunningBatch, requests: Sequence[GroupedPrompt]) -> None:
        """A fresh index over the requests' prompts (requests[i] is batch row i, sequence i of the index), then
        each group's earlier responses (once a group), as finished sequences after them."""
        self.index = NgramIndex()
        self._indexed_tokens = [0] * len(requests)
        self.by_finished_siblings = {}
        groups = [
            # a request without a group is a group of its own
            ("group", request.group) if request.group is not None else ("request", position)
            for position, request in enumerate(requests)
        ]
        for group, request in zip(groups, requests):
            self.index.add_sequence(group, request.prompt_ids)
        with_history = {}
        for group, request in zip(groups, requests):
            if request.history:
                with_history.setdefault(group, request)
        for group, request in with_history.items():
            for response in request.history:
                sequence = self.index.add_sequence(group, request.prompt_ids)
                self.index.extend(sequence, response)
                self.index.finish(sequence)

    def propose(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> list[list[int]]:
        """Each row's n-gram proposal (target ids, up to config.ngram_tokens) after the index learns its new tokens."""
        self._index_rows(batch, range(batch.size))
        return [self.index.propose(request, config.ngram_tokens) for request in batch.request_index.tolist()]

    def after_commit(self, batch: RunningBatch, commit: Commit) -> None:
        """Count each row that verified n-gram drafts: its verify pass and accepted drafts, by its finished siblings."""
        ngram_used = commit.row_sources[:, DRAFT_SOURCES.index(self.source)].tolist()
        if not any(ngram_used):
            return
        accepted_per_row = commit.verdict.accept_length.tolist()
        for row, request in enumerate(batch.request_index.tolist()):
            if not ngram_used[row]:
                continue
            counts = self.by_finished_siblings.setdefault(self.index.finished_siblings(request), [0, 0])
            counts[0] += 1
            counts[1] += accepted_per_row[row]

    def keep_rows(self, batch: RunningBatch, rows: torch.Tensor) -> None:
        """The rows not kept have finished: the index learns their last tokens and keeps them as finished siblings."""
        leaving = sorted(set(range(batch.size)) - set(rows.tolist()))
        self._index_rows(batch, leaving)
        for row in leaving:
            self.index.finish(int(batch.request_index[row]))

    def _index_rows(self, batch: RunningBatch, rows: Iterable[int]) -> None:
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
