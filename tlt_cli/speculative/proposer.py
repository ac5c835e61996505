"""What a draft source is to the speculative decoder: one small interface, one implementation per source.

The decoder (tlt_cli/speculative/decoder.py) drafts, verifies, accepts and commits; where drafts come
from is a `Proposer`'s business, as in vLLM's and SGLang's proposers: the drafter
(tlt_cli/speculative/drafter_proposer.py: its cache, its catch-up, its chain or tree) and the n-gram index
(tlt_cli/speculative/ngram_proposer.py: the prompt and sibling responses of each row's group). Each keeps
its own per-row state and hears of the call's life through the same hooks:

    proposer.begin(batch, requests)                              # after the prefill
    proposal = proposer.propose(batch, config, sampling, generator)  # an SD step using the source
    proposer.after_commit(batch, commit)                         # that step's kept tokens are in place
    proposer.keep_rows(batch, rows)                              # before the batch drops finished rows

Proposals differ by source (the drafter's is a DraftTree, the index's a list of token ids per row);
the decoder merges them into the one tree the target verifies (tlt_cli/speculative/tree.py), and
acceptance (tlt_cli/speculative/acceptance.py) judges every source under one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from tlt_cli.engine.running_batch import RunningBatch
    from tlt_cli.engine.sampling import SamplingParams
    from tlt_cli.speculative.acceptance import Verdict
    from tlt_cli.speculative.types import SpeculativeConfig

Proposal = TypeVar("Proposal", covariant=True)


class GroupedPrompt(Protocol):
    """What speculative decoding reads of a request (a RolloutRequest has all three): the prompt the n-gram
    index starts from, the group whose responses draft from each other (None: a group of its own), and earlier
    responses to the prompt that draft for the group too."""

    prompt_ids: tuple[int, ...]
    group: int | None
    history: tuple[Sequence[int], ...]


@dataclass(frozen=True)
class Commit:
    """What one verify pass kept, as the proposers that drafted for it read it after the commit (the
    batch's lengths and pending tokens already advanced). D + 1 = the verified tree's widest path."""

    lengths: torch.Tensor  # [B] committed length before the step: the position of the root (the pending token)
    emitted: torch.Tensor  # [B, D + 1] kept drafts, then the bonus token at index accept_length
    target_hidden: torch.Tensor  # [B, nodes, H] the target's last hidden state at every verified node
    verdict: Verdict  # accept_length [B] and path [B, D + 1] (tree index of each kept node)
    row_sources: torch.Tensor  # [B, len(DRAFT_SOURCES)] bool, which sources drafted for each row


class Proposer(Protocol[Proposal]):
    """One draft source (see the module docstring); `source` is its name in DRAFT_SOURCES."""

    source: str

    def begin(self, batch: RunningBatch, requests: Sequence[GroupedPrompt]) -> None:
        """Fresh per-row state for a generate call (requests[i] is batch row i)."""

    def propose(
        self, batch: RunningBatch, config: SpeculativeConfig, sampling: SamplingParams, generator: torch.Generator
    ) -> Proposal:
        """This step's drafts for every row of `batch`, in the shape `config` asks of this source."""

    def after_commit(self, batch: RunningBatch, commit: Commit) -> None:
        """Learn what the step that used this source's proposal kept."""

    def keep_rows(self, batch: RunningBatch, rows: torch.Tensor) -> None:
        """Keep only rows `rows` ([B'] indices) of the per-row state; the batch still holds every row."""
