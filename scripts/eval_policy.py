"""Held-out reward of a run's trained policy vs the policy it started from: is the learning real?

    python scripts/eval_policy.py runs/tiny-cpu --problems 512 --out benchmarks/eval_policy.json

Per-step rewards in the trace are means of 64 samples on changing prompts, so a small trend can
hide in their noise. This script loads the run's starting model (its recipe's `model.path`) and
the actor weights of its latest checkpoint, samples `--samples` responses to each of `--problems`
held-out problems (indices the run never trained on) with the recipe's sampling settings, the
same seeds for both policies, and prints mean reward with its standard error, overall and by
term count, and the paired difference per problem (the same problems for both, so its error is
far smaller than either mean's). Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.checkpoint import latest_checkpoint, load_checkpoint_file
from tlt_cli.config import load_recipe
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.tasks.registry import build_task

# far above any index a run of the tiny recipe draws (steps x prompts_per_step)
HELD_OUT_START = 1_000_000
BATCH = 64
ACTOR_WEIGHTS = Path("actor") / "mp_rank_00_model_states.pt"


def trained_policy(run_directory: Path, model_path: str):
    policy, _ = load_policy(model_path)
    checkpoint = latest_checkpoint(run_directory).directory
    state = load_checkpoint_file(checkpoint / ACTOR_WEIGHTS, map_location="cpu")["module"]
    policy.load_state_dict(state)
    return policy.eval(), checkpoint


def rewards_by_problem(
    policy, tokenizer, task, problems, samples: int, sampling: SamplingParams, seed: int
) -> list[list[float]]:
    engine = EmbeddedEngine(policy, tokenizer.eos_token_id, tokenizer.pad_token_id)
    rewards = []
    for start in range(0, len(problems), BATCH // samples):
        chunk = problems[start : start + BATCH // samples]
        requests = [
            RolloutRequest(index * samples + sample, tuple(encode_prompt(tokenizer, problem.prompt)))
            for index, problem in enumerate(chunk)
            for sample in range(samples)
        ]
        completions = sorted(
            engine.generate(requests, sampling, torch.Generator().manual_seed(seed + start)),
            key=lambda completion: completion.request_id,
        )
        texts = [tokenizer.decode(completion.response_ids, skip_special_tokens=True) for completion in completions]
        rewards += [
            [task.reward(problem, text) for text in texts[index * samples : (index + 1) * samples]]
            for index, problem in enumerate(chunk)
        ]
    return rewards


def mean_and_error(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    variance = sum((value - mean) ** 2 for value in values) / max(len(values) - 1, 1)
    return mean, math.sqrt(variance / len(values))


def compare(problems, start: list[list[float]], trained: list[list[float]], term_count) -> dict:
    """Mean reward of each policy, and the paired difference (same problems), overall and by term count."""
    buckets: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for problem, before, after in zip(problems, start, trained):
        pair = (sum(before) / len(before), sum(after) / len(after))
        buckets["all"].append(pair)
        buckets[term_count(problem)].append(pair)
    order = [
        "all",
        *sorted((label for label in buckets if label != "all"), key=lambda label: int(label.split("-")[0].rstrip("+"))),
    ]
    return {
        label: {
            "start": mean_and_error([before for before, _ in buckets[label]]),
            "trained": mean_and_error([after for _, after in buckets[label]]),
            "difference": mean_and_error([after - before for before, after in buckets[label]]),
            "problems": len(buckets[label]),
        }
        for label in order
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_directory", type=Path)
    parser.add_argument("--problems", type=int, default=512)
    parser.add_argument("--samples", type=int, default=4, help="responses per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("eval_policy.json"))
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(arguments.run_directory / "recipe.yaml")
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    problems = [task.problem(HELD_OUT_START + index) for index in range(arguments.problems)]
    sampling = SamplingParams(
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=recipe.rollout.temperature,
        top_p=recipe.rollout.top_p,
        top_k=recipe.rollout.top_k,
    )
    start_policy, tokenizer = load_policy(recipe.model.path)
    trained, checkpoint = trained_policy(arguments.run_directory, recipe.model.path)

    def term_count(problem) -> str:
        terms = (len(problem.prompt) - 1) // 2
        return f"{terms}" if terms <= 3 else "4-9" if terms <= 9 else "10+"

    rewards = {
        name: rewards_by_problem(policy, tokenizer, task, problems, arguments.samples, sampling, arguments.seed)
        for name, policy in (("start", start_policy), ("trained", trained))
    }
    results = compare(problems, rewards["start"], rewards["trained"], term_count)
    table = Table(
        title=(
            f"held-out mean reward ({arguments.problems} problems x {arguments.samples} samples), "
            f"start vs {checkpoint.name}"
        )
    )
    for column in ("terms", "problems", "start", "trained", "paired difference"):
        table.add_column(column, justify="right")
    for label, row in results.items():
        cells = [f"{mean:.3f} ± {error:.3f}" for mean, error in (row["start"], row["trained"])]
        difference, error = row["difference"]
        table.add_row(label, str(row["problems"]), *cells, f"{difference:+.3f} ± {error:.3f}")
    Console().print(table)
    arguments.out.write_text(json.dumps({"checkpoint": str(checkpoint), "results": results}, indent=1))


if __name__ == "__main__":
    main()
