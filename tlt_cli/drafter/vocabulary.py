"""The drafter's vocabulary: which target tokens it can propose, and the map from its ids to the target's.

A drafter over a 50k-150k token vocabulary spends most of a draft step, and most of a training
step, in its head. A reduced draft vocabulary keeps only the N target tokens the target itself
emits most often (EAGLE-3's draft vocabulary, SGLang's `--speculative-token-map`): the drafter's
head and loss run over those N tokens, and every drafted id is mapped back to the target's id
before verification. Verification stays over the full vocabulary, so decoding stays lossless; the
draft distribution q is simply zero on the other V - N tokens.

A run's responses are the best guide to what its drafter should propose: the drafter sidecar counts the tokens
every response emits and, at each rollout end, moves the vocabulary to the N most emitted (`follow_responses`),
in place, so every copy of the drafter (the engine's formed copy shares the object) drafts over the new tokens at
its next head refresh. The drafter's trained weights do not depend on which N tokens are drafted: its head is the
target's own rows.

`DraftVocabulary.target_ids[i]` is the target id of draft token i, ascending (EAGLE-3 stores the
same list as offsets, d2t[i] = target_ids[i] - i; SGLang reads the list itself, see
tlt_cli/sglang/drafter_format.py `save_token_map`). The warm-ups (tlt's and the TRL integration's) pick the tokens with
`choose_vocabulary`; the drafter, the
speculative decoder and `tlt export-drafter` use the result.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

# targets with at most this many tokens draft over all of them (the head is already cheap)
FULL_VOCABULARY_LIMIT = 4096
# draft tokens kept for larger targets (see BENCHMARKS.md, "Drafter on a real vocabulary")
REDUCED_VOCABULARY_SIZE = 8192


def default_draft_vocab_size(target_vocab_size: int) -> int:
    """The draft vocabulary size a recipe gets with `drafter.vocab_size: 0` (auto)."""
    if target_vocab_size <= FULL_VOCABULARY_LIMIT:
        return target_vocab_size
    return REDUCED_VOCABULARY_SIZE


def resolve_draft_vocab_size(setting: int, target_vocab_size: int) -> int:
    """`drafter.vocab_size` as drafted over: 0 is the default for the target, larger than V is V."""
    if setting == 0:
        return default_draft_vocab_size(target_vocab_size)
    return min(setting, target_vocab_size)


@dataclass(frozen=True)
class DraftVocabulary:
    """The target tokens a drafter proposes.

    target_ids: [N] int64, ascending, the target id of each draft token, or None for the full
    vocabulary (draft id = target id); target_size: V, the target's vocabulary size.
    """

    target_ids: torch.Tensor | None
    target_size: int

    def __post_init__(self) -> None:
        ids = self.target_ids
        if ids is None:
            return
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.target_size:
            raise ValueError(
                f"draft vocabulary target ids must be a non-empty 1-D list of ids below {self.target_size}."
            )

    @classmethod
    def full(cls, target_size: int) -> DraftVocabulary:
        return cls(None, target_size)

    @property
    def size(self) -> int:
        """N, the number of draft tokens."""
        return self.target_size if self.target_ids is None else int(self.target_ids.shape[0])

    @property
    def is_reduced(self) -> bool:
        return self.target_ids is not None

    def to(self, device: torch.device) -> DraftVocabulary:
        if self.target_ids is None or self.target_ids.device == device:
            return self
        return DraftVocabulary(self.target_ids.to(device), self.target_size)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> the target's ids of the same tokens."""
        if self.target_ids is None:
            return draft_ids
        return self.target_ids[draft_ids]

    def to_target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """A distribution over draft tokens [..., N] -> the same distribution over target tokens
        [..., V], zero on every token outside the draft vocabulary."""
        if self.target_ids is None:
            return draft_probs
        target_probs = draft_probs.new_zeros(*draft_probs.shape[:-1], self.target_size)
        return target_probs.index_copy_(-1, self.target_ids, draft_probs)

    def follow_responses(self, emitted_counts: torch.Tensor) -> None:
        """Become, in place, the N tokens emitted most often (emitted_counts: [V], how often each target token was
        emitted); a token kept now loses its place only to one emitted more often, so ties keep the vocabulary."""
        if self.target_ids is None:
            return
        counts = emitted_counts.detach().to(device="cpu", dtype=torch.float64).clone()
        counts[self.target_ids.cpu()] += 0.5
        # a stable sort keeps equal counts in id order
        ranked = counts.sort(descending=True, stable=True).indices[: self.size]
        self.target_ids.copy_(ranked.sort().values.to(self.target_ids.device))

    def restrict(self, target_logits: torch.Tensor) -> torch.Tensor:
        """Target logits [..., V] -> their entries for the draft tokens [..., N]."""
        if self.target_ids is None:
            return target_logits
        return target_logits.index_select(-1, self.target_ids)


def choose_vocabulary(
    responses: Iterable[Sequence[int]], draft_vocab_size: int, target_vocab_size: int, eos_token_id: int
) -> DraftVocabulary:
    """The draft vocabulary a warm-up trains over: the `draft_vocab_size` tokens (the recipe's
    `drafter.vocab_size`; 0: the default for the target) the target emitted most often in its
    `responses`, EOS always among them."""
    size = resolve_draft_vocab_size(draft_vocab_size, target_vocab_size)
    return most_frequent_tokens(responses, target_vocab_size, size, [eos_token_id])


def most_frequent_tokens(
    sequences: Iterable[Sequence[int]], target_size: int, size: int, required_ids: Sequence[int] = ()
) -> DraftVocabulary:
    """The `size` target tokens seen most often in `sequences` (ties: the lower id), always with
    `required_ids` (e.g. EOS); the full vocabulary when size >= target_size.

    Tokens never seen fill the remaining places in id order, so the result always has `size` ids.
    """
    if size >= target_size:
        return DraftVocabulary.full(target_size)
    if len(set(required_ids)) > size:
        raise ValueError(f"a draft vocabulary of {size} tokens cannot hold the {len(set(required_ids))} required ones.")
    counts = torch.zeros(target_size, dtype=torch.float64)
    for sequence in sequences:
        counts += torch.bincount(torch.as_tensor(list(sequence), dtype=torch.long), minlength=target_size).double()
    # required tokens rank above every counted one
    counts[list(required_ids)] = float("inf")
    # a stable sort keeps equal counts in id order
    ranked = counts.sort(descending=True, stable=True).indices
    return DraftVocabulary(ranked[:size].sort().values, target_size)


def token_coverage(sequences: Iterable[Sequence[int]], vocabulary: DraftVocabulary) -> float:
    """Fraction of the tokens in `sequences` that the draft vocabulary contains."""
    if not vocabulary.is_reduced:
        return 1.0
    kept = torch.zeros(vocabulary.target_size, dtype=torch.bool)
    kept[vocabulary.target_ids.cpu()] = True
    total = covered = 0
    for sequence in sequences:
        ids = torch.as_tensor(list(sequence), dtype=torch.long)
        total += ids.numel()
        covered += int(kept[ids].sum())
    return covered / max(total, 1)
