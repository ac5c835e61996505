"""Earlier responses to the same prompt, kept across steps as n-gram draft sources.

In RL over a dataset the same prompt comes back every epoch, and its new responses repeat much of its old ones
(SPEC-RL: 50-70% of a response overlaps the same prompt's response in the previous epoch; verl's histoSpec drafts
from a per-request history). `ResponseHistory` keeps, per prompt (its token ids), the last RESPONSES_PER_PROMPT
responses the rollout produced for it, for the PROMPTS prompts seen most recently. `attached(requests)` hands each
request its prompt's earlier responses (RolloutRequest.history), which the n-gram proposer indexes beside the
prompt and the siblings of the request's group (tlt_cli/speculative/ngram_proposer.py); `record(completions)`
adds a call's responses once it ends. Drafts are only proposals that the target verifies, so the history changes
speed, never the distribution of what is sampled. The embedded rollout backend (embedded.py) keeps one per worker
whose decoder drafts from the n-gram index (none with SD off or drafter-only configurations, where nothing reads it)
and saves it beside its SD schedule at each checkpoint, so a resumed run drafts as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

from tlt_cli.rollout.types import Completion, RolloutRequest

# responses kept per prompt: one GRPO group's worth at the default group size
RESPONSES_PER_PROMPT = 4
# prompts kept, the least recently seen dropped first: at most 2048 x (4 x 512-token responses and a 300-token
# prompt) x 4 bytes, about 19 MB of token ids (kept as int32 arrays, not Python ints)
PROMPTS = 2048


class ResponseHistory:
    """The last responses per prompt (see the module docstring), as int32 arrays keyed by the prompt's bytes."""

    def __init__(self, responses_per_prompt: int = RESPONSES_PER_PROMPT, prompts: int = PROMPTS) -> None:
        self.responses_per_prompt = responses_per_prompt
        self.prompts = prompts
        self._responses: OrderedDict[bytes, deque[array]] = OrderedDict()

    def attached(self, requests: Sequence[RolloutRequest]) -> list[RolloutRequest]:
        """The requests, each with its prompt's earlier responses (oldest first) as its history."""
        return [
            dataclasses.replace(request, history=tuple(self._responses.get(token_bytes(request.prompt_ids), ())))
            for request in requests
        ]

    def record(self, completions: Sequence[Completion]) -> None:
        """Keep each completion's response under its prompt, dropping the oldest beyond the bounds."""
        for completion in completions:
            if not completion.response_ids:
                continue
            prompt = token_bytes(completion.prompt_ids)
            kept = self._responses.pop(prompt, None) or deque(maxlen=self.responses_per_prompt)
            kept.append(array("i", completion.response_ids))
            self._responses[prompt] = kept
        while len(self._responses) > self.prompts:
            self._responses.popitem(last=False)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the prompts in order of last use with their responses, as lists of ids."""
        return {
            "prompts": [
                [array("i", prompt).tolist(), [response.tolist() for response in kept]]
                for prompt, kept in self._responses.items()
            ]
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned."""
        self._responses.clear()
        for prompt, responses in state["prompts"]:
            kept = deque((array("i", response) for response in responses), maxlen=self.responses_per_prompt)
            self._responses[token_bytes(prompt)] = kept


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """A prompt's ids as the history's key: their int32 bytes."""
    return array("i", token_ids).tobytes()


def history_path(schedule_path: Path) -> Path:
    """Where a checkpoint keeps a worker's response history: beside its SD schedule's state file."""
    return schedule_path.with_name(f"{schedule_path.stem}-responses.pt")
