"""A worker's peak memory: the GRPO update alone at several max_new_tokens, and a whole `tlt train` run.

    python scripts/bench_memory.py update --recipe real-cpu --max-new-tokens 512,1024,2048 \
        --out benchmarks/memory_update.json
    python scripts/bench_memory.py run --recipe real-cpu --out benchmarks/memory_run.json \
        train.steps=1 speculative.mode=off plugins.enabled=[]
    python scripts/bench_memory.py steps --recipe tiny-cpu --steps 30 --out benchmarks/memory_steps.json \
        actor.precision=fp32 rollout.dtype=float32 rollout.linear_forms=off speculative.mode=off plugins.enabled=[]

`update`: for each max_new_tokens, a fresh process builds the recipe's policy as one worker's DeepSpeed
actor (one rank, so ZeRO keeps the whole optimizer state) and runs one GRPO update on the worst case
a worker's rollout can hand it: prompts_per_step / workers.count prompts (the task's own, through
the chat template) x group_size responses, every one max_new_tokens long. It reports the resident
set before the update, the update's peak (VmHWM, reset just before) and its growth, the update's
seconds (wall-clock, and CPU time of all the process's threads: steadier on a shared machine) and
loss, and tlt's estimate of a worker's peak (tlt_cli/training/memory.py) for comparison.
Growth linear in tokens, with no tokens x vocabulary term, is what the chunked log-probs promise.

`steps`: one rank's rollout and update, step after step, in this process (the embedded rollout of one worker's
prompts of each step through the task's reward, group advantages, `actor.update`, `after_update`): the
resident peak of each step's rollout and of its update (VmHWM, reset before each), the resident set after it
and the step's longest response, to tell a worker's growth from its batches' lengths without the driver and
the other ranks.

`run`: runs `tlt train` with the overrides in a fresh run directory and samples, every 0.2 s, the
resident set of every process of the run (/proc); reports each process's peak (VmHWM, last read
before it exited), the peak of their sum, and, from the trace, each step's update seconds, loss
and the workers' own per-step peaks (in all, in the rollout and in the update). Prints a table,
writes JSON. Memory figures in GB (1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

GB = 1e9
SAMPLE_SECONDS = 0.2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("update", "run", "steps", "one-update"))
    parser.add_argument("--steps", type=int, default=30, help="steps of the rollout and update loop (steps)")
    parser.add_argument("--recipe", default="real-cpu")
    parser.add_argument("--max-new-tokens", default="512,2048", help="comma-separated lengths (update)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides")
    arguments = parser.parse_intermixed_args()
    if arguments.mode == "one-update":
        print(json.dumps(one_update(arguments.recipe, arguments.overrides)))
        return
    if arguments.mode == "update":
        lengths = [int(value) for value in arguments.max_new_tokens.split(",")]
        result = {"mode": "update", "recipe": arguments.recipe, "overrides": arguments.overrides, "rows": []}
        for length in lengths:
            result["rows"].append(update_in_fresh_process(arguments.recipe, arguments.overrides, length))
            print(json.dumps(result["rows"][-1]), flush=True)
        render_update(result["rows"])
    elif arguments.mode == "steps":
        result = {"mode": "steps", "recipe": arguments.recipe, "overrides": arguments.overrides, "steps": []}
        for row in rollout_and_update_steps(arguments.recipe, arguments.overrides, arguments.steps):
            result["steps"].append(row)
            print(json.dumps(row), flush=True)
    else:
        result = measure_run(arguments.recipe, arguments.overrides)
        render_run(result)
    if arguments.out is not None:
        arguments.out.parent.mkdir(parents=True, exist_ok=True)
        arguments.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {arguments.out}")


def update_in_fresh_process(recipe: str, overrides: list[str], max_new_tokens: int) -> dict:
    command = [sys.executable, __file__, "one-update", "--recipe", recipe, *overrides]
    command.append(f"rollout.max_new_tokens={max_new_tokens}")
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"the update at max_new_tokens {max_new_tokens} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def one_update(recipe_name: str, overrides: list[str]) -> dict:
    """One worker's first GRPO update on its worst-case batch, in this process (one rank)."""
    from tlt_cli.config import load_recipe
    from tlt_cli.recipes import resolve_recipe_path
    from tlt_cli.training import memory

    recipe, precision, actor, batch = worst_case_update(recipe_name, overrides)
    prompts = recipe.train.prompts_per_step // recipe.workers.count
    length = recipe.rollout.max_new_tokens
    before = memory.resident_bytes()
    memory.reset_peak_resident()
    start, start_cpu = time.perf_counter(), time.process_time()
    metrics = actor.update(batch)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    peak = memory.peak_resident_bytes()
    # the estimate for what this process is: one rank holding the whole optimizer state, with one worker's prompts
    one_rank = load_recipe(
        resolve_recipe_path(recipe_name),
        [*overrides, "workers.count=1", f"train.prompts_per_step={prompts}", f"actor.precision={precision.precision}"],
    )
    estimate = memory.worker_peak_estimate(one_rank, memory.model_shape(recipe), memory.longest_prompt_tokens(recipe))
    return {
        "max_new_tokens": length,
        "precision": precision.precision,
        "sequences": batch.size,
        "sequence_tokens": int(batch.input_ids.shape[1]),
        "resident_before_gb": before / GB,
        "update_peak_gb": peak / GB,
        "update_growth_gb": (peak - before) / GB,
        "estimate_gb": estimate.total_bytes / GB,
        "estimate_update_gb": estimate.update / GB,
        "estimate_training_state_gb": estimate.training_state / GB,
        "update_seconds": seconds,
        # CPU time of every thread of the process: steadier than wall-clock on a shared machine
        "update_cpu_seconds": cpu_seconds,
        "loss": metrics.loss,
        "grad_norm": metrics.grad_norm,
    }


