"""GRPO training: the worker loop, the actor, the GRPO loss and the policy batch.

One rank's step (worker_loop.py) rolls out a shard of prompts, scores them with the task, turns the
rewards into group advantages (grpo.py), packs the rows into a padded batch (policy_batch.py) and
updates the policy through DeepSpeed (actor.py).
"""
