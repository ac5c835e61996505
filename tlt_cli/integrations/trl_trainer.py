"""TRL's GRPOTrainer, timing the phases of each generation batch for tlt's trace.

`TimedGRPOTrainer` is `trl.GRPOTrainer` with three methods wrapped, nothing else changed: each
generation batch gets a `GenerationTimes` with
  start       generation begins (`_generate`: the rollout_func, or TRL's own generation);
  busy_end    this process's completions are done (TRL's own generation: `_generate_single_turn`
              returned; tlt's rollout reports its own, tlt_cli/integrations/trl.py);
  idle_end    `_generate` returned: TRL's first gather after generation waited for every process;
  scored_end  `_generate_and_score_completions` returned: rewards, advantages and any
              reference/old log-prob forwards done.
What follows until the optimizer step (the loss forward/backward per micro-batch and the step
itself) is the update. tlt_cli/integrations/trl_run.py reads them with `take_generations()`.
Only a TRL process imports this module (it imports TRL).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from trl import GRPOTrainer


@dataclass
class GenerationTimes:
    """One generation batch in this process (time.time() seconds; see the module docstring)."""

    start: float
    busy_end: float | None = None
    idle_end: float = 0.0
    scored_end: float = 0.0
    prompt_lengths: list[int] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer recording a `GenerationTimes` per generation batch."""

    def __init__(self, *arguments: Any, **keywords: Any) -> None:
        super().__init__(*arguments, **keywords)
        self.generations: list[GenerationTimes] = []

    def take_generations(self) -> list[GenerationTimes]:
        """The generation batches since the last call, oldest first."""
        generations, self.generations = self.generations, []
        return generations

    def _generate(self, prompts: list) -> tuple:
        times = GenerationTimes(start=time.time())
        self.generations.append(times)
        result = super()._generate(prompts)
        times.idle_end = time.time()
        times.prompt_lengths = [len(ids) for ids in result[0]]
        times.completion_ids = [list(ids) for ids in result[1]]
        return result

    def _generate_single_turn(self, *arguments: Any, **keywords: Any) -> tuple:
        result = super()._generate_single_turn(*arguments, **keywords)
        self.generations[-1].busy_end = time.time()
        return result

    def _generate_and_score_completions(self, inputs: list) -> dict:
        output = super()._generate_and_score_completions(inputs)
        self.generations[-1].scored_end = time.time()
        return output
