"""Build the built-in tiny model into a folder and measure what GRPO will start from.

Builds `builtin:tiny-arith` (seeded Qwen2 + supervised warm-up on the arithmetic task, the
defaults of tlt_cli/models/tiny.py), saves it as a Hugging Face folder in bfloat16 (the
committed folder tlt_cli/models/tiny_arith is this script's output, under 10 MB), reloads it as
tlt does (float32), then samples with Hugging Face `generate` on held-out problems
(a different task seed) and prints a table: parameters, warm-up seconds, mean reward with
greedy and temperature-1 sampling (overall, the share solved exactly, and the mean on short
problems of <= 3 terms and on long ones of >= 10 terms), and sampled response-length p50/p99.
Writes the same numbers as JSON. With --measure-only it measures an existing folder instead.

    python scripts/make_tiny_model.py tlt_cli/models/tiny_arith --threads 2 --json benchmarks/tiny_arith.json
    python scripts/make_tiny_model.py tlt_cli/models/tiny_arith --measure-only

On a shared 2-core machine keep --threads 1: with other jobs running, 2 torch threads spin
on each other and the warm-up runs several times slower.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import WarmUpSettings, build_warmed_up_model, save_model_folder, tiny_model_config
from tlt_cli.tasks.arithmetic import ArithmeticTask

# held-out problems come from a task seed the warm-up never uses
EVALUATION_SEED = 1_000_003
GENERATION_BATCH = 32
SHORT_TERMS = 3
LONG_TERMS = 10


def sample_responses(model, tokenizer, task, count: int, temperature: float):
    """Rows (terms, reward, response tokens incl. EOS) for problems 0..count-1 in index order.

    Temperature 0 is greedy; otherwise full-vocabulary sampling (top_k 0) at `temperature`.
    Prompts are batched by length so left padding stays small.
    """
    problems = sorted((task.problem(index) for index in range(count)), key=lambda problem: len(problem.prompt))
    max_new_tokens = task.max_solution_length + 8  # room for EOS and a little overshoot
    tokenizer.padding_side = "left"
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    rows = {}
    for start in range(0, count, GENERATION_BATCH):
        chunk = problems[start : start + GENERATION_BATCH]
        batch = tokenizer([problem.prompt for problem in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = model.generate(**batch, max_new_tokens=max_new_tokens, **sampling)
        for problem, response_ids in zip(chunk, generated[:, batch["input_ids"].shape[1] :].tolist()):
            response_ids = _until_eos(response_ids, tokenizer.eos_token_id)
            response = tokenizer.decode(response_ids, skip_special_tokens=True)
            rows[problem.index] = (len(problem.prompt) // 2, task.reward(problem, response), len(response_ids))
    return np.array([rows[index] for index in range(count)], dtype=np.float64)


def _until_eos(response_ids: list[int], eos_token_id: int) -> list[int]:
    if eos_token_id in response_ids:
        return response_ids[: response_ids.index(eos_token_id) + 1]
    return response_ids


def reward_summary(results) -> dict[str, float]:
    terms, rewards = results[:, 0], results[:, 1]
    return {
        "mean": float(rewards.mean()),
        "solved": float((rewards == 1.0).mean()),
        "short": float(rewards[terms <= SHORT_TERMS].mean()),
        "long": float(rewards[terms >= LONG_TERMS].mean()) if (terms >= LONG_TERMS).any() else float("nan"),
    }


def measure(model, tokenizer, reward_problems: int, length_problems: int, seed: int) -> dict:
    task = ArithmeticTask(seed=EVALUATION_SEED)
    torch.manual_seed(seed)
    greedy = sample_responses(model, tokenizer, task, reward_problems, temperature=0.0)
    sampled = sample_responses(model, tokenizer, task, max(reward_problems, length_problems), temperature=1.0)
    response_lengths = sampled[:, 2]
    reference_lengths = [len(task.problem(index).solution) + 1 for index in range(len(sampled))]
    p50, p99 = np.percentile(response_lengths, [50, 99])
    reference_p50, reference_p99 = np.percentile(reference_lengths, [50, 99])
    return {
        "greedy_reward": reward_summary(greedy),
        "sampled_reward": reward_summary(sampled[:reward_problems]),
        "sampled_reward_all": reward_summary(sampled),
        "response_length_p50": float(p50),
        "response_length_p99": float(p99),
        "response_length_p99_over_p50": float(p99 / p50),
        "reference_length_p99_over_p50": float(reference_p99 / reference_p50),
    }


def print_table(report: dict) -> None:
    table = Table(title="builtin:tiny-arith")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("parameters", f"{report['parameters']:,}")
    table.add_row("warm-up seconds", f"{report['warm_up_seconds']:.1f}")
    table.add_row("final warm-up loss", f"{report['final_loss']:.3f}")
    for label in ("greedy_reward", "sampled_reward", "sampled_reward_all"):
        rewards = report[label]
        by_length = f"short {rewards['short']:.3f}, long {rewards['long']:.3f}"
        table.add_row(label, f"{rewards['mean']:.3f} (solved {rewards['solved']:.3f}; {by_length})")
    lengths = f"{report['response_length_p50']:.0f} / {report['response_length_p99']:.0f}"
    table.add_row("response length p50 / p99", lengths)
    table.add_row("response length p99/p50", f"{report['response_length_p99_over_p50']:.1f}")
    table.add_row("reference solution p99/p50", f"{report['reference_length_p99_over_p50']:.1f}")
    Console().print(table)


def build_and_save(output_dir: Path, seed: int, warmup_steps: int) -> dict:
    """Build and warm up the default tiny model, save it in bfloat16; the warm-up time and final loss."""
    started = time.perf_counter()
    model, tokenizer, losses = build_warmed_up_model(seed, tiny_model_config(), WarmUpSettings(steps=warmup_steps))
    build_report = {"warm_up_seconds": time.perf_counter() - started, "final_loss": float(np.mean(losses[-10:]))}
    save_model_folder(model.to(torch.bfloat16), tokenizer, output_dir)
    return build_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="folder to write the model into (an existing one is replaced)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=WarmUpSettings.steps)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--reward-problems", type=int, default=64)
    parser.add_argument("--length-problems", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="where to write the numbers")
    parser.add_argument("--measure-only", action="store_true", help="measure the model already in output_dir")
    arguments = parser.parse_args()
    torch.set_num_threads(arguments.threads)
    build_report = {"warm_up_seconds": float("nan"), "final_loss": float("nan")}
    if not arguments.measure_only:
        build_report = build_and_save(arguments.output_dir, arguments.seed, arguments.warmup_steps)
    model, tokenizer = load_policy(str(arguments.output_dir))
    report = {
        "output_dir": str(arguments.output_dir),
        "threads": arguments.threads,
        "warmup_steps": arguments.warmup_steps,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        **build_report,
        **measure(model, tokenizer, arguments.reward_problems, arguments.length_problems, arguments.seed),
    }
    print_table(report)
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
