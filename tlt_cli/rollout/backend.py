"""The rollout-backend interface: what a trainer asks of whatever generates its rollouts.

A worker (tlt_cli/training/worker_loop.py), or any other trainer, holds one `RolloutBackend` and uses only this:

    lines = backend.start()                       # before the first rollout; lines for the log
    completions, busy_end = backend.generate(requests, sampling, seed, on_request_finished)
    ...actor update...
    metrics = backend.after_update("step-1", drafter_version, probe_prompts)   # weight push + probe
    usage, warnings = backend.take_usage(), backend.take_warnings()           # per step, for the trace
    if backend.drafter_diverged():                # the last rollout finished without its drafter's drafts
        backend.drafter_replaced(turned_off=False)                            # fresh weights given in place
    backend.save_state(path) / backend.load_state(path)                       # with the checkpoint
    backend.stop()                                                            # however the run ends

Two implementations, chosen by name from the recipe's `rollout.backend` in the composition root
(tlt_cli/training/rollout_backends.py, `BACKEND_FACTORIES`):
  - `embedded` (tlt_cli/rollout/embedded.py): the in-process engine on the actor's own module, so
    there is nothing to start, push or stop; constructible without a recipe or a worker;
  - `sglang` (tlt_cli/sglang/rollout.py): this worker's SGLang servers, imported only when chosen so
    the CPU path never loads the SGLang package.
`sampling_seed(seed, step, rank)` is the seed every trainer hands `generate` (run.seed's range, `MAX_SEED` in
tlt_cli/config/schema.py, keeps it within the generators' 64 bits). This module imports neither torch nor SGLang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tlt_cli.engine.sampling import SamplingParams
    from tlt_cli.rollout.types import Completion, RolloutRequest
    from tlt_cli.speculative.types import ConfigUsage


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """All sampling randomness of one rollout, from (run.seed, step, rank): a resumed step draws the same samples."""
    return (seed * 1_000_003 + step) * 1009 + rank


class RolloutBackend(Protocol):
    """Generates a trainer's rollouts and keeps its generator in step with the trained weights."""

    def start(self) -> list[str]:
        """Get ready to generate (SGLang: start the servers); lines to show in the log."""

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: SamplingParams,
        seed: int,
        on_request_finished: Callable[[Completion], None] | None = None,
    ) -> tuple[list[Completion], float]:
        """Complete every request; (completions sorted by request id, time.time() when the last finished).

        seed: all sampling randomness (the same seed, requests and weights give the same samples).
        on_request_finished: called once per completion, in the order they finished.
        Each completion carries its `rollout_logprobs` (log_softmax(logits)[token] at temperature 1, as tlt's
        learner defines them) where the backend can give them, else None.
        """

    def after_update(
        self, weight_version: str, drafter_version: float | None, probe_prompts: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """The actor's weights changed: bring the generator up to date; metrics of the step.

        weight_version: a name for the new weights (e.g. "step-3"). drafter_version: the drafter's
        version if a plugin trains it (a changed version is pushed too), else None. probe_prompts:
        prompt ids to check acceptance on after the push (empty: no probe).
        """

    def take_usage(self) -> dict[str, ConfigUsage]:
        """Decode steps, tokens and seconds per SD configuration label since the last call."""

    def take_warnings(self) -> list[str]:
        """Warnings since the last call (SD collapse or recovery, weight-sync notes), each once."""

    def drafter_diverged(self) -> bool:
        """Whether the drafter's drafts stopped being finite in the latest `generate` (it finished without them)."""

    def drafter_replaced(self, turned_off: bool) -> None:
        """The drafter diverged and got fresh weights in place; turned_off: no rollout drafts with it again."""

    def save_state(self, path: Path) -> None:
        """Save what must survive a resume (the adaptive schedule's learning) to `path`, if anything."""

    def load_state(self, path: Path) -> None:
        """Restore what `save_state` wrote to `path`."""

    def stop(self) -> None:
        """Release what `start` took (idempotent; also safe when `start` never ran)."""
