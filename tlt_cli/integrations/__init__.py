"""Adapters that put tlt's rollout under RL trainers people already use.

The trainer keeps its loss, advantages, reference model and optimizer step; tlt generates its
rollouts (speculative decoding with an online-trained drafter, the adaptive rule table) through
the trainer's own extension point. Hugging Face TRL's `GRPOTrainer(rollout_func=...)` is the
first: `from tlt_cli.integrations.trl import tlt_rollout` (tlt_cli/integrations/trl.py).
"""
