"""tlt's rollout inside Hugging Face TRL's GRPOTrainer: one argument added to a user's own script.

    from tlt_cli.integrations.trl import tlt_rollout

    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...), train_dataset=dataset,
                          rollout_func=tlt_rollout())          # the one added argument
    trainer.train()

TRL keeps its loss, advantages, reference model, optimizer step and logging; `TltRollout` (TRL's
`rollout_func`) generates every completion: TRL hands it this process's prompts (each already
repeated num_generations times) and gets back, in the same order, `prompt_ids` (tokenized as TRL
tokenizes them: tlt_cli/integrations/trl_support.py), `completion_ids` (cut at the first of
TRL's EOS ids) and `logprobs`: the sampled tokens' log-probabilities under the policy that
generated them, log_softmax(logits / temperature) over the full vocabulary as TRL computes its
own, computed by the engine under its decode model (in the rollout's dtype) from the target hidden
states it produced anyway (one head product, no forward). TRL 1.16 compares them with its own
log-probs and corrects the loss by importance sampling only when it generates with vLLM
(`use_vllm`, which tlt's rollout replaces): under `rollout_func` it takes them and applies nothing.

The generate loop (tlt_cli/rollout/generate_loop.py) is built on the first call on the very module TRL trains
(unwrapped and, under ZeRO-3, gathered as TRL gathers it for its own generation), so every
rollout sees the weights of the latest optimizer step. It speculates with a drafter
(tlt_cli/integrations/trl_drafter.py: fresh and trained online by default, as `tlt train`'s, or warmed up
on the trainer's own prompts and cached, random, a saved folder or an EagleDrafter), steered by the adaptive
rule table, bandit and collapse auto-off of the `speculative` settings (tlt_cli/speculative/rule_schedule.py).
With several data-parallel processes the plugin that trains the drafter (found by its entry point like any plugin; the
recipe's default plugins.enabled has one) does so while this process waits for the others,
through its class's `trl_process_sidecar`. `take_records()` returns what each rollout did (timings,
per-request lengths, SD usage and acceptance, sidecar metrics) for a trace;
`save_state`/`load_state` carry the schedule and drafter through checkpoints. With
`linear_forms="auto"` the engine computes each linear layer in the form measured fastest for the
pass's rows (tlt_cli/engine/linear_forms.py, measured by tlt_cli/tuning/linear_forms.py); its weight
copies are refreshed before every rollout, since TRL's optimizer steps in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tlt_cli.checkpoint import DRAFTER_DIRECTORY, load_checkpoint_file
from tlt_cli.config import (
    MAX_SEED,
    DrafterConfig,
    DrafterStart,
    LinearForms,
    PluginsConfig,
    RolloutDtype,
    SpeculativeMode,
    SpeculativeSection,
    number_problem,
    range_problem,
)
from tlt_cli.errors import UserError
from tlt_cli.integrations.trl_summary import EndOfTrainingLine, RolloutTally
from tlt_cli.integrations.trl_support import (
    check_trainer_supported,
    check_trl_version,
    eos_and_pad_ids,
    generation_policy,
    prompt_token_ids,
    trl_sampling,
)
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.plugins import drafter_training_plugin
from tlt_cli.rollout.backend import sampling_seed
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.speculative.plan import SpeculationMode, SpeculativePlan
from tlt_cli.speculative.rules import RuleTableError
from tlt_cli.speculative.schedule_state import missing_schedule_state, restored_schedule
from tlt_cli.speculative.shapes import shape_problem
from tlt_cli.speculative.types import OFF, SpeculativeConfig
from tlt_cli.training.drafter_use import rollout_needs_drafter
from tlt_cli.training.setup import decode_plan_for, speculative_plan
from tlt_cli.tuning.run_plan import RunPlan

if TYPE_CHECKING:
    from torch import nn

    from tlt_cli.drafter.model import EagleDrafter

STATE_DIRECTORY = "tlt_rollout"


@dataclass(frozen=True)
class RequestRecord:
    """One completion of a rollout. end: time.time() when it left the engine's running batch."""

    prompt_tokens: int
    response_tokens: int
    finished_by_eos: bool
    end: float
    verify_passes: int
    accepted_draft_tokens: int


