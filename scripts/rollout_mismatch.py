"""The rollout/learner mismatch of a recipe's model: the engine sampling in bfloat16 against the float32 learner.

    python scripts/rollout_mismatch.py --recipe recipes/real-cpu.yaml --prompts 8 --max-new-tokens 128 \
        --out benchmarks/rollout_mismatch.json

Samples `--prompts` of the recipe's task (its first problems, tokenized as tlt's rollout does) with the embedded
engine in each `--dtypes` at the recipe's temperature, then scores the same tokens with the float32 policy (a
full transformers forward, at that temperature) and reports what a training step would log
(tlt_cli/training/rollout_correction.py `MismatchTotals`): K3 KL(pi_rollout || pi_learner) per response token and
the importance weights pi_learner / pi_rollout (mean / min / max / share above the recipe's cap). A float32
rollout is the control: its K3 is float32 rounding. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.config import load_recipe
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.decode_plan import DECODE_DTYPES
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.training import setup
from tlt_cli.training.rollout_correction import MismatchTotals


def learner_logprobs(policy: torch.nn.Module, completion: Completion, temperature: float) -> torch.Tensor:
    """[R] the float32 policy's log-probs of the completion's tokens at `temperature` (the rollout's definition)."""
    sequence = torch.tensor([[*completion.prompt_ids, *completion.response_ids]])
    with torch.no_grad():
        logits = policy(sequence).logits[0, len(completion.prompt_ids) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(1, torch.tensor(completion.response_ids)[:, None]).squeeze(1)


def mismatch(recipe_path: Path, dtype: str, prompts: int, max_new_tokens: int, seed: int) -> dict[str, float]:
    recipe = load_recipe(recipe_path, [])
    policy, tokenizer = setup.policy_and_tokenizer(recipe)
    policy.eval()
    task = setup.task(recipe)
    requests = [
        RolloutRequest(index, tuple(encode_prompt(tokenizer, task.problem(index).prompt))) for index in range(prompts)
    ]
    temperature = recipe.rollout.temperature
    engine = EmbeddedEngine(policy, tokenizer.eos_token_id, tokenizer.pad_token_id, dtype=DECODE_DTYPES[dtype])
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    completions = engine.generate(
        requests, sampling, torch.Generator().manual_seed(seed), logprob_temperature=temperature
    )
    totals = MismatchTotals("token", recipe.actor.rollout_correction_cap)
    for completion in completions:
        learner = learner_logprobs(policy, completion, temperature)
        totals.add(learner[None], completion.rollout_logprobs[None].float(), torch.ones(1, len(learner)))
    return {**totals.metrics(), "response_tokens": totals.tokens, "temperature": temperature}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=Path("recipes/real-cpu.yaml"))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DECODE_DTYPES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/rollout_mismatch.json"))
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    results = {
        dtype: mismatch(arguments.recipe, dtype, arguments.prompts, arguments.max_new_tokens, arguments.seed)
        for dtype in arguments.dtypes
    }
    table = Table(title=f"rollout/learner mismatch, {arguments.recipe.name}", title_justify="left")
    for column in ("rollout dtype", "tokens", "K3 per token", "weight mean", "min", "max", "truncated"):
        table.add_column(column, justify="right")
    for dtype, result in results.items():
        table.add_row(
            dtype,
            str(result["response_tokens"]),
            f"{result['rollout_kl_k3']:.2e}",
            *(f"{result[f'rollout_weight_{name}']:.4f}" for name in ("mean", "min", "max", "truncated")),
        )
    Console().print(table)
    arguments.out.parent.mkdir(parents=True, exist_ok=True)
    arguments.out.write_text(json.dumps({"recipe": str(arguments.recipe), "results": results}, indent=2))


if __name__ == "__main__":
    main()
