"""GRPO through the real actor and engine raises a trivially learnable reward (about 20 s on CPU).

The policy is a small randomly initialised model and the reward the share of digits in its
response: every group has reward variance, so a correct policy gradient must raise it within a
few steps. This guards the direction and wiring of
the update (engine sampling, advantages, log-probs, DeepSpeed step), independent of the task.
"""

import torch

from tlt_cli.config import ActorConfig
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.tiny import build_tiny_model, tiny_model_config, tiny_tokenizer
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.tasks.arithmetic import ArithmeticTask
from tlt_cli.training.actor import Actor
from tlt_cli.training.grpo import group_advantages
from tlt_cli.training.policy_batch import build_policy_batch

GROUP = 4


def test_grpo_raises_a_learnable_reward(single_process_group):
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(
        tokenizer, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    policy = build_tiny_model(0, config)
    actor = Actor(policy, ActorConfig(precision="fp32", lr=3e-3, micro_batch_size=4), sequences_per_update=8 * GROUP)
    actor.engine.eval()
    engine = EmbeddedEngine(actor.policy, tokenizer.eos_token_id, tokenizer.pad_token_id)
    task = ArithmeticTask(seed=0)
    history = []
    for step in range(20):
        prompts = [
            tokenizer.encode(task.problem(step * 8 + index).prompt, add_special_tokens=False) for index in range(8)
        ]
        requests = [
            RolloutRequest(index * GROUP + sample, tuple(prompt))
            for index, prompt in enumerate(prompts)
            for sample in range(GROUP)
        ]
        completions = sorted(
            engine.generate(requests, SamplingParams(max_new_tokens=48), torch.Generator().manual_seed(step)),
            key=lambda completion: completion.request_id,
        )
        texts = [tokenizer.decode(completion.response_ids, skip_special_tokens=True) for completion in completions]
        rewards = torch.tensor([sum(character.isdigit() for character in text) / max(len(text), 1) for text in texts])
        actor.update(build_policy_batch(completions, group_advantages(rewards, GROUP), tokenizer.pad_token_id))
        history.append(float(rewards.mean()))
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    assert last > first + 0.04, history  # measured here: 0.20 -> 0.67 over 20 steps