@dataclass
class RolloutRecord:
    """What one call of the rollout did in this process (times are time.time() seconds).

    training: TRL generated for training (False: for evaluation, with num_generations_eval);
    start / end: the call's entry and return; busy_end: this process's last completion finished;
    idle_end: every process had finished (busy_end with one process or without the sidecar);
    sd_usage: label -> {decode_steps, tokens, seconds};
    sd_seconds: decode seconds under an SD configuration; accept_length: tokens per verify pass
    over the rollout (0.0 without SD); sidecar: the drafter-training plugin's metrics (empty when
    none ran; under its metric prefix), with idle_seconds, the wait it trained in;
    copy_bytes: the memory of the engine's own weight copies (the decode model's fused, transposed or cast
    copies, and the drafter's formed copy's transposed weights).
    """

    rollout: int
    process: int
    processes: int
    global_step: int
    training: bool
    start: float
    busy_end: float
    idle_end: float
    end: float
    requests: list[RequestRecord]
    sd_usage: dict[str, dict[str, float]]
    sd_seconds: float
    accept_length: float
    warnings: list[str]
    sidecar: dict[str, float] = field(default_factory=dict)
    copy_bytes: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def to_dict(self) -> dict:
        """Plain JSON-ready values (requests as dicts), with `seconds`."""
        return {**asdict(self), "seconds": self.seconds}


def tlt_rollout(
    speculative: SpeculativeSection | dict | None = None,
    drafter: str | Path | EagleDrafter = "online",
    sidecar: bool | Sequence[str] = True,
    drafter_config: DrafterConfig | dict | None = None,
    seed: int = 0,
    linear_forms: LinearForms | str = LinearForms.auto,
    cache_dir: str | Path | None = None,
    dtype: RolloutDtype | str = RolloutDtype.auto,
    plan: RunPlan | None = None,
) -> TltRollout:
    """A `rollout_func` for `GRPOTrainer` (checked now: TRL's version, the settings).

    speculative: the recipe's `speculative` section (None: its defaults, mode auto; {"mode": "off"}:
    plain decoding), checked as a recipe's is (its ranges, shapes and rule table: a RecipeError names the key).
    drafter: "online" (the default, as `tlt train`'s: a fresh drafter, no wait, trained online by the
    sidecar), "warmup" (trained on the trainer's first prompts before the first rollout, minutes once, cached
    under $TLT_CACHE_DIR), "random" (fresh and never trained), a folder written by save_drafter, or an
    EagleDrafter. sidecar: train the drafter in the wait between data-parallel processes, with the
    first of these plugin names whose class trains the drafter (True: the recipe's default
    plugins.enabled; False: no training).
    drafter_config: the recipe's `drafter` section (warm-up and sidecar settings). seed: sampling
    and the bandit's draws. linear_forms: "auto" or "off" (the recipe's `rollout.linear_forms`);
    cache_dir: where its measured plan is cached (None: $TLT_CACHE_DIR or ~/.cache/tlt). dtype: the precision
    tlt decodes in, "auto" (measured per machine and model), "float32" or "bfloat16" (the recipe's
    `rollout.dtype`; TRL's loss computes in the trainer's own precision; under TRL's own GRPOTrainer, which cannot
    correct a bfloat16 rollout's mismatch, "auto" keeps the policy's dtype). plan: the run's plan, made once by
    `tlt train`'s driver (setup.py `planned_run`): its speculative and decode plans are used as they are, and
    speculative, linear_forms and dtype are not read; None (a script of the user's): the speculative plan is made
    from `speculative` now, the decode plan from linear_forms and dtype at the first rollout (measured once per
    machine and model).
    """
    check_trl_version()
    linear_forms, dtype = LinearForms.of(linear_forms, "linear_forms"), RolloutDtype.of(dtype, "dtype")
    section = _section(SpeculativeSection, speculative, "speculative")
    section = replace(section, mode=SpeculativeMode.of(section.mode, "speculative mode"))
    drafter_section = _section(DrafterConfig, drafter_config, "drafter_config")
    # checked now as a recipe's sections are (ranges, shapes, the rule table), not at the first rollout
    speculating, decode = checked_rollout_sections(section, drafter_section), None
    if plan is not None:  # `tlt train`'s driver made the run's plan: used as it is
        speculating, decode = plan.speculative, plan.decode
    return TltRollout(
        speculating,
        drafter,
        process_sidecar_factory(sidecar),
        drafter_section,
        checked_seed(seed),
        linear_forms,
        None if cache_dir is None else Path(cache_dir),
        dtype,
        decode,
    )


def _progress(line: str) -> None:
    """A line of what tlt's rollout does before the first rollout, printed at once (TRL's bar shows nothing yet)."""
    print(f"tlt rollout: {line}", flush=True)


