"""Record a fresh rollout of a recipe for `tlt profile`, without training.

`record_rollout(recipe, steps, trace_path)` loads the recipe's policy and task, then for each
step generates the same prompts `tlt train` would (training/step.py: step s, worker w gets the w-th slice of
step s's prompts, `group_size` samples each, sampling seeded by (seed, step, worker)) with the embedded
engine, its linear layers in the recipe's `rollout.linear_forms` as a worker's, and writes a tlt
trace (request, worker and step records) that `load_records` reads back.

Simplification, stated in the trace's run record and docs/running.md: everything runs in this one
process. The `workers.count` shards of a step are generated one after the other, each on
`workers.threads_per_worker` threads, and each shard's times are shifted so that all shards start
together at the step's start, as parallel workers would. Contention between real worker processes
is not reproduced, and with no training the policy stays the initial one, so later steps only
differ by their prompts and samples. Step records carry no step_seconds (rollout only); their
memory_peak_gb is this process's resident peak in the step (the rollout's, with every shard's
sequences in one process one after the other).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tlt_cli.config import Recipe
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.profile.records import ProfileRecords, read_trace_records
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion
from tlt_cli.tasks.base import Task
from tlt_cli.trace import TraceWriter
from tlt_cli.training import memory, setup
from tlt_cli.training.step import shard_sampling_seed, step_shard
from tlt_cli.tuning.threads import torch_threads
from tlt_cli.versions import installed_versions

SIMPLIFICATION = "one process; worker shards generated one after another and re-timed to start together"


def record_rollout(
    recipe: Recipe, steps: int, trace_path: Path, on_step: Callable[[int], None] | None = None
) -> ProfileRecords:
    """Generate `steps` steps of the recipe's rollout, write them as a trace at trace_path, return its records."""
    if steps < 1:
        raise ValueError(f"steps is {steps}; record at least 1 step.")
    policy, tokenizer = setup.policy_and_tokenizer(recipe)
    task = setup.task(recipe)
    sampling = setup.sampling(recipe)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path.unlink(missing_ok=True)
    writer = TraceWriter(trace_path)
    with torch_threads(recipe.workers.threads_per_worker):
        try:
            # as a worker decodes: its thread count, batch, linear forms and dtype (SD off here)
            decode = setup.decode_plan(recipe, None, setup.PlanRequest(speculates=False, costs=False))
            engine = EmbeddedEngine(
                policy,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                linear_plan=decode.linear_plan,
                dtype=decode.torch_dtype,
            )
            writer.write(
                {
                    "type": "run",
                    "name": recipe.run.name,
                    "world_size": recipe.workers.count,
                    "steps": steps,
                    "resumed_from_step": None,
                    "recorded_by": "tlt profile",
                    "simplification": SIMPLIFICATION,
                    "versions": installed_versions(),
                    "rollout_precision": {"0": decode.precision},
                }
            )
            step_start = time.time()
            for step in range(steps):
                memory.reset_peak_resident()
                records = _record_step(recipe, task, tokenizer, engine, sampling, step, step_start)
                # this one process generated every shard: its peak stands for a worker's rollout peak
                records[-1]["memory_peak_gb"] = memory.peak_resident_bytes() / memory.GB
                for record in records:
                    writer.write(record)
                step_start = records[-1]["rollout_end"]
                if on_step is not None:
                    on_step(step)
        finally:
            writer.close()
    records = read_trace_records(trace_path)
    records.kind = "recipe"
    return records


def _record_step(
    recipe: Recipe,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    engine: EmbeddedEngine,
    sampling: SamplingParams,
    step: int,
    step_start: float,
) -> list[dict[str, Any]]:
    """Request records of every shard, then one worker record per shard, then the step record."""
    requests, busy_ends = [], []
    for worker in range(recipe.workers.count):
        requests_of_shard = step_shard(recipe, task, tokenizer, step, worker).requests
        generator = torch.Generator().manual_seed(shard_sampling_seed(recipe, step, worker))
        call_start = time.time()
        completions = engine.generate(requests_of_shard, sampling, generator)
        # as if every worker had started its shard at the step's start
        shift = step_start - call_start
        busy_ends.append(time.time() + shift)
        requests += [_request_record(step, worker, completion, shift) for completion in completions]
    rollout_end = max(busy_ends)
    workers = [
        {
            "type": "worker",
            "step": step,
            "worker": worker,
            "busy_start": step_start,
            "busy_end": busy_end,
            "idle_start": busy_end,
            "idle_end": rollout_end,
            "idle_seconds": rollout_end - busy_end,
        }
        for worker, busy_end in enumerate(busy_ends)
    ]
    step_record = {
        "type": "step",
        "step": step,
        "rollout_start": step_start,
        "rollout_end": rollout_end,
        "rollout_seconds": rollout_end - step_start,
        "idle_worker_seconds": sum(worker["idle_seconds"] for worker in workers),
    }
    return requests + workers + [step_record]


def _request_record(step: int, worker: int, completion: Completion, shift: float) -> dict[str, Any]:
    return {
        "type": "request",
        "step": step,
        "worker": worker,
        "request_id": completion.request_id,
        "start": completion.start + shift,
        "end": completion.end + shift,
        "prompt_tokens": len(completion.prompt_ids),
        "tokens": len(completion.response_ids),
        "finished_by_eos": completion.finished_by_eos,
    }
