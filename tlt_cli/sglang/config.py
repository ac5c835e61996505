"""Checks of the recipe section `rollout.sglang` (`SGLangConfig`, defined with the other sections).

`SGLangConfig` lives in tlt_cli/config/ beside the other frozen recipe sections (re-exported
here); the recipe checks (tlt_cli/recipe_checks.py) call `sglang_config_problem` once when
`rollout.backend: sglang` and refuse the recipe with the sentence it returns, which names the key.
Everything the SGLang backend launches or sends is derived from these fields, the model path and the
run directory.
"""

from __future__ import annotations

from tlt_cli.config import SGLangConfig

__all__ = ["DTYPES", "FLAGS_SET_BY_TLT", "PORTS_PER_SERVER", "SGLangConfig", "sglang_config_problem"]

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
DTYPES = ("auto", "bfloat16", "float16", "float32")


def sglang_config_problem(config: SGLangConfig) -> str | None:
    """The first value of `rollout.sglang` that types alone cannot refuse, as one sentence naming its key; None
    when every value fits. In order: a later check relies on an earlier one (tp_size >= 1 before dividing by it)."""
    gpus = list(config.gpus)
    if len(gpus) < 1:
        return "rollout.sglang.gpus must list at least one GPU index, e.g. [0]."
    if any(gpu < 0 for gpu in gpus):
        return f"rollout.sglang.gpus must hold GPU indices >= 0, got {gpus}."
    if len(set(gpus)) != len(gpus):
        return f"rollout.sglang.gpus lists a GPU twice: {gpus}."
    if config.tp_size < 1:
        return f"rollout.sglang.tp_size must be at least 1, got {config.tp_size}."
    if len(gpus) % config.tp_size != 0:
        return f"rollout.sglang.gpus has {len(gpus)} GPUs, not a multiple of rollout.sglang.tp_size ({config.tp_size})."
    last_port = config.port_base + PORTS_PER_SERVER * config.server_count - 1
    if not (1024 <= config.port_base and last_port <= 65535):
        return (
            f"rollout.sglang.port_base must leave ports {config.port_base}..{last_port} within 1024..65535, "
            f"got {config.port_base}."
        )
    for key in ("startup_timeout_s", "stop_timeout_s"):
        if not getattr(config, key) > 0:
            return f"rollout.sglang.{key} must be positive, got {getattr(config, key)}."
    if not 0.0 < config.mem_fraction < 1.0:
        return f"rollout.sglang.mem_fraction must be in (0, 1), got {config.mem_fraction}."
    if config.max_running_requests < 1:
        return f"rollout.sglang.max_running_requests must be at least 1, got {config.max_running_requests}."
    if config.dtype not in DTYPES:
        return f"rollout.sglang.dtype must be one of {', '.join(DTYPES)}, got '{config.dtype}'."
    if not config.request_timeout_s > 0:
        return f"rollout.sglang.request_timeout_s must be positive, got {config.request_timeout_s}."
    if config.max_in_flight_per_server < 1:
        return f"rollout.sglang.max_in_flight_per_server must be at least 1, got {config.max_in_flight_per_server}."
    if config.probe_max_new_tokens < 2:
        return (
            "rollout.sglang.probe_max_new_tokens must be at least 2 (a probe needs decode steps), "
            f"got {config.probe_max_new_tokens}."
        )
    if not config.collapse_accept_length >= 1.0:
        return (
            "rollout.sglang.collapse_accept_length must be >= 1.0 (1.0 = no draft token accepted), "
            f"got {config.collapse_accept_length}."
        )
    for argument in config.extra_args:
        flag = argument.split("=", 1)[0]
        if flag in FLAGS_SET_BY_TLT:
            return (
                f"rollout.sglang.extra_args sets {flag}, which tlt sets itself; "
                "remove it (see docs/gpu.md for the fields that control it)."
            )
    return None
