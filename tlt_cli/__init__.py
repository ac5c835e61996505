"""tlt: RL training of reasoning LLMs with lossless speculative decoding in the rollout long tail."""

__version__ = "0.1.0"