def checked_rollout_sections(speculative: SpeculativeSection, drafter: DrafterConfig) -> SpeculativePlan:
    """The sections a TRL script hands `tlt_rollout()`, checked as a recipe's are (tlt_cli/recipe_checks.py runs the
    same checks): finite numbers, the ranges each key declares, the SD shapes and the rule table; UserError, one
    sentence naming the key. Returns the speculative plan."""
    for section, name in ((speculative, "speculative."), (drafter, "drafter.")):
        problem = number_problem(section, name) or range_problem(section, name)
        if problem is not None:
            raise UserError(problem)
    try:
        plan = speculative_plan(speculative)
    except RuleTableError as error:
        raise UserError(str(error)) from None
    for config in (SpeculativeConfig(speculative.steps, speculative.topk, speculative.draft_tokens), *plan.configs):
        problem = shape_problem(config)
        if problem is not None:
            raise UserError(f"speculative: {problem}")
    return plan


def process_sidecar_factory(sidecar: bool | Sequence[str]) -> Callable[..., Any] | None:
    """What builds the drafter training between TRL's processes: the `trl_process_sidecar` of the first
    named plugin that trains the drafter (True: the recipe schema's default plugins), or None (False). Names of
    which none is a plugin that trains the drafter (`os:system`), or a `sidecar` that is not a bool or a list of
    names, are a UserError in one sentence."""
    if isinstance(sidecar, bool):
        names = PluginsConfig().enabled if sidecar else []
    elif isinstance(sidecar, (list, tuple)) and all(isinstance(name, str) and name.strip() for name in sidecar):
        names = list(sidecar)
    else:
        raise UserError(f"sidecar is {sidecar!r}; give True, False or a list of plugin names.")
    plugin = drafter_training_plugin(names)
    if not isinstance(sidecar, bool) and names and getattr(plugin, "trl_process_sidecar", None) is None:
        raise UserError(
            f"sidecar names {names}, none of them a plugin that trains the drafter between TRL's processes; "
            "give drafter_sidecar (or a plugin class with trains_drafter and trl_process_sidecar), or False."
        )
    return getattr(plugin, "trl_process_sidecar", None)


def checked_seed(seed: Any) -> int:
    """`seed` when it is a run.seed value (an integer in 0..MAX_SEED), else a UserError in one sentence."""
    if type(seed) is not int or not 0 <= seed <= MAX_SEED:
        raise UserError(f"seed is {seed!r}; give an integer in 0..{MAX_SEED} (as run.seed).")
    return seed


