"""The embedded rollout backend: the in-process engine on the trainer's own policy module.

`EmbeddedRollout` is tlt_cli/rollout/backend.py's RolloutBackend around tlt_cli/rollout/generate_loop.py's
EmbeddedEngine (`rollout.backend: embedded`). It generates with the very module the trainer
updates, so there is nothing to start, to push after an update, or to stop. It needs no recipe and
no worker: a policy module, its EOS and pad ids, the speculative plan (tlt_cli/speculative/plan.py, plain
values: under `tlt train` the run's plan carries it, made once by the driver, tlt_cli/tuning/run_plan.py) and,
to speculate, a drafter over that policy, which is all a trainer of another library has in its own process:

    plan = SpeculativePlan(SpeculationMode.fixed, SpeculativeConfig(3, 1, 4), (), 1.3, 64, 0.0)  # s3-k1-t4
    rollout = EmbeddedRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id, plan, drafter, seed=0)
    completions, busy_end = rollout.generate(requests, SamplingParams(max_new_tokens=128), seed=step)
    usage = rollout.take_usage()  # adaptive SD: decode steps, tokens and seconds per configuration

`decode` is the `DecodePlan` (decode_plan.py) resolved above it (under `tlt train` part of the run's plan),
measuring nothing here: the dtype the policy is decoded in, the linear-form plan (each linear layer of the
policy and drafter computed, while decoding, in the form measured fastest on this machine for the pass's rows,
carried out by tlt_cli/engine/linear_forms.py; its transposed copies are the decode model's, refreshed by
`after_update`) and, for `speculative.mode: auto`, the pass costs the SD configuration is chosen with. None:
float32, plain forms.
`start()` puts the plan's lines in the run log.

The owned decode forward's own weight copies (fused q/k/v and gate/up, transposed or cast: about 0.5 GB for
SmolLM2-135M) live only from `after_update` to the end of the next `generate`: `generate` frees them on its
way out so that the trainer's update, which comes next, has their memory, and `after_update` rebuilds them
(a `generate` without an `after_update` before it rebuilds them itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from tlt_cli.checkpoint import CheckpointError, load_checkpoint_file
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.response_history import ResponseHistory, history_path
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.speculative.cost_schedule import CostSchedule
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder, speculative_decoder
from tlt_cli.speculative.plan import SpeculativePlan
from tlt_cli.speculative.schedule_state import missing_schedule_state, restored_schedule
from tlt_cli.speculative.types import ConfigUsage


class EmbeddedRollout:
    """Rollouts in this process on `policy` (see the module docstring).

    speculative: the speculative plan (None: SD off); drafter: the drafter over
    `policy` to speculate with (None: SD off). seed: the adaptive schedule's draws. decode: how it decodes (see
    the module docstring; None: float32, plain forms, no pass costs). drafter_trained: False for a fresh drafter,
    which mode auto keeps off until a drafter_version reaches `after_update`.
    """

    def __init__(
        self,
        policy: nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        speculative: SpeculativePlan | None = None,
        drafter: nn.Module | None = None,
        seed: int = 0,
        decode: DecodePlan | None = None,
        drafter_trained: bool = True,
    ) -> None:
        self.decode = decode if decode is not None else DecodePlan()
        decoder = (
            speculative_decoder(speculative, drafter, seed, self.decode.pass_costs) if speculative is not None else None
        )
        self.schedule = decoder.adaptive_schedule if isinstance(decoder, AdaptiveSpeculativeDecoder) else None
        # earlier responses per prompt, n-gram draft sources when the prompt comes back; kept only where the
        # decoder keeps an n-gram index, which reads them (None: SD off, or no configuration drafts n-grams)
        drafts_ngrams = decoder is not None and decoder.ngram_proposer is not None
        self.history = ResponseHistory() if drafts_ngrams else None
        self.warnings: list[str] = []  # the backend's own, beside the schedule's
        if not drafter_trained and isinstance(self.schedule, CostSchedule):
            self.schedule.drafter_untrained()
        # the drafter version the schedule's measurements are of (StepContext.drafter_version; None: not trained)
        self.drafter_version: float | None = None
        self.engine = EmbeddedEngine(
            policy,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            speculative=decoder,
            linear_plan=self.decode.linear_plan,
            dtype=self.decode.torch_dtype,
            stochastic_rounding=self.decode.stochastic_rounding,
        )

    def start(self) -> list[str]:
        """Nothing to start: the engine runs in this process; its decode path, for the log (the plan's lines are
        the driver's)."""
        return [self.engine.decode_model.describe()]

    def generate(
        self,
        requests: Sequence[RolloutRequest],
        sampling: SamplingParams,
        seed: int,
        on_request_finished: Callable[[Completion], None] | None = None,
    ) -> tuple[list[Completion], float]:
        """The engine's completions sorted by request id, with their rollout log-probs (temperature 1, the
        learner's definition); every random draw comes from `seed` (policy's device)."""
        generator = torch.Generator(self.engine.device).manual_seed(seed)
        if self.history is not None:
            requests = self.history.attached(requests)
        completions = self.engine.generate(
            requests, sampling, generator, on_request_finished=on_request_finished, logprob_temperature=1.0
        )
        if self.history is not None:
            self.history.record(completions)
        busy_end = time.time()
        # the trainer's update comes next: it has the copies' memory until after_update rebuilds them
        self.engine.decode_model.release()
        return sorted(completions, key=lambda completion: completion.request_id), busy_end

    def after_update(
        self, weight_version: str, drafter_version: float | None, probe_prompts: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """Nothing to push: the engine generates from the updated module's weights; only its decode model's
        copies (freed by `generate` for the update) are rebuilt. A drafter that trained since the last call (a new
        drafter_version) has what the cost model measured of it discounted (speculative/cost_schedule.py)."""
        self.refresh_copies()
        if drafter_version is not None and drafter_version != self.drafter_version:
            self.drafter_version = drafter_version
            if isinstance(self.schedule, CostSchedule):
                self.schedule.drafter_changed()
        return {}

    def drafter_diverged(self) -> bool:
        """Whether the drafter's drafts stopped being finite in the latest `generate` (the decoder then finished the
        call without the drafter: speculative/decoder.py)."""
        decoder = self.engine.speculative
        return decoder is not None and decoder.drafter_diverged

    def drafter_replaced(self, turned_off: bool) -> None:
        """The drafter got fresh weights in place: mode auto keeps it off (n-grams or plain decoding) until it has
        trained, as for a fresh drafter at the start; turned_off: no later step drafts with it."""
        if isinstance(self.schedule, CostSchedule):
            self.schedule.drafter_untrained()
        if turned_off:
            self.engine.speculative.drafter_off = True

    def refresh_copies(self) -> None:
        """Copy the policy's current weights into the decode model's own tensors (the drafter's formed copy
        re-reads its own at the start of every generate call)."""
        self.engine.decode_model.refresh()

    @property
    def copy_bytes(self) -> int:
        """Bytes of the engine's own weight copies now: the decode model's, and the drafter's formed copy's."""
        decoder = self.engine.speculative
        drafter_forms = decoder.drafter_forms if decoder is not None else None
        return self.engine.decode_model.extra_bytes + (drafter_forms.extra_bytes if drafter_forms is not None else 0)

    def take_usage(self) -> dict[str, ConfigUsage]:
        return self.schedule.take_usage() if self.schedule is not None else {}

    def take_warnings(self) -> list[str]:
        warnings, self.warnings = self.warnings, []
        return warnings + (self.schedule.take_warnings() if self.schedule is not None else [])

    def save_state(self, path: Path) -> None:
        """The adaptive schedule's state at `path` (nothing without one), and the response history beside it
        (response_history.py `history_path`; nothing where no configuration drafts from the n-gram index)."""
        if self.schedule is not None:
            torch.save(self.schedule.state_dict(), path)
        if self.history is not None:
            torch.save(self.history.state_dict(), history_path(path))

    def load_state(self, path: Path) -> None:
        """The adaptive schedule's state from a checkpoint; one that is missing (SD did not adapt when it was
        written), of another schedule or damaged is a warning and a fresh schedule (speculative/schedule_state.py).
        The response history beside it, read only where a configuration drafts from the n-gram index (else none
        is kept, and one a checkpoint holds is left unread); a checkpoint without one (written before tlt kept
        it, or by a run that drafted no n-grams) starts an empty one, and a damaged one is a warning and an empty
        one."""
        if self.history is not None:
            self._load_history(history_path(path))
        if self.schedule is None:
            return
        if not path.exists():
            self.schedule.warnings.append(missing_schedule_state(path))
            return
        try:
            saved = load_checkpoint_file(path)
        except CheckpointError as error:
            self.schedule.warnings.append(f"{str(error).rstrip('.')}; the SD schedule starts fresh.")
            return
        warning = restored_schedule(self.schedule, saved, path)
        if warning is not None:
            self.schedule.warnings.append(warning)

    def _load_history(self, path: Path) -> None:
        if not path.exists():
            return
        try:
            self.history.load_state_dict(load_checkpoint_file(path))
        except (CheckpointError, KeyError, TypeError, ValueError) as error:
            self.history = ResponseHistory()
            self.warnings.append(f"the response history {path} does not load ({error}); it starts empty.")

    def stop(self) -> None:
        """Nothing to release."""
