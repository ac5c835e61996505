"""Data passed into and out of a rollout backend.

The trainer builds `RolloutRequest`s and a backend (the embedded engine, SGLang) turns them into
`Completion`s under one `SamplingParams` (tlt_cli/engine/sampling.py); each Completion carries what
speculative decoding did for it (`SpeculativeStats`, tlt_cli/speculative/types.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tlt_cli.speculative.types import SpeculativeStats

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RolloutRequest:
    """One response to generate. prompt_ids: [P] token ids of the prompt.

    group: the requests of one group (GRPO's G samples of one prompt) draft from each other's text
    with n-gram proposals (tlt_cli/speculative/ngram.py); None: the request is a group of its own.
    history: earlier responses to the same prompt (earlier epochs), n-gram draft sources of its group too
    (tlt_cli/rollout/response_history.py).
    """

    request_id: int
    prompt_ids: tuple[int, ...]
    group: int | None = None
    history: tuple[Sequence[int], ...] = field(default=(), compare=False)


@dataclass
class Completion:
    """A finished request. response_ids: [R] generated ids, ending with EOS if finished_by_eos.

    start / end: wall-clock seconds (time.time()) when the request entered and left the
    running batch.
    """

    request_id: int
    prompt_ids: tuple[int, ...]
    response_ids: list[int]
    finished_by_eos: bool
    start: float
    end: float
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)
    # [R, H] target last hidden state that produced each response token; only when asked for
    target_hidden: torch.Tensor | None = None
    # [R] float32 log-prob of each response token under the rollout model (its dtype), by the learner's
    # definition log_softmax(logits / temperature)[token] (tlt_cli/engine/logprobs.py); None: not asked for
    rollout_logprobs: torch.Tensor | None = None
