"""Checks of the recipe section `rollout.sglang` (`SGLangConfig`, defined with the other sections).

`SGLangConfig` lives in tlt_cli/config/ beside the other frozen recipe sections (re-exported
here) with its keys' ranges; the recipe checks (tlt_cli/recipe_checks.py) call `sglang_config_problem`
once when `rollout.backend: sglang` and refuse the recipe with the sentence it returns, which names the key:
a range the schema declares (tlt_cli/config/ranges.py), then what spans keys (GPUs, ports, flags).
Everything the SGLang backend launches or sends is derived from these fields, the model path and the
run directory.
"""

from __future__ import annotations

from tlt_cli.config import SGLangConfig, range_problem

__all__ = ["FLAGS_SET_BY_TLT", "PORTS_PER_SERVER", "SGLangConfig", "sglang_config_problem"]

# flags that tlt sets itself on every server; extra_args may not repeat them
FLAGS_SET_BY_TLT = (
    "--model-path",
    "--host",
    "--port",
    "--nccl-port",
    "--api-key",
    # tlt's --config file carries the API key, and SGLang takes one --config
    "--config",
    "--tp-size",
    "--tensor-parallel-size",
    "--base-gpu-id",
    "--mem-fraction-static",
    "--dtype",
    "--random-seed",
    "--max-running-requests",
    "--skip-tokenizer-init",
    "--speculative-algorithm",
    "--speculative-draft-model-path",
    "--speculative-draft-model",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--speculative-adaptive",
    "--speculative-adaptive-config",
)
# ports one server takes from its range: HTTP at the start of the range, NCCL on the next port
PORTS_PER_SERVER = 2


def sglang_config_problem(config: SGLangConfig) -> str | None:
    """The first value of `rollout.sglang` that types alone cannot refuse, as one sentence naming its key; None
    when every value fits. In order: a later check relies on an earlier one (tp_size >= 1 before dividing by it)."""
    declared = range_problem(config, "rollout.sglang.")
    if declared is not None:
        return declared
    gpus = list(config.gpus)
    if len(gpus) < 1:
        return "rollout.sglang.gpus must list at least one GPU index, e.g. [0]."
    if any(gpu < 0 for gpu in gpus):
        return f"rollout.sglang.gpus must hold GPU indices >= 0, got {gpus}."
    if len(set(gpus)) != len(gpus):
        return f"rollout.sglang.gpus lists a GPU twice: {gpus}."
    if len(gpus) % config.tp_size != 0:
        return f"rollout.sglang.gpus has {len(gpus)} GPUs, not a multiple of rollout.sglang.tp_size ({config.tp_size})."
    last_port = config.port_base + PORTS_PER_SERVER * config.server_count - 1
    if not (1024 <= config.port_base and last_port <= 65535):
        return (
            f"rollout.sglang.port_base must leave ports {config.port_base}..{last_port} within 1024..65535, "
            f"got {config.port_base}."
        )
    for argument in config.extra_args:
        flag = argument.split("=", 1)[0]
        if flag in FLAGS_SET_BY_TLT:
            return (
                f"rollout.sglang.extra_args sets {flag}, which tlt sets itself; "
                "remove it (see docs/gpu.md for the fields that control it)."
            )
    return None
