"""GRPO training, and the composition root: the one place a recipe becomes a running trainer.

setup.py         the only code that turns a Recipe into parts (policy, task, sampling, drafter,
                 rollout backend); every trainer and command builds through it
worker_loop.py   one rank's GRPO step: rollout -> reward -> advantages -> actor update
grpo.py          group advantages and the clipped policy loss
policy_batch.py  completions packed into one padded batch
actor.py         the DeepSpeed actor: log-probs and the update
"""
