"""What `tlt_rollout()` did over a TRL run, printed when TRL's training ends: rollouts, SD's share, the verdict.

`TltRollout` adds each rollout's record to a `RolloutTally` and, on its first call, hands TRL's trainer an
`EndOfTrainingLine` callback, so a user's own script needs nothing more to hear, after `trainer.train()`:

    tlt rollout: done: 16 rollouts, 41.2 s decoding, SD in 63% of it; SD paid in this run: its steps decoded ...

The verdict is the one `tlt train`'s summary and `tlt profile` give (tlt_cli/sd_effect.py): SD's decode steps
against the same process's plain steps at the same batch sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from tlt_cli.sd_effect import RowsTiming, measured_sd_effect, record_timings, sd_effect_sentence
from tlt_cli.speculative.types import OFF


@dataclass
class RolloutTally:
    """This process's rollouts so far: their decode steps by configuration and batch size, and their drafts."""

    rollouts: int = 0
    process: int = 0
    processes: int = 1
    timings: list[RowsTiming] = field(default_factory=list)
    accepted_tokens: int = 0
    verify_passes: int = 0

    def add(
        self, rollout: int, process: int, processes: int, sd_usage: Mapping[str, dict], drafts: tuple[int, int]
    ) -> None:
        """One rollout's record (trl.py `RolloutRecord`): its number, this process and how many there are, its usage
        by SD configuration (ConfigUsage fields) and its (accepted draft tokens, verify passes)."""
        self.rollouts += 1
        self.process, self.processes = process, processes
        for label, usage in sd_usage.items():
            self.timings.extend(record_timings({**usage, "config": label, "step": rollout}))
        self.accepted_tokens += drafts[0]
        self.verify_passes += drafts[1]

    def line(self) -> str:
        """The end line (module docstring)."""
        decode_seconds = sum(timing.seconds for timing in self.timings)
        sd_seconds = sum(timing.seconds for timing in self.timings if timing.config != OFF)
        share = f", SD in {sd_seconds / decode_seconds:.0%} of it" if decode_seconds > 0 else ""
        effect = measured_sd_effect(self.timings, self.accepted_tokens, self.verify_passes)
        verdict = sd_effect_sentence(effect) if sd_seconds > 0 else "SD did not run."
        who = f"process {self.process}: " if self.processes > 1 else ""
        return f"{who}done: {self.rollouts} rollouts, {decode_seconds:.1f} s decoding{share}; {verdict}"


class EndOfTrainingLine(TrainerCallback):
    """Prints the tally's line once, when TRL's training ends (each process, naming itself when there are more)."""

    def __init__(self, tally: RolloutTally, say: Any) -> None:
        self.tally = tally
        self.say = say

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.say(self.tally.line())
