"""Model-free drafts: an n-gram index over the prompt and the sibling responses of a request's group.

In GRPO the G responses to one prompt share much of their text, and in the tail most of them
have finished. The n-gram proposer (tlt_cli/speculative/ngram_proposer.py) keeps one `NgramIndex` per
generate call: every request is a sequence (its prompt, then its response as tokens are emitted),
sequences of one group (RolloutRequest.group) share one table, and a finished sibling stays in it
after its row has left the running batch. `propose(sequence, k)` matches the sequence's last
1..max_match tokens against every earlier place in its group where they occurred (longest match
first) and returns up to k tokens that followed there: at each depth the token most of the
matching places continue with (ties: the most recent place), then only the places that agree go on.
Each row drafts what its own match supports (SuffixDecoding's rule): up to SHORT_DRAFT tokens whatever the
match, MATCH_FACTOR tokens per matched token beyond (the match measured back past max_match, so a row in a
repetition loop drafts the loop, up to k), and never a token under MIN_TOKEN_SHARE of the agreeing places.

A lookup is a few dictionary reads and a walk over at most `max_places` places, far less than a
drafter pass. The proposals are deterministic (point masses): verification keeps the output exact
whatever they are (tlt_cli/speculative/acceptance.py).

Example:
    index = NgramIndex()
    first = index.add_sequence(group=0, prompt_ids=[5, 6, 7])
    second = index.add_sequence(group=0, prompt_ids=[5, 6, 7])
    index.extend(first, [8, 9, 10])
    index.extend(second, [8])
    index.propose(second, 2)   # [9, 10]: what followed 7, 8 in the first response
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

DEFAULT_MAX_MATCH = 4  # longest suffix matched (tokens)
DEFAULT_MAX_PLACES = 32  # most recent places of a matched n-gram considered
# per-row draft length: any match may draft SHORT_DRAFT tokens; a longer one MATCH_FACTOR tokens per matched token
SHORT_DRAFT = 4
MATCH_FACTOR = 2
# a proposal stops before a token fewer than this share of the places still agreeing continue with
MIN_TOKEN_SHARE = 0.1


@dataclass
class _Group:
    """One group's table: n-gram (tuple of 1..max_match tokens) -> places (sequence, index of the
    token that followed it, which may not exist yet), oldest first."""

    table: dict[tuple[int, ...], list[tuple[int, int]]] = field(default_factory=dict)
    prompts: set[tuple[int, ...]] = field(default_factory=set)
    members: int = 0
    finished: int = 0


class NgramIndex:
    """n-gram tables over groups of growing token sequences (see the module docstring)."""

    def __init__(self, max_match: int = DEFAULT_MAX_MATCH, max_places: int = DEFAULT_MAX_PLACES) -> None:
        if max_match < 1 or max_places < 1:
            raise ValueError(f"max_match ({max_match}) and max_places ({max_places}) must be at least 1.")
        self.max_match = max_match
        self.max_places = max_places
        self.sequences: list[list[int]] = []
        self.groups: dict[Hashable, _Group] = {}
        self._group_of: list[_Group] = []
        self._finished: list[bool] = []

    def add_sequence(self, group: Hashable, prompt_ids: Sequence[int]) -> int:
        """A new sequence in `group` starting with `prompt_ids`; returns its id (0, 1, ... in order).

        A prompt the group has seen already is not indexed again (its places are the same), except
        for its last n-grams, whose continuation is this sequence's own first response tokens."""
        members = self.groups.setdefault(group, _Group())
        sequence = len(self.sequences)
        self.sequences.append([])
        self._group_of.append(members)
        self._finished.append(False)
        members.members += 1
        prompt = tuple(prompt_ids)
        seen = prompt in members.prompts
        members.prompts.add(prompt)
        self._append(sequence, prompt, first_indexed=len(prompt) - 1 if seen else 0)
        return sequence

    def extend(self, sequence: int, tokens: Sequence[int]) -> None:
        """Append emitted tokens to `sequence` and index the n-grams they end."""
        self._append(sequence, tokens, first_indexed=0)

    def _append(self, sequence: int, tokens: Sequence[int], first_indexed: int) -> None:
        """Append tokens; index the n-grams ending at each appended position from `first_indexed` on."""
        text = self.sequences[sequence]
        table = self._group_of[sequence].table
        start = len(text)
        text.extend(tokens)
        for end in range(start + first_indexed, len(text)):
            # the n-grams ending at `end`: their continuation is the token at end + 1
            for size in range(1, min(self.max_match, end + 1) + 1):
                table.setdefault(tuple(text[end + 1 - size : end + 1]), []).append((sequence, end + 1))

    def finish(self, sequence: int) -> None:
        """`sequence` has ended; it stays in its group's table."""
        if not self._finished[sequence]:
            self._finished[sequence] = True
            self._group_of[sequence].finished += 1

    def finished_siblings(self, sequence: int) -> int:
        """How many other sequences of `sequence`'s group have finished."""
        return self._group_of[sequence].finished - int(self._finished[sequence])

    def propose(self, sequence: int, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the longest match of the sequence's suffix in its group, as many as
        the match supports (`_draft_limit`), stopping before a token under MIN_TOKEN_SHARE of the agreeing places."""
        places, matched = self._places(sequence)
        limit = self._draft_limit(sequence, places, matched, max_tokens)
        proposal: list[int] = []
        while places and len(proposal) < limit:
            depth = len(proposal)
            # the token most places continue with; Counter keeps first-seen order, so ties go to the most recent
            following = Counter(self.sequences[place][start + depth] for place, start in places)
            token, count = following.most_common(1)[0]
            if count < MIN_TOKEN_SHARE * len(places):
                break
            proposal.append(token)
            places = [
                (place, start)
                for place, start in places
                if self.sequences[place][start + depth] == token and start + depth + 1 < len(self.sequences[place])
            ]
        return proposal

    def _draft_limit(self, sequence: int, places: list[tuple[int, int]], matched: int, max_tokens: int) -> int:
        """How many tokens a row may draft: SHORT_DRAFT (or max_tokens, if fewer) whatever its match, more where its
        suffix matches longer, MATCH_FACTOR tokens per matched token, up to max_tokens (SuffixDecoding's rule: a
        row in a repetition loop drafts the loop, a row with a one-token match a few tokens). The match is measured
        back from the indexed n-gram, beyond max_match, at the most recent place, only when it could matter."""
        if max_tokens <= SHORT_DRAFT or not places:
            return max_tokens
        text = self.sequences[sequence]
        place, start = places[0]
        earlier = self.sequences[place]
        longest = (max_tokens + MATCH_FACTOR - 1) // MATCH_FACTOR
        while matched < min(longest, start, len(text)) and earlier[start - matched - 1] == text[-matched - 1]:
            matched += 1
        return min(max_tokens, max(SHORT_DRAFT, MATCH_FACTOR * matched))

    def _places(self, sequence: int) -> tuple[list[tuple[int, int]], int]:
        """Places (sequence, start) where the longest matched suffix was followed by at least one
        token, most recent first, and that suffix's length (0: no match)."""
        text = self.sequences[sequence]
        table = self._group_of[sequence].table
        for size in range(min(self.max_match, len(text)), 0, -1):
            matches = table.get(tuple(text[len(text) - size :]))
            if not matches:
                continue
            places = [
                (place, start)
                for place, start in reversed(matches[-self.max_places :])
                if start < len(self.sequences[place])
            ]
            if places:
                return places, size
        return [], 0
