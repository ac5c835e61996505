"""GRPO in one process on the built-in model: the step every `tlt train` worker runs, without the plumbing.

Run it from the repository root with tlt installed (CPU, about 15 s with the defaults on 2 cores):

    python examples/minimal_grpo.py
    python examples/minimal_grpo.py --steps 5 --prompts 8 --group-size 8

Each step: the embedded engine (sharing the actor's weights) samples `group-size` responses per
prompt -> the arithmetic task rewards each one -> GRPO turns rewards into advantages within each
prompt's group -> the responses become one padded policy batch -> the DeepSpeed actor takes one
update. `tlt train` runs the same five calls in tlt_cli/training/worker_loop.py, on several processes, with
speculative decoding, checkpoints and a trace (tlt_cli/processes/ starts and hears from them).
"""

from __future__ import annotations

import argparse

import torch

from tlt_cli.config import ActorConfig
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.processes.distributed import WorkerAddress, free_port, init_worker_process
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.tasks.arithmetic import ArithmeticTask
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.training.actor import Actor
from tlt_cli.training.grpo import group_advantages
from tlt_cli.training.policy_batch import build_policy_batch


def main(steps: int, prompts: int, group_size: int, max_new_tokens: int, seed: int = 0) -> None:
    # a process group of one rank on CPU (gloo), which DeepSpeed needs even for a single process
    init_worker_process(
        WorkerAddress(rank=0, world_size=1, master_port=free_port()),
        threads=1,
        extensions_dir=default_cache_dir() / "torch_extensions",
    )
    torch.manual_seed(seed)
    policy, tokenizer = load_policy("builtin:tiny-arith")
    task = ArithmeticTask(seed=seed, max_terms=8)  # sums of up to 8 numbers: short responses, a quick demo
    actor = Actor(
        policy, ActorConfig(lr=1e-4, micro_batch_size=4, precision="fp32"), sequences_per_update=prompts * group_size
    )
    engine = EmbeddedEngine(actor.policy, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)

    for step in range(steps):
        problems = [task.problem(step * prompts + number) for number in range(prompts)]
        # group_size requests per prompt, consecutive, so request r belongs to problem r // group_size
        requests = [
            RolloutRequest(
                request_id=number * group_size + sample,
                prompt_ids=tuple(encode_prompt(tokenizer, problem.prompt)),
            )
            for number, problem in enumerate(problems)
            for sample in range(group_size)
        ]
        completions = engine.generate(requests, sampling, torch.Generator().manual_seed(seed + step))
        rewards = torch.tensor(
            [
                task.reward(
                    problems[completion.request_id // group_size],
                    tokenizer.decode(completion.response_ids, skip_special_tokens=True),
                )
                for completion in completions
            ]
        )
        advantages = group_advantages(rewards, group_size)  # (reward - group mean) / group std
        batch = build_policy_batch(completions, advantages, tokenizer.pad_token_id)
        metrics = actor.update(batch)
        print(
            f"step {step}: mean reward {rewards.mean().item():.3f}  grad norm {metrics.grad_norm:.3f}  "
            f"response tokens {batch.response_token_count}",
            flush=True,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="responses sampled per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="longest response in tokens")
    arguments = parser.parse_args()
    main(arguments.steps, arguments.prompts, arguments.group_size, arguments.max_new_tokens)
