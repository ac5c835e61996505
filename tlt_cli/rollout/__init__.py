"""Rollout: the backend interface (embedded or SGLang), the embedded engine, speculative decoding, adaptive SD."""
