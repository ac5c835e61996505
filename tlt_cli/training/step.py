"""One GRPO step's parts, as every command that runs a step makes them.

A rank's shard of a step is its fixed slice of the step's prompts (`shard_problems`), each prompt decoded
group_size times as one group (`grouped_requests`: n-gram drafts read a row's siblings), sampled with the seed
`shard_sampling_seed` derives from (run.seed, step, rank), so a resumed step draws the same samples. The task
scores each completion (`shard_rewards`), and `grpo_update` turns the rewards into group advantages and one
update of the rank's `worker_actor`. `tlt train`'s worker loop (training/worker_loop.py), `tlt bench update
--steps` (bench/update_worker.py) and `tlt profile RECIPE` (profile/recording.py) build their steps here, so a
bench's or a profile's step 0 is the run's step 0; calibrate and `tlt bench rollout` group their own prompts
with `grouped_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.config import Recipe
from tlt_cli.rollout.backend import sampling_seed
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.tasks.base import Problem, Task
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.training import setup
from tlt_cli.training.actor import Actor
from tlt_cli.training.grpo import group_advantages


def worker_actor(recipe: Recipe, policy: PreTrainedModel) -> Actor:
    """A rank's actor of `policy`: the recipe's actor settings for one worker's samples, and the reference policy
    where the recipe's KL term needs one."""
    return Actor(policy, recipe.actor, recipe.samples_per_worker, setup.reference_policy(recipe))


@dataclass
class StepShard:
    """This rank's problems for one step, with one request per (problem, sample)."""

    problems: list[Problem]
    requests: list[RolloutRequest] = field(default_factory=list)


def shard_problems(recipe: Recipe, task: Task, step: int, rank: int) -> list[Problem]:
    """Rank `rank`'s problems at `step`: a fixed slice of the step's train.prompts_per_step, so data order is
    deterministic."""
    first = step * recipe.train.prompts_per_step + rank * recipe.prompts_per_worker
    return [task.problem(first + offset) for offset in range(recipe.prompts_per_worker)]


def encoded_prompts(tokenizer: PreTrainedTokenizerBase, problems: list[Problem]) -> list[tuple[int, ...]]:
    """Each problem's prompt as the policy reads it (its chat template where the tokenizer has one)."""
    return [tuple(encode_prompt(tokenizer, problem.prompt)) for problem in problems]


def grouped_requests(prompts: list[tuple[int, ...]], group_size: int, rows: int | None = None) -> list[RolloutRequest]:
    """`rows` requests (all of `prompts`' group_size samples when None), in order: row r samples prompt
    r // group_size, and a prompt's samples are one group."""
    rows = len(prompts) * group_size if rows is None else rows
    return [RolloutRequest(row, prompts[row // group_size], group=row // group_size) for row in range(rows)]


def step_shard(recipe: Recipe, task: Task, tokenizer: PreTrainedTokenizerBase, step: int, rank: int) -> StepShard:
    """Rank `rank`'s problems at `step` and their grouped requests."""
    problems = shard_problems(recipe, task, step, rank)
    return StepShard(problems, grouped_requests(encoded_prompts(tokenizer, problems), recipe.train.group_size))


def shard_sampling_seed(recipe: Recipe, step: int, rank: int) -> int:
    """The sampling seed of rank `rank`'s rollout at `step`, derived from (run.seed, step, rank)."""
    return sampling_seed(recipe.run.seed, step, rank)


def shard_rewards(
    task: Task, tokenizer: PreTrainedTokenizerBase, shard: StepShard, completions: list[Completion], group_size: int
) -> torch.Tensor:
    """The task's reward of each completion (in the completions' order) against its request's problem."""
    rewards = [
        task.reward(
            shard.problems[completion.request_id // group_size],
            tokenizer.decode(completion.response_ids, skip_special_tokens=True),
        )
        for completion in completions
    ]
    return torch.tensor(rewards, dtype=torch.float32)


def grpo_update(
    actor: Actor,
    completions: list[Completion],
    rewards: torch.Tensor,
    group_size: int,
    pad_token_id: int,
    on_hidden_states=None,
) -> dict[str, float]:
    """One GRPO update on `completions` (sorted by request id, so groups are consecutive): group advantages of
    `rewards`, then the actor's update; its figures."""
    advantages = group_advantages(rewards, group_size)
    batch = actor.policy_batch(completions, advantages, pad_token_id, group_size)
    return actor.update(batch, on_hidden_states).as_dict()
