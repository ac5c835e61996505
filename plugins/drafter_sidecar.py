"""The drafter sidecar: trains the run's drafter on workers that are idle in the rollout tail.

Enable it with `plugins.enabled: [drafter_sidecar]`; its settings are the recipe's `drafter`
section (lr, weight_decay, window_steps, batch_size, update_share). In every worker it:
  - collects training data from what the run computes anyway: the last-layer hidden states and
    tokens of the actor's update forward (`on_hidden_states`), keeping the last window_steps
    RL steps;
  - trains on each micro-batch's features as the update produces them, every response token of
    the step first, then replays from the window, spending at most update_share of the update's
    own time (measured as it goes, so the bound holds on any machine and model; a step starts only when the
    drafter's seconds with it, predicted from its recent steps, stay within the share): the update
    sees every token of every step, where the idle tail alone gave a real model 0-29 steps;
  - while its worker waits for the others (`on_worker_idle`), runs short drafter training steps for idle_duty of
    the wait, pausing between them (a worker still decoding next door shares the memory bus with it)
    (EAGLE losses, AdamW (0.9, 0.95), grad clip 1.0), checking between steps whether the rollout
    is over, so it never holds up the rollout or the actor update by more than one short step;
  - counts the tokens of every finished response (`on_request_finished`) and, at rollout end, moves a reduced
    draft vocabulary to the tokens the run's responses emit most, counted over all workers and steps
    (drafter/vocabulary.py `follow_responses`: the same on every worker);
  - at rollout end (`on_rollout_end`, all workers together) averages the drafter copies, weighted
    by the steps each worker did since the last average (the update's and the idle tail's); each
    worker's next rollout speculates with its own copy, trained on through the update (an SGLang
    server gets the average, a step later). An average that is not finite is discarded and the
    last good drafter kept;
  - when the drafter diverged in a rollout and the worker gave it fresh weights in place (`on_drafter_reset`,
    training/drafter_divergence.py), starts a fresh optimizer over them, with the window kept (the policy's
    features are still good); when the worker turned the drafter off, trains and averages it no more;
  - saves and restores its state with checkpoints: drafter weights, optimizer and buffer window; a state that is
    missing, damaged (drafter_sidecar_state.py), or another drafter's is one warning and a fresh sidecar.
It ships with tlt but plugs in as a third party's plugin would (tlt_cli/plugins.py): the entry
point `drafter_sidecar` of the `tlt.plugins` group names this class, and the core never names it.
The core learns what it needs from class attributes: `trains_drafter` (the run builds a drafter),
`metric_prefix` and `display_columns` (its drafter_* metrics in the trace and the live table),
`idle_seconds_used` (the summary's share of idle time), `trl_process_sidecar` (the same training
in the wait between TRL's processes, drafter_sidecar_trl.py); and it sets
`context.drafter_version` when the average changed the drafter (SGLang servers reload it).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tlt_cli.checkpoint import DRAFTER_DIRECTORY, CheckpointError, load_checkpoint_file
from tlt_cli.config import DrafterConfig, Recipe, RolloutConfig, RunConfig
from tlt_cli.drafter.loss import objective_named
from tlt_cli.drafter.model import save_drafter
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer
from tlt_cli.plugins import MetricColumn
from tlt_plugins.drafter_sidecar_state import state_problem

LOGGER = logging.getLogger(__name__)
# how often a paused idle worker checks whether the rollout is over (its delay to the step, at most)
PAUSE_POLL_SECONDS = 0.01
# how many of the drafter's latest steps (idle and in the update) predict the next one's seconds
PREDICTING_STEPS = 8

# what recipes enable it by (`plugins.enabled: [drafter_sidecar]`): its entry point in the tlt.plugins group
PLUGIN_NAME = "drafter_sidecar"
STATE_DIRECTORY = "drafter_sidecar"
# the metrics it adds to each worker's step report at rollout end, all under METRIC_PREFIX (the
# driver sums the counters over workers: names ending in _steps or _seconds)
METRIC_PREFIX = "drafter_"
STEPS_METRIC = "drafter_steps"
TRAIN_SECONDS_METRIC = "drafter_train_seconds"
# collection in the last update + averaging: the sidecar's direct cost on the critical path
CRITICAL_SECONDS_METRIC = "drafter_critical_seconds"
# drafter steps taken inside the update, and their seconds (on the critical path, bounded by drafter.update_share)
UPDATE_STEPS_METRIC = "drafter_update_steps"
UPDATE_SECONDS_METRIC = "drafter_update_seconds"
# how many averages the drafter has taken (also context.drafter_version: SGLang servers reload it when it moves)
VERSION_METRIC = "drafter_version"
# mean training loss of the worker's steps (only when it took some)
LOSS_METRIC = "drafter_loss"
# 1.0 when the average was not finite and the last good drafter was kept
DISCARDED_STEPS_METRIC = "drafter_discarded_steps"


@dataclass
class StepData:
    """Drafter features collected in one RL step (one DrafterBatch per actor micro-batch)."""

    step: int
    batches: list[DrafterBatch]


class DrafterSidecar:
    """Online drafter training in the idle tail of each rollout (see the module docstring)."""

    name = PLUGIN_NAME
    trains_drafter = True
    metric_prefix = METRIC_PREFIX
    display_columns = (
        MetricColumn("drafter steps", STEPS_METRIC, "{:.0f}"),
        MetricColumn("drafter update s", UPDATE_SECONDS_METRIC, "{:.2f}"),
        MetricColumn("drafter train s", TRAIN_SECONDS_METRIC, "{:.2f}"),
        MetricColumn("drafter loss", LOSS_METRIC, "{:.3f}"),
    )
    idle_seconds_used = ("training the drafter", TRAIN_SECONDS_METRIC)
    # what the sidecar times its steps and the update's share with, and waits with between idle steps (tests move
    # them by hand)
    clock = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)

    @classmethod
    def trl_process_sidecar(cls, settings: DrafterConfig, seed: int, temperature: float = 1.0, **arguments: Any) -> Any:
        """The sidecar driven from TRL's rollout_func in a data-parallel TRL run (drafter_sidecar_trl.py), around an
        instance of this class with the `drafter` settings, seed and sampling temperature it is given."""
        from tlt_plugins.drafter_sidecar_trl import TrlSidecar

        recipe = Recipe(run=RunConfig(seed=seed), drafter=settings, rollout=RolloutConfig(temperature=temperature))
        return TrlSidecar(plugin=cls(recipe), **arguments)

    def __init__(self, recipe: Any):
        self.settings = recipe.drafter
        self.seed = recipe.run.seed
        # the objective at the rollout's sampling temperature (drafter.loss), over drafter.train_depths
        self.objective = objective_named(self.settings.loss, recipe.rollout.temperature, self.settings.train_depths)
        self.window: deque[StepData] = deque()
        self.trainer: DrafterTrainer | None = None
        self.drafter: torch.nn.Module | None = None
        self.last_good: dict[str, torch.Tensor] = {}
        self.version = 0
        self.rank = 0
        self.pending_state: dict | None = None
        self.generator = torch.Generator()
        # time in hooks on the critical path (feature collection during the previous update, then
        # averaging): the sidecar's direct cost to a step, reported at rollout end and reset there
        self.critical_seconds = 0.0
        # drafter steps since the last average (its weight in the next one), with their summed loss
        self.steps_since_average = 0
        self.loss_sum = 0.0
        # self.clock() when this worker's update phase began (rollout end); None outside it
        self.update_started: float | None = None
        self.update_steps = 0
        self.update_seconds = 0.0
        # the seconds of the drafter's latest steps: the cost of its next step in the update, predicted
        self.recent_step_seconds: deque[float] = deque(maxlen=PREDICTING_STEPS)
        # [V] float64: tokens emitted by this worker's responses since the last rollout end, and by every worker's
        # over the run (what a reduced draft vocabulary follows); built when the drafter is attached
        self.emitted_now: torch.Tensor | None = None
        self.emitted_total: torch.Tensor | None = None
        # the drafter diverged again soon after a reset and the worker turned it off: nothing to train
        self.drafter_off = False
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.steps_done = 0
        self.train_seconds = 0.0

    def on_rollout_start(self, context: Any) -> None:
        if context.drafter is None:
            raise ValueError(f"{PLUGIN_NAME} needs a drafter; the worker did not build one.")
        if self.trainer is None:
            self._attach(context.drafter, context.worker)
        self.update_started = None
        self._reset_counters()

    def _attach(self, drafter: torch.nn.Module, rank: int) -> None:
        self.drafter, self.rank = drafter, rank
        self._start_fresh()
        if self.pending_state is not None:
            self._restore_or_start_fresh(self.pending_state)
            self.pending_state = None
        self.last_good = _copy_parameters(drafter)

    def _start_fresh(self) -> None:
        """A new trainer over the attached drafter, an empty window, the worker's seed, no counts."""
        drafter = self.drafter
        self.trainer = self._new_trainer()
        self.window, self.version, self.steps_since_average = deque(), 0, 0
        self.generator.manual_seed(self.seed * 7919 + self.rank)
        self.emitted_now = torch.zeros(drafter.target_vocab_size, dtype=torch.float64)
        self.emitted_total = torch.zeros(drafter.target_vocab_size, dtype=torch.float64)

    def _new_trainer(self) -> DrafterTrainer:
        """A trainer with a fresh AdamW over the attached drafter's parameters."""
        return DrafterTrainer(
            self.drafter, lr=self.settings.lr, weight_decay=self.settings.weight_decay, objective=self.objective
        )

    def on_drafter_reset(self, context: Any, turned_off: bool) -> None:
        """The drafter diverged and has fresh weights in place: a fresh optimizer over them, no steps toward the next
        average (on every worker alike, so the average is skipped), the fresh weights the last good ones; the version
        keeps counting (servers reload the drafter when it moves). turned_off: no more training or averaging."""
        self.trainer = self._new_trainer()
        self.steps_since_average, self.loss_sum = 0, 0.0
        self.last_good = _copy_parameters(self.drafter)
        self.drafter_off = turned_off

    def _restore_or_start_fresh(self, state: dict) -> None:
        """Restore a whole state; one that does not fit this drafter (another drafter's shapes or vocabulary) is a
        warning, and the drafter goes back to its starting weights and draft vocabulary under a fresh sidecar."""
        starting_weights = _copy_parameters(self.drafter)
        vocabulary = self.drafter.vocabulary
        starting_vocabulary = vocabulary.target_ids.clone() if vocabulary.is_reduced else None
        try:
            self._restore(state)
        except Exception as error:  # noqa: BLE001 - a state that does not fit is a fresh start, never a disabled sidecar
            LOGGER.warning(
                "drafter sidecar state does not fit this run's drafter (%s: %s): the sidecar starts fresh.",
                type(error).__name__,
                str(error).splitlines()[0][:200] if str(error) else "",
            )
            _load_parameters(self.drafter, starting_weights)
            if starting_vocabulary is not None:
                vocabulary.target_ids.copy_(starting_vocabulary)
                self.drafter.refresh_draft_head()
            self._start_fresh()

    def on_request_finished(self, context: Any, completion: Any) -> None:
        """Count the response's tokens (the draft vocabulary follows them at rollout end)."""
        if self.emitted_now is not None and completion.response_ids:
            tokens = torch.as_tensor(completion.response_ids, dtype=torch.long)
            self.emitted_now += torch.bincount(tokens, minlength=self.emitted_now.numel()).double()

    def on_hidden_states(self, context: Any, batch: Any, hidden_states: torch.Tensor) -> None:
        """Keep this micro-batch's features (dropping steps older than the window); in the update, train on them."""
        if self.drafter_off:
            return
        started = self.clock()
        features = DrafterBatch.from_sequences(
            batch.input_ids, hidden_states.detach(), batch.response_mask.bool(), batch.attention_mask.bool()
        )
        if not self.window or self.window[-1].step != context.step:
            self.window.append(StepData(context.step, []))
        self.window[-1].batches.append(features)
        while self.window and self.window[0].step <= context.step - self.settings.window_steps:
            self.window.popleft()
        self.critical_seconds += self.clock() - started
        if self.update_started is not None and self.trainer is not None:
            self._train_in_update(features)
            context.metrics[UPDATE_STEPS_METRIC] = float(self.update_steps)
            context.metrics[UPDATE_SECONDS_METRIC] = self.update_seconds

    def _train_in_update(self, fresh: DrafterBatch) -> None:
        """Steps on the fresh micro-batch's rows (batch_size at a time), then on rows replayed from the window,
        while the update's drafter seconds stay within update_share of the rest of the update's time."""
        fresh_rows = torch.arange(fresh.size).split(self.settings.batch_size)
        taken = 0
        while self._update_budget_left():
            batch = fresh.rows(fresh_rows[taken]) if taken < len(fresh_rows) else self._sample_batch()
            taken += 1
            started = self.clock()
            with torch.enable_grad():  # the actor may call from its no-grad log-prob pass
                self._train_step(batch)
            step_seconds = self.clock() - started
            self.recent_step_seconds.append(step_seconds)
            self.update_seconds += step_seconds
            self.update_steps += 1

    def _update_budget_left(self) -> bool:
        """Whether one more drafter step keeps the drafter's seconds in this update within update_share x the
        update's other seconds: its cost predicted as the mean of the latest steps (before any was measured, whether
        the seconds so far are below the share: one step's granularity, once a run)."""
        elapsed = self.clock() - self.update_started
        allowed = self.settings.update_share * (elapsed - self.update_seconds)
        if not self.recent_step_seconds:
            return self.update_seconds < allowed
        predicted = sum(self.recent_step_seconds) / len(self.recent_step_seconds)
        return self.update_seconds + predicted <= allowed

    def _train_step(self, batch: DrafterBatch) -> bool:
        """One drafter step, counted toward the next average when it was finite (returned)."""
        loss = self.trainer.train_step(batch)
        if loss.is_finite:
            self.steps_since_average += 1
            self.loss_sum += float(loss.total)
        return bool(loss.is_finite)

    def on_worker_idle(self, context: Any, rollout_over: Any) -> None:
        """Train until the rollout is over, one short step at a time, for idle_duty of the wait (pausing between)."""
        duty = self.settings.idle_duty
        while duty > 0 and self.window and not self.drafter_off and not rollout_over():
            started = self.clock()
            self.steps_done += self._train_step(self._sample_batch())
            step_seconds = self.clock() - started
            self.recent_step_seconds.append(step_seconds)
            self.train_seconds += step_seconds
            self._pause(step_seconds * (1 - duty) / duty, rollout_over)

    def _pause(self, seconds: float, rollout_over: Any) -> None:
        """Wait `seconds` (the memory bus left to a worker still decoding), or until the rollout is over."""
        resume_at = self.clock() + seconds
        while self.clock() < resume_at and not rollout_over():
            self.sleep(min(PAUSE_POLL_SECONDS, resume_at - self.clock()))

    def _sample_batch(self) -> DrafterBatch:
        """Up to batch_size sequences of one stored actor micro-batch, drawn at random (seeded per worker).

        The actor's micro-batches hold sequences of similar length (rows are sorted by length), so
        a step pads little and its duration is bounded by one micro-batch: preemption stays tight.
        A micro-batch is picked with probability proportional to its rows, so every stored
        sequence is equally likely to be trained on.
        """
        batches = [batch for data in self.window for batch in data.batches]
        sizes = torch.tensor([batch.size for batch in batches], dtype=torch.float)
        source = batches[int(torch.multinomial(sizes, 1, generator=self.generator))]
        order = torch.randperm(source.size, generator=self.generator)[: self.settings.batch_size]
        return source.rows(order)

    def on_rollout_end(self, context: Any) -> None:
        """Average the workers' drafters, weighted by their steps since the last average; keep the last good one if
        not finite; a reduced draft vocabulary follows the tokens emitted so far. The update phase (reward, update:
        its drafter steps) begins here. A drafter turned off (on every worker alike) has nothing to average."""
        if self.drafter_off:
            return
        started = self.clock()
        self._follow_emitted_tokens(context.world_size)
        # on the drafter's device, the process group's (an NCCL group all-reduces only GPU tensors)
        weight = torch.tensor([float(self.steps_since_average)], device=next(self.drafter.parameters()).device)
        total = _all_reduce(weight.clone(), context.world_size)
        if float(total) > 0:
            with torch.no_grad():  # one flat all_reduce instead of one per parameter tensor
                flat = torch.nn.utils.parameters_to_vector(self.drafter.parameters()) * weight
                torch.nn.utils.vector_to_parameters(
                    _all_reduce(flat, context.world_size) / total, self.drafter.parameters()
                )
            if all(torch.isfinite(parameter).all() for parameter in self.drafter.parameters()):
                self.version += 1
                self.last_good = _copy_parameters(self.drafter)
            else:
                _load_parameters(self.drafter, self.last_good)
                context.metrics[DISCARDED_STEPS_METRIC] = 1.0
        self.critical_seconds += self.clock() - started
        context.metrics.update(
            {
                STEPS_METRIC: float(self.steps_done),
                TRAIN_SECONDS_METRIC: self.train_seconds,
                CRITICAL_SECONDS_METRIC: self.critical_seconds,
                VERSION_METRIC: float(self.version),
            }
        )
        context.drafter_version = float(self.version)
        self.critical_seconds = 0.0
        if self.steps_since_average:  # a worker that trained no step has no loss to average in
            context.metrics[LOSS_METRIC] = self.loss_sum / self.steps_since_average
        self.steps_since_average, self.loss_sum = 0, 0.0
        self.update_steps, self.update_seconds = 0, 0.0
        self.update_started = self.clock()

    def _follow_emitted_tokens(self, world_size: int) -> None:
        """Add every worker's tokens of this rollout to the run's counts; a reduced vocabulary follows them (a full one
        has nothing to follow: no counts, no collective)."""
        if not self.drafter.vocabulary.is_reduced:
            return
        emitted = _all_reduce(self.emitted_now.to(next(self.drafter.parameters()).device), world_size)
        self.emitted_total += emitted.cpu()
        self.emitted_now.zero_()
        if self.emitted_total.any():
            self.drafter.vocabulary.follow_responses(self.emitted_total)
            self.drafter.refresh_draft_head()

    def on_checkpoint_save(self, directory: Path) -> None:
        state_directory = directory / STATE_DIRECTORY
        state_directory.mkdir(parents=True, exist_ok=True)
        torch.save(self._state(), state_directory / f"rank-{self.rank}.pt")
        if self.rank == 0 and self.drafter is not None:
            save_drafter(self.drafter, directory / DRAFTER_DIRECTORY)

    def on_checkpoint_load(self, directory: Path) -> None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        path = directory / STATE_DIRECTORY / f"rank-{rank}.pt"
        if not path.is_file():  # the sidecar was off when it was written: start it fresh
            LOGGER.warning(
                "checkpoint %s has no drafter sidecar state (%s): the sidecar starts fresh.", directory, path
            )
            return
        try:  # the buffer window pickles as StepData of DrafterBatch tensors: the only classes it may hold
            saved = load_checkpoint_file(path, allowed_classes=(StepData, DrafterBatch))
        except CheckpointError as error:
            LOGGER.warning("%s; the drafter sidecar starts fresh.", str(error).rstrip("."))
            return
        problem = state_problem(saved, StepData)
        if problem is not None:
            LOGGER.warning("drafter sidecar state %s is damaged (%s): the sidecar starts fresh.", path, problem)
            return
        self.pending_state = saved

    def _state(self) -> dict:
        return {
            "trainer": self.trainer.state_dict() if self.trainer else None,
            "window": list(self.window),
            "version": self.version,
            "generator": self.generator.get_state(),
            "steps_since_average": self.steps_since_average,
            "emitted_total": self.emitted_total,
            "vocabulary": self.drafter.vocabulary.target_ids if self.drafter is not None else None,
        }

    def _restore(self, state: dict) -> None:
        if state["trainer"] is not None:
            self.trainer.load_state_dict(state["trainer"])
        self.window = deque(state["window"])
        self.version = state["version"]
        self.generator.set_state(state["generator"])
        # checkpoints before drafter training in the update have no such count: their steps were all averaged
        self.steps_since_average = state.get("steps_since_average", 0)
        if state.get("emitted_total") is not None:  # checkpoints before the vocabulary followed responses: fresh
            self.emitted_total = state["emitted_total"]
        if state.get("vocabulary") is not None and self.drafter.vocabulary.is_reduced:
            self.drafter.vocabulary.target_ids.copy_(state["vocabulary"])
            self.drafter.refresh_draft_head()


def _all_reduce(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        torch.distributed.all_reduce(tensor)
    return tensor


def _copy_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.detach().clone() for name, parameter in module.named_parameters()}


def _load_parameters(module: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            parameter.copy_(values[name])
