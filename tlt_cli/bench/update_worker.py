"""One measurement of `tlt bench update`, in a fresh process: one worker's GRPO update on its measured batch, and,
when asked, that update profiled against its roofline and a few steps of rollout and update.

    python -m tlt_cli.bench.update_worker \
        '{"recipe": "tiny-cpu", "overrides": [], "profile": false, "steps": 0, "response_tokens": 0}'

tlt_cli/bench/update.py starts it once per variant and repeat, so each measurement has its own peak memory,
allocator and process group (joined as tlt train's workers join theirs: in a file of a private folder, no
listening port), and reads the JSON line it prints last. The process is one rank holding the whole
optimizer state, planned as the driver plans a run (setup.py `planned_run`: actor.precision resolved, the decode
plan), with one worker's actor as the worker loop builds it. Its measured batch: prompts_per_step /
workers.count prompts of the task x group_size random responses, every one max_new_tokens long (the worst case)
or drawn long-tailed around a mean length, with random advantages, all from the recipe's seed, batched by the
actor (packed by groups when it packs). Measured: the first update's wall-clock and CPU seconds (CPU time of all
the process's threads: steadier on a shared machine), its peak resident memory (VmHWM, reset before) against
tlt's estimate (training/memory.py), and the share of torch's product rate it reached (update_roofline.py: the
products of the update's own shapes timed in this process). With profile: a second update under torch.profiler,
by category and by phase (update_profile.py). With steps N: N of the run's steps as its rank 0 builds them
(training/step.py: the shard's prompts and sampling seed of each step, the recipe's embedded backend, reward, group
advantages and update), on the policy the measured updates left, each step's rollout and update peaks (malloc's
free pages returned after each phase, and the kernel caches bounded by update.py, as in a worker:
tlt_cli/memory_hygiene.py).
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from tlt_cli.bench import update_roofline
from tlt_cli.bench.update_profile import label_update_parts, profile_update
from tlt_cli.config import Recipe, load_recipe
from tlt_cli.memory_hygiene import return_freed_memory
from tlt_cli.processes.distributed import WorkerAddress, init_worker_process, private_rendezvous_directory
from tlt_cli.processes.op_build import EXTENSIONS_FOLDER
from tlt_cli.processes.worker_process import exit_with_parent
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.rollout.types import Completion
from tlt_cli.training import memory, rollout_backends, setup
from tlt_cli.training.actor import Actor
from tlt_cli.training.policy_batch import PolicyBatch
from tlt_cli.training.step import (
    encoded_prompts,
    grpo_update,
    shard_problems,
    shard_rewards,
    shard_sampling_seed,
    step_shard,
    worker_actor,
)
from tlt_cli.tuning.run_plan import RunPlan
from tlt_cli.tuning.threads import torch_threads

# the dtypes of update_roofline's product rates, by actor precision (the log-prob head runs in float32 always); a
# profile times both, so its roofline shows what the other precision's products would reach
RATE_DTYPES = {"fp32": ["fp32"], "bf16": ["fp32", "bf16"]}
PROFILE_RATE_DTYPES = ["fp32", "bf16"]


def main() -> None:
    """The process entry point: the request (JSON) in argv[1], the result as the last line of stdout."""
    request = json.loads(sys.argv[1])
    rendezvous_directory = private_rendezvous_directory()  # where its process group meets: no port
    # exits with the bench (without a "parent", run by hand: with its parent), removing the folder
    exit_with_parent(rendezvous_directory, request.get("parent"))
    arguments = (request["recipe"], request["overrides"], request["profile"], request["steps"])
    try:
        result = measure(*arguments, request["response_tokens"], rendezvous_directory)
    finally:
        shutil.rmtree(rendezvous_directory, ignore_errors=True)
    print(json.dumps(result))


def measure(
    recipe_name: str, overrides: list[str], profile: bool, steps: int, response_tokens: int, rendezvous_directory: Path
) -> dict:
    """One worker's first update on its measured batch (module docstring); the profile and steps when asked. The
    process group meets in `rendezvous_directory` (distributed.py `private_rendezvous_directory`, which the caller
    removes)."""
    recipe = load_recipe(resolve_recipe_path(recipe_name), overrides)
    join_one_rank(recipe, rendezvous_directory)
    torch.manual_seed(recipe.run.seed)
    with torch_threads(recipe.workers.threads_per_worker):
        drafter_folder, _ = setup.prepare_drafter(recipe, setup.model_cache(recipe))
        recipe, plan = setup.planned_run(recipe, drafter_folder)
        policy, tokenizer = setup.policy_and_tokenizer(recipe)
        actor = worker_actor(recipe, policy)
        batch = measured_batch(recipe, actor, tokenizer, response_tokens)
        result = {"precision": str(plan.update.precision), **timed_update(recipe, actor, batch)}
        result["roofline"] = roofline_report(recipe, actor, batch, plan, result["update_cpu_seconds"])
        if profile:
            result["profile"] = profiled_update(recipe, actor, batch, plan)
        if steps:
            result["steps"] = list(rollout_and_update_steps(recipe, plan, actor, tokenizer, drafter_folder, steps))
    return result


def join_one_rank(recipe: Recipe, rendezvous_directory: Path) -> None:
    """This process as the one rank of a CPU process group, joined as `tlt train`'s workers join theirs
    (distributed.py `init_worker_process`): DeepSpeed's compiled ops where a worker keeps them (built under tlt's
    build lock), and the group met in a file in `rendezvous_directory`, so no port listens (torch's TCPStore would
    listen on every interface)."""
    address = WorkerAddress(0, 1, master_port=0, rendezvous_directory=rendezvous_directory)
    extensions_directory = setup.model_cache(recipe) / EXTENSIONS_FOLDER
    init_worker_process(address, recipe.workers.threads_per_worker, extensions_directory, tell=print)


def measured_batch(recipe: Recipe, actor: Actor, tokenizer, response_tokens: int) -> PolicyBatch:
    """One worker's prompts of the task x group_size random responses with random advantages, as the actor batches
    them: each response max_new_tokens long (response_tokens 0, the worst case), or lengths drawn from an
    exponential of mean response_tokens (a rollout's long tail), clipped to 1..max_new_tokens."""
    task, group_size, longest = setup.task(recipe), recipe.train.group_size, recipe.rollout.max_new_tokens
    vocab_size = actor.policy.config.vocab_size
    generator = torch.Generator().manual_seed(recipe.run.seed)
    prompts = encoded_prompts(tokenizer, shard_problems(recipe, task, 0, 0))
    completions = []
    for index in range(recipe.samples_per_worker):
        prompt_ids = prompts[index // group_size]
        length = longest
        if response_tokens:
            drawn = -response_tokens * torch.log1p(-torch.rand((), generator=generator))
            length = int(drawn.clamp(1, longest))
        response = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
        completions.append(Completion(index, prompt_ids, response, finished_by_eos=False, start=0.0, end=0.0))
    advantages = torch.randn(len(completions), generator=generator)
    return actor.policy_batch(completions, advantages, tokenizer.pad_token_id, group_size)


def timed_update(recipe: Recipe, actor: Actor, batch: PolicyBatch) -> dict:
    """The first `actor.update(batch)`: seconds, CPU seconds, resident memory before and at its peak, the estimate."""
    before = memory.resident_bytes()
    memory.reset_peak_resident()
    started, started_cpu = time.perf_counter(), time.process_time()
    metrics = actor.update(batch)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - started_cpu
    peak = memory.peak_resident_bytes()
    # the estimate for what this process is: one rank holding the whole optimizer state, with one worker's prompts
    one_rank = replace(
        recipe,
        workers=replace(recipe.workers, count=1),
        train=replace(recipe.train, prompts_per_step=recipe.prompts_per_worker),
    )
    estimate = memory.worker_peak_estimate(one_rank, memory.model_shape(recipe), memory.longest_prompt_tokens(recipe))
    return {
        "sequences": batch.size,
        "sequence_tokens": int(batch.input_ids.shape[1]),
        "response_tokens": int(batch.response_mask.sum()),
        "threads": recipe.workers.threads_per_worker,
        "update_seconds": seconds,
        "update_cpu_seconds": cpu_seconds,
        "resident_before_gb": before / memory.GB,
        "update_peak_gb": peak / memory.GB,
        "update_growth_gb": (peak - before) / memory.GB,
        "estimate_gb": estimate.total_bytes / memory.GB,
        "loss": metrics.loss,
        "grad_norm": metrics.grad_norm,
    }


def roofline_report(recipe: Recipe, actor: Actor, batch: PolicyBatch, plan: RunPlan, cpu_seconds: float) -> dict:
    """The update's products at its own shapes timed in this process, against the update's CPU seconds (both sides
    CPU time); without a profile every second counts as the whole update's, not a phase's."""
    parts, operations = counted_operations(recipe, actor, batch)
    precision = str(plan.update.precision)
    rates = update_roofline.measure_product_rates(operations.distinct_products(), RATE_DTYPES[precision])
    report = update_roofline.roofline(operations, rates, {}, cpu_seconds, precision)
    return {**report.as_dict(), "micro_batches": [asdict(part) for part in parts]}


def counted_operations(
    recipe: Recipe, actor: Actor, batch: PolicyBatch
) -> tuple[list[update_roofline.MicroBatchShape], update_roofline.UpdateOperations]:
    """The actor's micro-batches of `batch` and the operations of one update over them (update_roofline.py)."""
    micro_batches = actor.micro_batches(batch)
    parts = update_roofline.micro_batch_shapes(micro_batches, actor.packed_segments(micro_batches))
    operations = update_roofline.update_operations(
        memory.model_shape(recipe),
        parts,
        recipe.actor.gradient_checkpointing,
        ppo_epochs=recipe.actor.ppo_epochs,
        reductions_per_epoch=update_roofline.gradient_reductions(recipe.actor.zero_stage, len(parts)),
    )
    return parts, operations


def profiled_update(recipe: Recipe, actor: Actor, batch: PolicyBatch, plan: RunPlan) -> dict:
    """A second update (the first warmed up AdamW's state and the allocator) under torch.profiler, and its
    roofline by phase, both sides in CPU seconds."""
    label_update_parts(actor)
    profile = profile_update(actor, batch)
    _, operations = counted_operations(recipe, actor, batch)
    precision = str(plan.update.precision)
    rates = update_roofline.measure_product_rates(operations.distinct_products(), PROFILE_RATE_DTYPES)
    report = update_roofline.roofline(operations, rates, profile.phases_cpu_seconds(), profile.cpu_seconds, precision)
    return {
        "update_seconds_profiled": profile.seconds,
        "update_cpu_seconds_profiled": profile.cpu_seconds,
        "loss": profile.metrics.loss,
        "categories_seconds": profile.categories_seconds,
        "phases_seconds": profile.phases_seconds,
        "outside_operators_seconds": profile.outside_operators_seconds,
        "costliest_operators_seconds": profile.costliest_operators_seconds,
        "roofline": report.as_dict(),
    }


def rollout_and_update_steps(
    recipe: Recipe, plan: RunPlan, actor: Actor, tokenizer, drafter_folder: Path | None, steps: int
):
    """Each step's rollout and update peaks of this one rank (module docstring), as it finishes; the rollout
    backend's run folder is a temporary one, removed with the backend stopped once the steps end."""
    drafter = None
    if setup.drafter_needed(recipe):
        drafter = setup.starting_drafter(recipe, drafter_folder, actor.policy)
    with tempfile.TemporaryDirectory(prefix="tlt-bench-update-") as run_folder:
        place = rollout_backends.BackendPlace(0, 0, Path(run_folder), plan)
        backend = rollout_backends.rollout_backend(recipe, actor.policy, tokenizer, drafter, place)
        backend.start()
        try:
            for step in range(steps):
                yield measured_step(recipe, actor, tokenizer, backend, step)
        finally:
            backend.stop()


def measured_step(recipe: Recipe, actor: Actor, tokenizer, backend, step: int) -> dict:
    """One step of the task's rollout, reward, group advantages and update, with its peaks: rank 0's shard and
    sampling seed of the run's step `step` (training/step.py), so its responses are the run's."""
    task, sampling, group_size = setup.task(recipe), setup.sampling(recipe), recipe.train.group_size
    shard = step_shard(recipe, task, tokenizer, step, 0)
    memory.reset_peak_resident()
    completions, _ = backend.generate(shard.requests, sampling, shard_sampling_seed(recipe, step, 0), None)
    rollout_peak = memory.peak_resident_bytes()
    return_freed_memory()  # as a worker does after each phase (training/memory_parts.py)
    memory.reset_peak_resident()
    rewards = shard_rewards(task, tokenizer, shard, completions, group_size)
    started = time.perf_counter()
    grpo_update(actor, completions, rewards, group_size, tokenizer.pad_token_id)
    update_seconds = time.perf_counter() - started
    backend.after_update(f"step-{step + 1}", None, ())
    measured = {
        "step": step,
        "response_tokens": sum(len(completion.response_ids) for completion in completions),
        "longest_response": max(len(completion.response_ids) for completion in completions),
        "update_seconds": update_seconds,
        "rollout_peak_gb": rollout_peak / memory.GB,
        "update_peak_gb": memory.peak_resident_bytes() / memory.GB,
        "resident_after_gb": memory.resident_bytes() / memory.GB,
    }
    return_freed_memory()
    return measured


if __name__ == "__main__":
    main()
