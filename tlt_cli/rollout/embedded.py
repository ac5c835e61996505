"""The embedded rollout backend: the in-process engine on the trainer's own policy module.

`EmbeddedRollout` is tlt_cli/rollout/backend.py's RolloutBackend around tlt_cli/rollout/generate_loop.py's
EmbeddedEngine (`rollout.backend: embedded`). It generates with the very module the trainer
updates, so there is nothing to start, to push after an update, or to stop. It needs no recipe and
no worker: a policy module, its EOS and pad ids, the speculative plan (tlt_cli/training/setup.py
`speculative_plan` makes it from the recipe's `speculative` section) and, to speculate, a drafter over that
policy, which is all a trainer of another library has in its own process:

    rollout = EmbeddedRollout(model, tokenizer.eos_token_id, tokenizer.pad_token_id,
                              speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive)), drafter, seed=0)
    completions, busy_end = rollout.generate(requests, SamplingParams(max_new_tokens=128), seed=step)
    usage = rollout.take_usage()  # adaptive SD: decode steps, tokens and seconds per configuration

`dtype` (the recipe's `rollout.dtype`: auto, float32 or bfloat16) is the precision the policy is decoded in;
`auto` measures once per machine and model which pays (tlt_cli/tuning/precision.py); `precision()` says which
ran and the figures that chose it, `start()` puts it in the run log.

`linear_forms="auto"` (the recipe's `rollout.linear_forms`) has the engine compute each linear layer of the
policy and drafter, while decoding, in the form measured fastest on this machine for the pass's rows
(the plan measured and cached by tlt_cli/tuning/linear_forms.py, carried out by tlt_cli/engine/linear_forms.py);
its transposed copies are the decode model's, refreshed by `after_update`.

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

from tlt_cli.checkpoint import load_checkpoint_file
from tlt_cli.engine.linear_forms import describe_plan
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.speculative.adaptive import (
    AdaptiveSpeculativeDecoder,
    ConfigUsage,
    SpeculativePlan,
    speculative_decoder,
)
from tlt_cli.tuning.linear_forms import measured_linear_plan
from tlt_cli.tuning.precision import RolloutWorkload, rollout_precision


class EmbeddedRollout:
    """Rollouts in this process on `policy` (see the module docstring).

    speculative: the speculative plan (None: SD off); drafter: the drafter over
    `policy` to speculate with (None: SD off). seed: the adaptive schedule's bandit draws.
    linear_forms: "auto" or "off", dtype: "auto", "float32" or "bfloat16" (see the module docstring); cache_dir:
    where the measured plan and precision are cached (None: $TLT_CACHE_DIR or ~/.cache/tlt). rows: how many
    sequences one `generate` call decodes at once (a worker's completions of a step), which `auto` weighs;
    correctable: whether the learner corrects the rollout/learner mismatch (False: `auto` keeps the policy's dtype).
    """

    def __init__(
        self,
        policy: nn.Module,
        eos_token_id: int,
        pad_token_id: int,
        speculative: SpeculativePlan | None = None,
        drafter: nn.Module | None = None,
        seed: int = 0,
        linear_forms: str = "off",
        cache_dir: Path | None = None,
        dtype: str = "float32",
        rows: int = 1,
        correctable: bool = True,
    ) -> None:
        decoder = speculative_decoder(speculative, drafter, seed) if speculative is not None else None
        self.schedule = decoder.adaptive_schedule if isinstance(decoder, AdaptiveSpeculativeDecoder) else None
        cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.linear_plan = measured_linear_plan(linear_forms, [policy, drafter], cache_dir)
        workload = RolloutWorkload(rows, speculates=decoder is not None)
        self.precision_choice = rollout_precision(dtype, policy, self.linear_plan, cache_dir, workload, correctable)
        self.engine = EmbeddedEngine(
            policy,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            speculative=decoder,
            linear_plan=self.linear_plan,
            dtype=self.precision_choice.torch_dtype,
        )

    def start(self) -> list[str]:
        """Nothing to start: the engine runs in this process; its precision, decode path and forms, for the log."""
        forms = [describe_plan(self.linear_plan)] if self.linear_plan is not None else []
        return [self.precision_choice.describe(), self.engine.decode_model.describe(), *forms]

    def precision(self) -> dict:
        """The dtype the engine decodes in and how it was chosen (see tlt_cli/tuning/precision.py)."""
        return self.precision_choice.to_record()

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
        completions = self.engine.generate(
            requests, sampling, generator, on_request_finished=on_request_finished, logprob_temperature=1.0
        )
        busy_end = time.time()
        # the trainer's update comes next: it has the copies' memory until after_update rebuilds them
        self.engine.decode_model.release()
        return sorted(completions, key=lambda completion: completion.request_id), busy_end

    def after_update(
        self, weight_version: str, drafter_version: float | None, probe_prompts: Sequence[Sequence[int]]
    ) -> dict[str, float]:
        """Nothing to push: the engine generates from the updated module's weights; only its decode model's
        copies (freed by `generate` for the update) are rebuilt."""
        self.refresh_copies()
        return {}

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
        return self.schedule.take_warnings() if self.schedule is not None else []

    def save_state(self, path: Path) -> None:
        """The adaptive schedule's state (nothing without one)."""
        if self.schedule is not None:
            torch.save(self.schedule.state_dict(), path)

    def load_state(self, path: Path) -> None:
        if self.schedule is not None:
            self.schedule.load_state_dict(load_checkpoint_file(path))

    def stop(self) -> None:
        """Nothing to release."""
