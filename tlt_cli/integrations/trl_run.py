"""The processes of `tlt train` when train.trainer is trl: TRL's GRPOTrainer, tlt's rollout, tlt's trace.

The driver (tlt_cli/processes/driver.py) runs a TRL recipe as it runs a native one: it prepares
the drafter and the run's plan (tlt_cli/tuning/run_plan.py), makes the run directory, starts workers.count
processes on this machine and turns their per-step reports into trace.jsonl, the live display and the
summary; only the body of each process differs. `trl_worker_main` joins the process group the way
accelerate expects (gloo on CPU), builds a GRPOTrainer from the recipe (tlt_cli/integrations/trl_recipe.py)
that generates with tlt's rollout (`tlt_rollout` handed the run's plan: speculative decoding, the adaptive
rule table, the drafter sidecar in the wait between processes) or, with rollout.backend trl, with TRL's own
generation, and trains. TRL keeps its loss, advantages, reference model and optimizer step.

`StepReporter`, a TrainerCallback, turns each tlt step (one generation batch and its
actor.ppo_epochs optimizer steps) into the `WorkerStepReport` a native worker sends: the rollout
window, this process's wait, the scoring and update seconds (tlt_cli/integrations/trl_trainer.py),
one request per completion with its reward, SD usage, warnings, sidecar metrics, and TRL's loss,
grad norm, KL, entropy and clip ratio as the update, with the rollout/learner mismatch tlt's rollout brings
(K3 KL and importance weights, measured and corrected by the trainer) as a native run reports it.
Checkpoints follow tlt's layout and atomicity
(tlt_cli/checkpoint.py) and hold TRL's own checkpoint files (model, optimizer, scheduler, RNG,
trainer state: `--resume` hands the folder to `trainer.train(resume_from_checkpoint=...)`), the
rollout's state and drafter, and the actor weights where `tlt export-drafter` reads them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from tlt_cli.checkpoint import save_collectively
from tlt_cli.config import Bfloat16Rounding, RolloutBackendName
from tlt_cli.integrations.trl import RolloutRecord, tlt_rollout
from tlt_cli.integrations.trl_recipe import (
    TaskReward,
    build_grpo_config,
    prompt_dataset,
)
from tlt_cli.plugins import trl_reporting
from tlt_cli.processes.distributed import WorkerAddress, one_node_rendezvous
from tlt_cli.processes.messages import WorkerFailed, WorkerFinished, WorkerSpec, WorkerStepReport
from tlt_cli.processes.worker_process import exit_with_parent, redirect_output
from tlt_cli.trace import request_record
from tlt_cli.training import setup

# TRL's logged numbers reported as the step's update (actor_<name> in the trace, "/" as "_")
UPDATE_LOGS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean")
CHECKPOINTS = "checkpoints"
TRAINER_STATE_FILE = "trainer_state.json"


def trl_worker_main(spec: WorkerSpec, events: Any) -> None:
    """Process entry point (the driver spawns one per process): train, report failure instead of dying silently."""
    exit_with_parent(spec.address.rendezvous_directory)
    redirect_output(spec.run_directory / "workers" / f"worker-{spec.address.rank}.log")
    try:
        TrlRun(spec, events).train()
        events.put(WorkerFinished(spec.address.rank))
    except BaseException as error:  # reported to the driver, which stops the run
        events.put(WorkerFailed.of_exception(spec.address.rank, error))
        raise SystemExit(1) from None


def join_processes(address: WorkerAddress, threads: int) -> None:
    """The environment accelerate reads to join this process to the others (it starts gloo on CPU itself)."""
    os.environ.update(
        RANK=str(address.rank),
        LOCAL_RANK=str(address.rank_on_node),
        WORLD_SIZE=str(address.world_size),
        LOCAL_WORLD_SIZE=str(address.world_size),
        MASTER_ADDR=address.master_address,
        MASTER_PORT=str(address.master_port),
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    torch.set_num_threads(threads)
    if address.rendezvous_directory is not None:
        # processes of one machine meet in a file, not a TCP store; accelerate then uses this group
        torch.distributed.init_process_group("gloo", **one_node_rendezvous(address))


class TrlRun:
    """One process of a TRL run: the trainer built from the recipe, and what it reports and saves."""

    def __init__(self, spec: WorkerSpec, events: Any):
        from tlt_cli.integrations.trl_trainer import TimedGRPOTrainer

        recipe = spec.recipe
        self.spec, self.events, self.recipe = spec, events, recipe
        self.rank, self.processes = spec.address.rank, spec.address.world_size
        join_processes(spec.address, recipe.workers.threads_per_worker)
        # where TRL's own loggers (report_to) write under the run directory, and how (W&B offline by default)
        os.environ.update(trl_reporting(recipe.plugins.enabled, dict(recipe.plugins.options), spec.run_directory)[1])
        torch.manual_seed(recipe.run.seed)
        policy, tokenizer = setup.policy_and_tokenizer(recipe)
        task = setup.task(recipe)
        self.reward = TaskReward(task)
        self.rollout = (
            None
            if recipe.rollout.backend == RolloutBackendName.trl
            else tlt_rollout(
                drafter=str(spec.drafter_init) if spec.drafter_init else "random",
                sidecar=list(recipe.plugins.enabled),
                drafter_config=recipe.drafter,
                seed=recipe.run.seed,
                plan=spec.plan,  # the driver's: how it decodes and speculates
            )
        )
        self.trainer = TimedGRPOTrainer(
            model=policy,
            reward_funcs=self.reward,
            args=build_grpo_config(recipe, self.processes, spec.run_directory),
            train_dataset=prompt_dataset(task, recipe, tokenizer),
            processing_class=tokenizer,
            rollout_func=self.rollout,
            callbacks=[StepReporter(self)],
            stochastic_rounding=recipe.actor.bfloat16_rounding == Bfloat16Rounding.stochastic,
        )

    def train(self) -> None:
        resume = self.spec.resume_from
        if resume is not None and self.rollout is not None:
            self.rollout.load_state(resume, self.rank)
        self.trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)

    def finish_step(self, step: int, update: dict[str, float]) -> None:
        """Report tlt step `step` to the driver (checkpointing first when one is due)."""
        step_end = time.time()
        generation = self.trainer.take_generations()[-1]
        record = self.rollout.take_records()[-1] if self.rollout is not None else None
        report = WorkerStepReport(
            step=step,
            worker=self.rank,
            rollout_start=generation.start,
            busy_end=record.busy_end if record is not None else generation.busy_end,
            idle_end=generation.idle_end,
            reward_seconds=generation.scored_end - generation.idle_end,
            update_seconds=step_end - generation.scored_end,
            requests=self._requests(step, generation, record),
            # the rollout/learner mismatch is the update's as in a native run (actor_rollout_* in the trace)
            update={**update, **generation.mismatch},
            plugin_metrics=_sidecar_metrics(record),
            sd_usage=record.sd_usage if record is not None else {},
            sd_warnings=record.warnings if record is not None else [],
        )
        next_step = step + 1
        if next_step % self.recipe.checkpoint.every == 0 or next_step == self.recipe.train.steps:
            report.checkpoint = str(self.save_checkpoint(next_step))
        self.events.put(report)

    def _requests(self, step: int, generation: Any, record: RolloutRecord | None) -> list[dict[str, Any]]:
        """One trace record per completion of this process, in TRL's order, with the reward TRL scored."""
        if record is not None:
            rows = [
                (
                    request.prompt_tokens,
                    request.response_tokens,
                    request.finished_by_eos,
                    request.end,
                    request.verify_passes,
                    request.accepted_draft_tokens,
                )
                for request in record.requests
            ]
        else:
            eos_ids = set(self.trainer.eos_token_ids)
            rows = [
                (prompt_tokens, len(ids), bool(ids) and ids[-1] in eos_ids, generation.busy_end, 0, 0)
                for prompt_tokens, ids in zip(generation.prompt_lengths, generation.completion_ids, strict=True)
            ]
        return [
            request_record(
                step=step,
                worker=self.rank,
                request_id=index,
                start=generation.start,
                end=end,
                prompt_tokens=prompt_tokens,
                tokens=tokens,
                reward=reward,
                finished_by_eos=eos,
                verify_passes=passes,
                accepted_tokens=accepted,
            )
            for index, ((prompt_tokens, tokens, eos, end, passes, accepted), reward) in enumerate(
                zip(rows, self.reward.latest, strict=True)
            )
        ]

    def save_checkpoint(self, next_step: int) -> Path:
        barrier = torch.distributed.barrier if self.processes > 1 else _no_barrier
        return save_collectively(
            self.spec.run_directory / CHECKPOINTS,
            next_step,
            self.rank,
            barrier,
            self._save_parts,
            extra_state={"world_size": self.processes, "trainer": "trl"},
            keep=self.recipe.checkpoint.keep,
        )

    def _save_parts(self, directory: Path) -> None:
        """TRL's checkpoint files, the rollout's state and drafter, and the actor weights for export-drafter."""
        from tlt_cli.training.actor import ACTOR_WEIGHTS_FILE, CHECKPOINT_TAG

        trainer = self.trainer
        trainer.save_model(str(directory), _internal_call=True)
        trainer._save_optimizer_and_scheduler(str(directory))
        trainer._save_rng_state(str(directory))
        if trainer.args.should_save:
            trainer.state.save_to_json(str(directory / TRAINER_STATE_FILE))
            (directory / CHECKPOINT_TAG).mkdir()
            policy = trainer.accelerator.unwrap_model(trainer.model)
            torch.save({"module": policy.state_dict()}, directory / CHECKPOINT_TAG / ACTOR_WEIGHTS_FILE)
        if self.rollout is not None:
            self.rollout.save_state(directory, self.rank)