def _section(kind: type, given: Any, name: str) -> Any:
    """A recipe section from None (defaults), an instance or a dict (unknown keys refused)."""
    if given is None:
        return kind()
    if isinstance(given, kind):
        return given
    known = {item.name for item in fields(kind)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise UserError(f"{name} has no key {unknown[0]!r}; use keys among {sorted(known)}.")
    return kind(**given)


class TltRollout:
    """TRL's rollout_func generating with tlt (see the module docstring); build it with `tlt_rollout`."""

    def __init__(
        self,
        speculative: SpeculativePlan,
        drafter: str | Path | EagleDrafter,
        sidecar: Callable[..., Any] | None,
        drafter_config: DrafterConfig,
        seed: int,
        linear_forms: LinearForms = LinearForms.off,
        cache_dir: Path | None = None,
        dtype: RolloutDtype = RolloutDtype.float32,
        decode: DecodePlan | None = None,
    ) -> None:
        self.speculative = speculative
        self.drafter_source = drafter
        # builds the process sidecar (a plugin's trl_process_sidecar), None: no drafter training
        self.sidecar_factory = sidecar
        self.use_sidecar = sidecar is not None
        self.drafter_config = drafter_config
        self.seed = seed
        self.linear_forms, self.cache_dir, self.dtype, self.decode = linear_forms, cache_dir, dtype, decode
        self.rollouts = 0
        self.backend: EmbeddedRollout | None = None
        self.policy: nn.Module | None = None
        self.drafter: EagleDrafter | None = None
        self.sidecar: Any | None = None
        self.records: list[RolloutRecord] = []
        # every rollout of this process, for the line printed when TRL's training ends (trl_summary.py)
        self.tally = RolloutTally()
        self.pending_state: Path | None = None

    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        start = time.time()
        check_trainer_supported(trainer)
        prompt_ids = prompt_token_ids(trainer, prompts)
        eos_ids, _ = eos_and_pad_ids(trainer)
        process, processes = trainer.accelerator.process_index, trainer.accelerator.num_processes
        with generation_policy(trainer) as policy:
            requests = grouped_requests(prompt_ids)
            self._build(policy, trainer, len(requests))
            completions, busy_end = self.backend.generate_with_hidden(
                requests, trl_sampling(trainer), self._sampling_seed(process), trainer.temperature
            )
            completions = [_cut_at_eos(completion, eos_ids) for completion in completions]
            sidecar_metrics = self.sidecar.after_rollout(self.rollouts, completions) if self.sidecar else {}
        idle_end = self.sidecar.wait_end if self.sidecar is not None else busy_end
        record = self._record(trainer, process, processes, start, busy_end, idle_end, completions, sidecar_metrics)
        self.records.append(record)
        if self.rollouts == 0:
            trainer.add_callback(EndOfTrainingLine(self.tally, _progress))
        drafts = (
            sum(request.accepted_draft_tokens for request in record.requests),
            sum(request.verify_passes for request in record.requests),
        )
        self.tally.add(record.rollout, process, processes, record.sd_usage, drafts)
        self.rollouts += 1
        return {
            "prompt_ids": [list(completion.prompt_ids) for completion in completions],
            "completion_ids": [completion.response_ids for completion in completions],
            "logprobs": [completion.rollout_logprobs.tolist() for completion in completions],
        }

    def _build(self, policy: nn.Module, trainer: Any, rows: int) -> None:
        """The engine, drafter and sidecar on `policy`, once (again only if TRL hands over another module); `rows`:
        the completions this process generates per rollout, which rollout.dtype auto weighs."""
        if policy is self.policy:
            return
        from tlt_cli.integrations.trl_drafter import starting_drafter

        started = time.monotonic()
        processes = trainer.accelerator.num_processes
        # the sidecar trains the drafter only in the wait between processes: with one there is none
        trains_drafter = self.use_sidecar and processes > 1
        if self.drafter_source == DrafterStart.warmup:
            _progress("warming up the drafter offline before the first rollout (minutes once, then cached)")
        self.drafter = (
            starting_drafter(self.drafter_source, policy, trainer, self.drafter_config, self.seed, self.pending_state)
            if rollout_needs_drafter(self.speculative.mode, trains_drafter)
            else None
        )
        eos_ids, pad_token_id = eos_and_pad_ids(trainer)
        if self.decode is None:  # a script of the user's: no driver resolved it
            _progress(
                "planning how to decode: dtype, linear forms, SD pass costs (measured once per machine and model)"
            )
            self.decode = decode_plan_for(
                policy,
                self.drafter,
                self.dtype,
                self.linear_forms,
                self.cache_dir if self.cache_dir is not None else default_cache_dir(),
                rows,
                speculates=self.speculative.mode != SpeculationMode.off,
                costs=self.speculative.mode == SpeculationMode.auto,
                # TRL's own GRPOTrainer never sees the rollout's log-probs: auto then keeps the policy's dtype
                correctable=getattr(trainer, "corrects_rollout_mismatch", False),
            )
            for line in self.decode.log_lines:
                _progress(line)
        self.backend = HiddenStateRollout(
            policy, eos_ids[0], pad_token_id, self.speculative, self.drafter, seed=self.seed, decode=self.decode
        )
        if self.pending_state is not None:
            self._load_schedule(self.pending_state, trainer.accelerator.process_index)
        if trains_drafter:
            self.sidecar = self.sidecar_factory(
                policy=policy,
                drafter=self.drafter,
                settings=self.drafter_config,
                seed=self.seed,
                temperature=trainer.temperature,
                process=trainer.accelerator.process_index,
                processes=processes,
                device=trainer.accelerator.device,
                pad_token_id=pad_token_id,
            )
            if self.pending_state is not None:
                self.sidecar.load_state(self.pending_state)
        self.policy = policy
        _progress(f"ready in {time.monotonic() - started:.0f} s; generating the first rollout")

    def _sampling_seed(self, process: int) -> int:
        """Sampling randomness from (seed, rollout number, process): a resumed run draws the same samples."""
        return sampling_seed(self.seed, self.rollouts, process)

    def _record(
        self,
        trainer: Any,
        process: int,
        processes: int,
        start: float,
        busy_end: float,
        idle_end: float,
        completions: list[Completion],
        sidecar: dict[str, float],
    ) -> RolloutRecord:
        usage = {label: asdict(value) for label, value in self.backend.take_usage().items()}
        passes = sum(completion.speculative.verify_passes for completion in completions)
        accepted = sum(completion.speculative.accepted_draft_tokens for completion in completions)
        return RolloutRecord(
            rollout=self.rollouts,
            process=process,
            processes=processes,
            global_step=trainer.state.global_step,
            training=trainer.model.training,
            start=start,
            busy_end=busy_end,
            idle_end=idle_end,
            end=time.time(),
            requests=[_request_record(completion) for completion in completions],
            sd_usage=usage,
            sd_seconds=sum(value["seconds"] for label, value in usage.items() if label != OFF),
            accept_length=(accepted + passes) / passes if passes else 0.0,
            warnings=self.backend.take_warnings(),
            sidecar=sidecar,
            copy_bytes=self.backend.copy_bytes,
        )

    def take_records(self) -> list[RolloutRecord]:
        """The records of the rollouts since the last call, oldest first."""
        records, self.records = self.records, []
        return records

    def save_state(self, directory: Path, process: int = 0) -> None:
        """Into a checkpoint folder: the adaptive schedule's learning and the rollout count
        (tlt_rollout/rank-<process>.pt), the sidecar's state, and the drafter (drafter/, process 0)."""
        from tlt_cli.drafter.model import save_drafter

        state_directory = Path(directory) / STATE_DIRECTORY
        state_directory.mkdir(parents=True, exist_ok=True)
        schedule = self.backend.schedule.state_dict() if self.backend and self.backend.schedule else None
        torch.save({"rollouts": self.rollouts, "schedule": schedule}, state_directory / f"rank-{process}.pt")
        if self.sidecar is not None:
            self.sidecar.save_state(Path(directory))
        elif process == 0 and self.drafter is not None:
            save_drafter(self.drafter, Path(directory) / DRAFTER_DIRECTORY)

    def load_state(self, directory: Path, process: int = 0) -> None:
        """Restore what `save_state` wrote: now the rollout count, the rest when the engine is built."""
        state = load_checkpoint_file(Path(directory) / STATE_DIRECTORY / f"rank-{process}.pt")
        self.rollouts = state["rollouts"]
        self.pending_state = Path(directory)
        self.policy = None  # rebuild on the next call, from the checkpoint's drafter

    def _load_schedule(self, directory: Path, process: int) -> None:
        path = directory / STATE_DIRECTORY / f"rank-{process}.pt"
        state = load_checkpoint_file(path)
        schedule = self.backend.schedule
        if schedule is None:
            return
        saved = state.get("schedule") if isinstance(state, dict) else None
        warning = missing_schedule_state(path) if saved is None else restored_schedule(schedule, saved, path)
        if warning is not None:
            schedule.warnings.append(warning)


class HiddenStateRollout(EmbeddedRollout):
    """The embedded rollout, also returning each completion's target hidden states (for the sidecar)."""

    def generate_with_hidden(
        self, requests: list[RolloutRequest], sampling: Any, seed: int, logprob_temperature: float
    ) -> tuple[list[Completion], float]:
        """Completions in request order with `target_hidden` and `rollout_logprobs` at logprob_temperature (TRL's
        definition: its sampling temperature), and when the last one finished."""
        self.refresh_copies()  # TRL's optimizer stepped since the last rollout
        generator = torch.Generator(self.engine.device).manual_seed(seed)
        completions = self.engine.generate(
            requests, sampling, generator, return_hidden=True, logprob_temperature=logprob_temperature
        )
        return completions, max(completion.end for completion in completions)


def grouped_requests(prompt_ids: list[list[int]]) -> list[RolloutRequest]:
    """One request per prompt TRL passes; equal prompts are one group (TRL 1.16's RepeatSampler repeats each
    prompt num_generations times in a row), so the samples of a prompt draft from each other's text (n-gram SD)."""
    groups: dict[tuple[int, ...], int] = {}
    return [
        RolloutRequest(index, tuple(ids), group=groups.setdefault(tuple(ids), len(groups)))
        for index, ids in enumerate(prompt_ids)
    ]


def _cut_at_eos(completion: Completion, eos_ids: list[int]) -> Completion:
    """The completion ended at the first of TRL's EOS ids (the engine stops only at the first id)."""
    ends = [index for index, token in enumerate(completion.response_ids) if token in eos_ids]
    if not ends or ends[0] == len(completion.response_ids) - 1:
        return completion
    length = ends[0] + 1
    completion.response_ids = completion.response_ids[:length]
    completion.target_hidden = completion.target_hidden[:length]
    completion.rollout_logprobs = completion.rollout_logprobs[:length]
    completion.finished_by_eos = True
    return completion


def _request_record(completion: Completion) -> RequestRecord:
    return RequestRecord(
        prompt_tokens=len(completion.prompt_ids),
        response_tokens=len(completion.response_ids),
        finished_by_eos=completion.finished_by_eos,
        end=completion.end,
        verify_passes=completion.speculative.verify_passes,
        accepted_draft_tokens=completion.speculative.accepted_draft_tokens,
    )
