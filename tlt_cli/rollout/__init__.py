"""Rollout: the backend interface (embedded engine or SGLang), the embedded engine, its speculative decoding and the adaptive SD schedule."""