class StepReporter(TrainerCallback):
    """Calls `TrlRun.finish_step` once a tlt step's last optimizer step is logged (TRL logs every step)."""

    def __init__(self, run: TrlRun):
        self.run = run
        self.stepped = False
        self.updates: list[dict[str, float]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self.stepped = True

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not self.stepped:  # the end-of-training summary, not a step
            return
        self.stepped = False
        self.updates.append(
            {
                name.replace("/", "_"): float(value)
                for name, value in (logs or {}).items()
                if name in UPDATE_LOGS and value is not None
            }
        )
        epochs = self.run.recipe.actor.ppo_epochs
        if state.global_step % epochs == 0:
            self.run.finish_step(state.global_step // epochs - 1, _mean(self.updates))
            self.updates = []


def _mean(updates: list[dict[str, float]]) -> dict[str, float]:
    names = sorted({name for update in updates for name in update})
    return {
        name: sum(update[name] for update in updates if name in update) / sum(name in update for update in updates)
        for name in names
    }


def _sidecar_metrics(record: RolloutRecord | None) -> dict[str, float]:
    """The drafter-training plugin's numbers for the trace's worker and step records (its wait: the worker record)."""
    if record is None:
        return {}
    return {name: value for name, value in record.sidecar.items() if name != "idle_seconds"}


def _no_barrier() -> None:
    """One process has no one to wait for."""
