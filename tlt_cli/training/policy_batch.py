"""The rollout as the actor sees it: padded token tensors with masks, advantages and log-probs.

`build_policy_batch` turns a worker's completions into one `PolicyBatch` (right-padded
prompt+response sequences); `micro_batches` slices it into rows for the actor's DeepSpeed steps, and
`packed_micro_batches` into whole groups up to a token budget, which the actor runs packed
(packed_forward.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tlt_cli.rollout.types import Completion


@dataclass(frozen=True)
class PolicyBatch:
    """N sequences of prompt + response, right-padded to T.

    input_ids: [N,T]; attention_mask: [N,T] (1 on real tokens); response_mask: [N,T] (1 where
    the token at t is a response token, i.e. scored by the policy loss); advantages: [N];
    old_logprobs / ref_logprobs: [N,T] log-prob of the token at t, filled by the actor; rollout_logprobs:
    [N,T] its log-prob under the rollout model (0 off the response), when the rollout backend gave them;
    group_ids: [N] the GRPO group of each row (rows of a group are consecutive and share their prompt), when
    the batch was built by groups.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_token_count(self) -> int:
        return int(self.response_mask.sum())

    def with_logprobs(self, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None) -> PolicyBatch:
        return replace(self, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs)

    def slice(self, start: int, stop: int) -> PolicyBatch:
        """Rows start:stop, trimmed to the longest real sequence among them."""
        length = int(self.attention_mask[start:stop].sum(dim=1).max())

        def cut(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[start:stop, :length]

        return PolicyBatch(
            input_ids=cut(self.input_ids),
            attention_mask=cut(self.attention_mask),
            response_mask=cut(self.response_mask),
            advantages=self.advantages[start:stop],
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            rollout_logprobs=cut(self.rollout_logprobs),
            group_ids=None if self.group_ids is None else self.group_ids[start:stop],
        )

    def group_spans(self) -> list[tuple[int, int]]:
        """(start, stop) of each run of rows with one group id; each row alone without group_ids."""
        if self.group_ids is None:
            return [(row, row + 1) for row in range(self.size)]
        counts = torch.unique_consecutive(self.group_ids, return_counts=True)[1].tolist()
        stops = torch.tensor(counts).cumsum(0).tolist()
        return [(stop - count, stop) for count, stop in zip(counts, stops)]


def build_policy_batch(
    completions: list[Completion], advantages: torch.Tensor, pad_token_id: int, group_size: int | None = None
) -> PolicyBatch:
    """Right-pad prompt + response of each completion into one PolicyBatch, rows sorted by length.

    advantages[i] belongs to completions[i]. Sorting (stable, shortest first) makes each
    micro-batch hold sequences of similar length, so a long-tailed rollout does not pad every
    micro-batch to its longest response. With group_size (request_id // group_size is a row's group), the
    rows of a group stay together instead, groups sorted by their tokens, and the batch records group_ids:
    packed micro-batches take whole groups. rollout_logprobs come along when every completion has them.
    """
    order = _row_order(completions, group_size)
    completions = [completions[index] for index in order]
    advantages = advantages[order]
    sequences = [list(completion.prompt_ids) + list(completion.response_ids) for completion in completions]
    length = max(len(sequence) for sequence in sequences)
    count = len(sequences)
    input_ids = torch.full((count, length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((count, length), dtype=torch.long)
    response_mask = torch.zeros((count, length), dtype=torch.long)
    given = all(completion.rollout_logprobs is not None for completion in completions)
    rollout_logprobs = torch.zeros((count, length), dtype=torch.float32) if given else None
    for row, (completion, sequence) in enumerate(zip(completions, sequences)):
        input_ids[row, : len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
        response_mask[row, len(completion.prompt_ids) : len(sequence)] = 1
        if given:
            rollout_logprobs[row, len(completion.prompt_ids) : len(sequence)] = completion.rollout_logprobs.cpu()
    group_ids = None
    if group_size is not None:
        group_ids = torch.tensor([completion.request_id // group_size for completion in completions])
    return PolicyBatch(
        input_ids,
        attention_mask,
        response_mask,
        advantages.float(),
        rollout_logprobs=rollout_logprobs,
        group_ids=group_ids,
    )


def _row_order(completions: list[Completion], group_size: int | None) -> list[int]:
    """Rows shortest first; with group_size, groups fewest tokens first (a prompt counted once) and each
    group's rows in request order."""

    def tokens(index: int) -> int:
        return len(completions[index].prompt_ids) + len(completions[index].response_ids)

    if group_size is None:
        return sorted(range(len(completions)), key=tokens)
    groups: dict[int, list[int]] = {}
    for index in sorted(range(len(completions)), key=lambda index: completions[index].request_id):
        groups.setdefault(completions[index].request_id // group_size, []).append(index)

    def group_tokens(rows: list[int]) -> int:
        return len(completions[rows[0]].prompt_ids) + sum(len(completions[row].response_ids) for row in rows)

    return [index for rows in sorted(groups.values(), key=group_tokens) for index in rows]


def micro_batches(batch: PolicyBatch, micro_batch_size: int) -> list[PolicyBatch]:
    """Consecutive slices of at most micro_batch_size rows."""
    return [
        batch.slice(start, min(start + micro_batch_size, batch.size))
        for start in range(0, batch.size, micro_batch_size)
    ]
