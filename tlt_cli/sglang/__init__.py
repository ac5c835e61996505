"""The SGLang rollout backend (`rollout.backend: sglang`): servers, HTTP generation, weight sync.

config.SGLangConfig is the recipe section; adaptive.plan_for_sglang maps the rule table onto
SGLang; server.launch_sglang_servers starts the servers; client.SGLangClient generates;
weight_sync pushes target and drafter weights and checks acceptance after each sync.
See docs/gpu.md for the GPU quick start and what was run where.
"""
