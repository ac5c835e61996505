"""Lossless speculative decoding: one proposer per draft source (the drafter's chains and trees, n-gram
proposals from a request's siblings), exact verification and acceptance, and the adaptive schedule that
picks a shape per step.

It sees the model being decoded only through tlt_cli/engine/running_batch.py (`DecodeTarget` over a
`RunningBatch`); the generate loop (tlt_cli/rollout/generate_loop.py) drives it one step at a time.
"""
