"""Rollout engines: the embedded in-process engine and its speculative decoding."""
