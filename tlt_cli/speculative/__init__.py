"""Lossless speculative decoding: one proposer per draft source (the drafter's chains and trees, n-gram
proposals from a request's siblings), exact verification and acceptance, and the schedules that pick a shape
per step: plan.py (what the run speculates with, per mode), modes.py (the decoder of each mode), rules.py and
rule_schedule.py (mode adaptive: the rule table and its bandit), cost_schedule.py (mode auto: the cost model),
the two sharing one usage ledger (types.py `ScheduleReports`).

It sees the model being decoded only through tlt_cli/engine/running_batch.py (`DecodeTarget` over a
`RunningBatch`); the generate loop (tlt_cli/rollout/generate_loop.py) drives it one step at a time.
"""