def worst_case_update(recipe_name: str, overrides: list[str]):
    """(recipe, its UpdatePrecision, a one-rank Actor, the worst-case PolicyBatch) of one worker, in this
    process: prompts_per_step / workers.count prompts of the task x group_size random responses, each
    max_new_tokens long, and random advantages, all from the recipe's seed."""
    import torch

    from tlt_cli.config import load_recipe
    from tlt_cli.recipes import resolve_recipe_path
    from tlt_cli.rollout.types import Completion
    from tlt_cli.tasks.prompts import encode_prompt
    from tlt_cli.training import setup
    from tlt_cli.training.actor import Actor
    from tlt_cli.training.policy_batch import build_policy_batch
    from tlt_cli.training.update_precision import resolve_update_precision

    recipe = load_recipe(resolve_recipe_path(recipe_name), overrides)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    # where a worker keeps DeepSpeed's compiled ops (tlt_cli/training/worker_loop.py)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(setup.model_cache(recipe) / "torch_extensions")
    from tlt_cli.processes.distributed import import_deepspeed

    import_deepspeed().init_distributed(dist_backend="gloo")
    torch.set_num_threads(recipe.workers.threads_per_worker)
    torch.manual_seed(recipe.run.seed)
    recipe, precision = resolve_update_precision(
        recipe, setup.model_cache(recipe), lambda: setup.policy_and_tokenizer(recipe)[0]
    )
    policy, tokenizer = setup.policy_and_tokenizer(recipe)
    task = setup.task(recipe)
    prompts = recipe.train.prompts_per_step // recipe.workers.count
    group_size = recipe.train.group_size
    length = recipe.rollout.max_new_tokens
    actor = Actor(policy, recipe.actor, prompts * group_size, setup.reference_policy(recipe))
    generator = torch.Generator().manual_seed(recipe.run.seed)
    completions = []
    for index in range(prompts * group_size):
        prompt_ids = tuple(encode_prompt(tokenizer, task.problem(index // group_size).prompt))
        response = torch.randint(0, policy.config.vocab_size, (length,), generator=generator).tolist()
        completions.append(Completion(index, prompt_ids, response, finished_by_eos=False, start=0.0, end=0.0))
    advantages = torch.randn(len(completions), generator=generator)
    return recipe, precision, actor, build_policy_batch(completions, advantages, tokenizer.pad_token_id)


def rollout_and_update_steps(recipe_name: str, overrides: list[str], steps: int):
    """Each step's rollout and update peaks of one rank in this process (module docstring), as it finishes."""
    import torch

    from tlt_cli.rollout.types import RolloutRequest
    from tlt_cli.tasks.prompts import encode_prompt
    from tlt_cli.training import memory, setup
    from tlt_cli.training.grpo import group_advantages
    from tlt_cli.training.policy_batch import build_policy_batch

    recipe, _, actor, _ = worst_case_update(recipe_name, overrides)
    _, tokenizer = setup.policy_and_tokenizer(recipe)
    task = setup.task(recipe)
    place = setup.BackendPlace(0, 0, Path(tempfile.mkdtemp(prefix="bench-memory-")), decode=setup.decode_plan(recipe))
    backend = setup.rollout_backend(recipe, actor.policy, tokenizer, None, place)
    list(backend.start())
    group_size, prompts = recipe.train.group_size, recipe.train.prompts_per_step // recipe.workers.count
    for step in range(steps):
        problems = [task.problem(step * recipe.train.prompts_per_step + index) for index in range(prompts)]
        requests = [
            RolloutRequest(number * group_size + sample, tuple(encode_prompt(tokenizer, problem.prompt)), number)
            for number, problem in enumerate(problems)
            for sample in range(group_size)
        ]
        memory.reset_peak_resident()
        completions, _ = backend.generate(requests, setup.sampling(recipe), recipe.run.seed + step, None)
        rollout_peak = memory.peak_resident_bytes()
        memory.reset_peak_resident()
        responses = [tokenizer.decode(completion.response_ids, skip_special_tokens=True) for completion in completions]
        rewards = torch.tensor(
            [
                task.reward(problems[completion.request_id // group_size], response)
                for completion, response in zip(completions, responses)
            ]
        )
        actor.update(build_policy_batch(completions, group_advantages(rewards, group_size), tokenizer.pad_token_id))
        backend.after_update(f"step-{step + 1}", None, ())
        yield {
            "step": step,
            "longest_response": max(len(completion.response_ids) for completion in completions),
            "rollout_peak_gb": rollout_peak / GB,
            "update_peak_gb": memory.peak_resident_bytes() / GB,
            "resident_after_gb": memory.resident_bytes() / GB,
        }


def render_update(rows: list[dict]) -> None:
    table = Table(title="one worker's GRPO update, every response max_new_tokens long (GB = 1e9 bytes)")
    columns = ("max_new_tokens", "tokens/seq", "before GB", "peak GB", "growth GB", "estimate GB", "update s", "CPU s")
    for name in columns:
        table.add_column(name, justify="right")
    table.add_column("loss", justify="right")
    for row in rows:
        table.add_row(
            str(row["max_new_tokens"]),
            str(row["sequence_tokens"]),
            f"{row['resident_before_gb']:.2f}",
            f"{row['update_peak_gb']:.2f}",
            f"{row['update_growth_gb']:.2f}",
            f"{row['estimate_gb']:.2f}",
            f"{row['update_seconds']:.1f}",
            f"{row['update_cpu_seconds']:.1f}",
            f"{row['loss']:.6f}",
        )
    Console(width=140).print(table)


def measure_run(recipe: str, overrides: list[str]) -> dict:
    """`tlt train` in a fresh folder, its process tree's resident sets sampled until it exits."""
    output_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    command = ["tlt", "train", recipe, *overrides, f"run.output_dir={output_dir}", "run.name=memory"]
    start = time.time()
    process = subprocess.Popen(command)
    peaks: dict[int, dict] = {}
    sum_peak = 0
    while process.poll() is None:
        resident_sum = 0
        for pid in descendants(process.pid):
            status = read_status(pid)
            if status is None:
                continue
            resident_sum += status["VmRSS"]
            peaks[pid] = {"command": status["command"], "peak_gb": status["VmHWM"] / GB}
        sum_peak = max(sum_peak, resident_sum)
        time.sleep(SAMPLE_SECONDS)
    trace = output_dir / "memory" / "trace.jsonl"
    records = [json.loads(line) for line in trace.read_text().splitlines()] if trace.is_file() else []
    steps = [record for record in records if record["type"] == "step"]
    workers = [record for record in records if record["type"] == "worker"]
    return {
        "mode": "run",
        "command": " ".join(command),
        "exit_code": process.returncode,
        "seconds": time.time() - start,
        "processes": sorted(peaks.values(), key=lambda item: -item["peak_gb"]),
        "all_processes_peak_gb": sum_peak / GB,
        "steps": [
            {
                "step": step["step"],
                "update_seconds": step["update_seconds"],
                "rollout_seconds": step["rollout_seconds"],
                "loss": step.get("actor_loss"),
                "response_tokens": step.get("response_tokens"),
                "worker_peaks_gb": [
                    worker.get("memory_peak_gb") for worker in workers if worker["step"] == step["step"]
                ],
                # each worker's own peaks in the step's rollout and in its update (reward, update, weight refresh)
                "worker_rollout_peaks_gb": [
                    worker.get("memory_rollout_peak_gb") for worker in workers if worker["step"] == step["step"]
                ],
                "worker_update_peaks_gb": [
                    worker.get("memory_update_peak_gb") for worker in workers if worker["step"] == step["step"]
                ],
            }
            for step in steps
        ],
    }


def worker_peak(worker: dict) -> float | None:
    """A worker record's own peak in its step (the higher of its rollout and update peaks), None before issue 29."""
    peaks = [worker.get(key) for key in ("memory_rollout_peak_gb", "memory_update_peak_gb")]
    return max(peaks) if None not in peaks else None


def descendants(root: int) -> list[int]:
    """root and every process below it (from /proc/<pid>/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue += children.get(pid, [])
    return found


def read_status(pid: int) -> dict | None:
    """VmRSS and VmHWM in bytes and the command line of a live process, or None once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    values = {}
    for line in lines:
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            values[name] = int(value.split()[0]) * 1024
    if len(values) < 2:
        return None
    return {**values, "command": command.strip()[:120]}


def render_run(result: dict) -> None:
    console = Console(width=160)
    table = Table(title=f"{result['command']} (exit {result['exit_code']}, {result['seconds']:.0f} s)")
    table.add_column("process")
    table.add_column("peak GB", justify="right")
    for process in result["processes"]:
        if process["peak_gb"] >= 0.05:
            table.add_row(process["command"], f"{process['peak_gb']:.2f}")
    table.add_row("all processes at once (sampled)", f"{result['all_processes_peak_gb']:.2f}")
    console.print(table)
    steps = Table(title="steps")
    for name in ("step", "rollout s", "update s", "loss", "response tokens", "worker peaks GB (trace)"):
        steps.add_column(name, justify="right")
    for step in result["steps"]:
        peaks = ", ".join("-" if value is None else f"{value:.2f}" for value in step["worker_peaks_gb"])
        steps.add_row(
            str(step["step"]),
            f"{step['rollout_seconds']:.1f}",
            f"{step['update_seconds']:.1f}",
            "-" if step["loss"] is None else f"{step['loss']:.6f}",
            str(step["response_tokens"]),
            peaks,
        )
    console.print(steps)


if __name__ == "__main__":
    main()
