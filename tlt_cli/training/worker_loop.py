"""One worker process: a DeepSpeed rank with its rollout shard, running the GRPO step loop.

`worker_main` is the body of every native rank (tlt_cli/trainers.py names it for `train.trainer: native`):
spawned by the driver (one per rank), or run by tlt_cli/processes/launched_rank.py in a rank the
DeepSpeed launcher started. Its parts (policy, task, drafter, rollout backend, sampling) come from
the recipe through setup.py. Each step reads as the dataflow: rollout the shard -> wait for the
others (idle) -> a drafter that diverged in the rollout reset or turned off, alike on every rank
(drafter_divergence.py) -> reward -> advantages -> log-probs -> actor update -> rollout backend brought up
to date -> report to the driver -> checkpoint when due. Every rank sends its `WorkerStepReport`
(tlt_cli/processes/messages.py), with its resident peaks in the step's rollout and update
(training/memory.py) and its resident set by part (training/memory_parts.py, which also returns what each
phase freed), to the driver with `events.put` (a multiprocessing queue, or the TCP channel
of tlt_cli/processes/event_channel.py); the driver writes the trace. The rollout goes
through the RolloutBackend (tlt_cli/rollout/backend.py) `rollout.backend` names: the embedded
engine sharing the actor's weights, or the SGLang servers this rank owns, which it starts before
its first step and stops however it ends.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from tlt_cli.checkpoint import save_collectively
from tlt_cli.config import CPU_DEVICES
from tlt_cli.engine.sampling import NonFiniteLogits
from tlt_cli.errors import TrainingDiverged
from tlt_cli.plugins import PluginHost, StepContext, agree_across_workers, build_plugins
from tlt_cli.processes.distributed import RolloutBarrier, barrier_timeout, init_worker_process
from tlt_cli.processes.messages import (
    WorkerFailed,
    WorkerFinished,
    WorkerProgress,
    WorkerSpec,
    WorkerStarting,
    WorkerStepReport,
)
from tlt_cli.processes.op_build import EXTENSIONS_FOLDER
from tlt_cli.processes.worker_process import exit_with_parent, redirect_output
from tlt_cli.rollout.types import Completion
from tlt_cli.trace import request_record
from tlt_cli.training import memory, rollout_backends, setup
from tlt_cli.training.drafter_divergence import DrafterAction, DrafterWatch, reset_in_place
from tlt_cli.training.memory_parts import MemoryWatch
from tlt_cli.training.step import StepShard, grpo_update, shard_rewards, shard_sampling_seed, step_shard, worker_actor

# prompts of the step (one per group) a rollout backend that pushes weights probes acceptance on
PROBE_PROMPTS = 2


def step_memory_metrics(rollout_peak: int, update_peak: int) -> dict[str, float]:
    """This rank's resident peaks (GB) in the step's rollout and update (reward, update, weight sync), and the
    highest of any rank (one all_gather_object), so the step record's mean over ranks is that highest."""
    peaks: list[int | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(peaks, max(rollout_peak, update_peak))
    return {
        "memory_rollout_peak_gb": rollout_peak / memory.GB,
        "memory_update_peak_gb": update_peak / memory.GB,
        "memory_peak_gb": max(peak or 0 for peak in peaks) / memory.GB,
    }


def worker_main(spec: WorkerSpec, events: Any) -> None:
    """Process entry point: run the loop, report failure instead of dying silently."""
    exit_with_parent(spec.address.rendezvous_directory)
    redirect_output(spec.run_directory / "workers" / f"worker-{spec.address.rank}.log")
    try:
        loop = WorkerLoop(spec, events)
        try:
            loop.run()
        finally:
            loop.rollout_backend.stop()
        events.put(WorkerFinished(spec.address.rank))
    except BaseException as error:  # reported to the driver, which stops the run
        events.put(WorkerFailed.of_exception(spec.address.rank, error))
        raise SystemExit(1) from None


class WorkerLoop:
    """The per-rank GRPO loop."""

    def __init__(self, spec: WorkerSpec, events: Any):
        recipe = spec.recipe
        self.spec, self.events, self.recipe = spec, events, recipe
        self.rank = spec.address.rank
        init_worker_process(
            spec.address,
            recipe.workers.threads_per_worker,
            spec.model_cache / EXTENSIONS_FOLDER,
            on_gpus=recipe.actor.devices != CPU_DEVICES,
            tell=lambda activity: events.put(WorkerStarting(self.rank, activity)),
        )
        torch.manual_seed(recipe.run.seed)
        policy, self.tokenizer = setup.policy_and_tokenizer(recipe)
        self.task = setup.task(recipe)
        self.actor = worker_actor(recipe, policy)
        self.actor.engine.eval()
        self.drafter = None
        if setup.drafter_needed(recipe):
            # on the policy's device and dtype (the drafter shares its embedding, norm and lm_head)
            self.drafter = setup.starting_drafter(recipe, spec.drafter_init, self.actor.policy).to(
                self.actor.device, self.actor.dtype
            )
        self.rollout_backend = rollout_backends.rollout_backend(
            recipe,
            self.actor.policy,
            self.tokenizer,
            self.drafter,
            rollout_backends.BackendPlace(
                self.rank,
                spec.address.rank_on_node,
                spec.run_directory,
                spec.plan,
                drafter_trained=spec.drafter_init is not None or spec.resume_from is not None,
            ),
        )
        self.barrier = RolloutBarrier(spec.address, barrier_timeout(recipe.workers.step_timeout_s))
        plugins = build_plugins(recipe.plugins.enabled, dict(recipe.plugins.options), recipe)
        self.plugins = PluginHost(plugins, agree=agree_across_workers)
        self.sampling = setup.sampling(recipe)
        self.drafter_watch = DrafterWatch(recipe.drafter)
        self.memory = MemoryWatch.for_recipe(recipe, self.actor.policy, self.actor.engine.optimizer, self.drafter)
        if spec.resume_from is not None:
            self.actor.load(spec.resume_from)
            self.rollout_backend.load_state(self._rollout_state_path(spec.resume_from))
            self.plugins.call("on_checkpoint_load", spec.resume_from)

    def start_rollout(self) -> None:
        """Start the rollout backend; after a resume, bring it up to the checkpoint's weights."""
        for line in self.rollout_backend.start():
            print(f"worker {self.rank}: {line}", flush=True)
        if self.spec.resume_from is not None:
            self.rollout_backend.after_update(f"step-{self.spec.start_step}", drafter_version=None, probe_prompts=())

    def run(self) -> None:
        self.start_rollout()
        for step in range(self.spec.start_step, self.recipe.train.steps):
            try:
                report = self.run_step(step)
            except (NonFiniteLogits, TrainingDiverged) as error:
                raise TrainingDiverged(self.divergence(step, error)) from error
            next_step = step + 1
            if next_step % self.recipe.checkpoint.every == 0 or next_step == self.recipe.train.steps:
                self.progress(step, "saving the checkpoint")
                report.checkpoint = str(self.save_checkpoint(next_step))
            self.events.put(report)

    def divergence(self, step: int, error: ArithmeticError | TrainingDiverged) -> str:
        """One sentence: what stopped being finite at `step`, and the likely cause (the model or the temperature
        before this run updated it; the learning rate after). Only the policy's: a drafter that diverged does not
        stop the run (settle_drafter)."""
        recipe = self.recipe
        if step > self.spec.start_step:
            cause = f"most likely actor.lr {recipe.actor.lr} is too high"
        elif isinstance(error, NonFiniteLogits):
            temperature = recipe.rollout.temperature
            cause = f"before any update of this run: the model's weights, or rollout.temperature {temperature}"
        else:
            cap = recipe.actor.rollout_correction_cap
            cause = f"in the first update of this run: the model's weights, or actor.rollout_correction_cap {cap}"
        return f"step {step}: {error}, so training diverged ({cause})"

    def run_step(self, step: int) -> WorkerStepReport:
        context = StepContext(
            step=step,
            worker=self.rank,
            world_size=self.spec.address.world_size,
            engine=self.rollout_backend,
            policy=self.actor.policy,
            drafter=self.drafter,
        )
        self.progress(step, "waiting for every worker to start the step", waiting=True)
        torch.distributed.barrier()
        rollout_start = time.time()
        memory.reset_peak_resident()
        self.progress(step, "in the rollout")
        self.plugins.call("on_rollout_start", context)
        shard = step_shard(self.recipe, self.task, self.tokenizer, step, self.rank)
        completions, busy_end = self.rollout(step, shard, context)
        self.barrier.mark_done(step)
        self.progress(step, "waiting at the rollout barrier", waiting=True)
        self.barrier.wait(step, while_idle=self._hook("on_worker_idle", context))
        idle_end = time.time()
        drafter_action = self.settle_drafter(step, context)
        rollout_peak = memory.peak_resident_bytes()
        self.memory.phase_end()
        memory.reset_peak_resident()
        self.progress(step, "in the reward and update")
        self.plugins.call("on_rollout_end", context)
        rewards = shard_rewards(self.task, self.tokenizer, shard, completions, self.recipe.train.group_size)
        reward_end = time.time()
        update = grpo_update(
            self.actor,
            completions,
            rewards,
            self.recipe.train.group_size,
            self.tokenizer.pad_token_id,
            self._hook("on_hidden_states", context),
        )
        context.metrics.update(
            self.rollout_backend.after_update(f"step-{step + 1}", context.drafter_version, self.probe_prompts(shard))
        )
        self.plugins.call("on_weights_updated", context)
        update_peak = memory.peak_resident_bytes()
        context.metrics.update(step_memory_metrics(rollout_peak, update_peak))
        context.metrics.update(self.memory.step_end(step, rollout_peak, update_peak))
        return WorkerStepReport(
            step=step,
            worker=self.rank,
            rollout_start=rollout_start,
            busy_end=busy_end,
            idle_end=idle_end,
            reward_seconds=reward_end - idle_end,
            update_seconds=time.time() - reward_end,
            requests=[
                self.request_record(step, completion, reward)
                for completion, reward in zip(completions, rewards.tolist())
            ],
            update=update,
            plugin_metrics=context.metrics,
            plugin_failures=[vars(failure) for failure in self.plugins.take_failures()],
            sd_usage={label: vars(usage) for label, usage in self.rollout_backend.take_usage().items()},
            sd_warnings=self.rollout_backend.take_warnings(),
            memory_warnings=self.memory.take_warnings(),
            drafter_divergence=drafter_action.action if drafter_action is not None else None,
            drafter_divergence_message=drafter_action.message if drafter_action is not None else None,
        )

    def settle_drafter(self, step: int, context: StepContext) -> DrafterAction | None:
        """After the rollout barrier: what every rank agreed to do about a drafter that diverged in the rollout on any
        of them (drafter_divergence.py), done: fresh weights in place, and the drafter turned off if it diverged
        again soon."""
        if self.drafter is None:
            return None
        action = self.drafter_watch.after_rollout(step, self.rollout_backend.drafter_diverged())
        if action is None:
            return None
        # turned off too: no checkpoint keeps, and no later run starts from, the diverged weights
        reset_in_place(self.drafter, setup.fresh_drafter(self.recipe, self.actor.policy))
        self.rollout_backend.drafter_replaced(action.turned_off)
        self.plugins.call("on_drafter_reset", context, action.turned_off)
        print(f"worker {self.rank}: {action.message}", flush=True)
        return action

    def progress(self, step: int, activity: str, waiting: bool = False) -> None:
        """Tell the driver what this rank does now in `step` (its step deadline names a stuck rank by it)."""
        self.events.put(WorkerProgress(self.rank, step, activity, waiting, os.getpid(), socket.gethostname()))

    def rollout(self, step: int, shard: StepShard, context: StepContext) -> tuple[list[Completion], float]:
        """This rank's completions, sorted by request id, and when its last request finished."""
        return self.rollout_backend.generate(
            shard.requests,
            self.sampling,
            shard_sampling_seed(self.recipe, step, self.rank),
            self._hook("on_request_finished", context),
        )

    def probe_prompts(self, shard: StepShard) -> list[tuple[int, ...]]:
        """The first prompts of the step's groups, to check acceptance on after a weight push."""
        return [request.prompt_ids for request in shard.requests[:: self.recipe.train.group_size][:PROBE_PROMPTS]]

    def _hook(self, hook: str, context: StepContext):
        """A callback that forwards to the plugins' `hook` with the context, or None when no plugin has it."""
        if not self.plugins.wants(hook):
            return None
        return lambda *arguments: self.plugins.call(hook, context, *arguments)

    def request_record(self, step: int, completion: Completion, reward: float) -> dict[str, Any]:
        stats = completion.speculative
        return request_record(
            step=step,
            worker=self.rank,
            request_id=completion.request_id,
            start=completion.start,
            end=completion.end,
            prompt_tokens=len(completion.prompt_ids),
            tokens=len(completion.response_ids),
            reward=reward,
            finished_by_eos=completion.finished_by_eos,
            verify_passes=stats.verify_passes,
            accepted_tokens=stats.accepted_draft_tokens,
            accepted_by_depth=stats.accepted_by_depth,
            proposed_by_depth=stats.proposed_by_depth,
        )

    def _rollout_state_path(self, directory: Path) -> Path:
        return directory / f"adaptive-schedule-rank-{self.rank}.pt"

    def save_checkpoint(self, next_step: int) -> Path:
        def save_parts(directory: Path) -> None:
            self.actor.save(directory)
            self.rollout_backend.save_state(self._rollout_state_path(directory))
            self.plugins.call("on_checkpoint_save", directory)

        return save_collectively(
            self.spec.run_directory / "checkpoints",
            next_step,
            self.rank,
            torch.distributed.barrier,
            save_parts,
            extra_state={"world_size": self.spec.address.world_size},
            keep=self.recipe.checkpoint.keep,
        )
