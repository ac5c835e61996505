"""Checks of the recipe section `rollout.sglang` (`SGLangConfig`, defined with the other sections).

`SGLangConfig` lives in tlt_cli/config.py beside the other frozen recipe sections (re-exported
here); the recipe checks (tlt_cli/recipe_checks.py) call `validate_sglang_config` once when
`rollout.backend: sglang` and it raises a `RecipeError` naming the key. Everything the SGLang
backend launches or sends is derived from these fields, the model path and the run directory.
"""

from __future__ import annotations

from tlt_cli.config import RecipeError, SGLangConfig

__all__ = ["DTYPES", "FLAGS_SET_BY_TLT", "PORTS_PER_SERVER", "SGLangConfig", "validate_sglang_config"]

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


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def validate_sglang_config(config: SGLangConfig) -> None:
    """Check values that types alone cannot; raise RecipeError naming the `rollout.sglang` key."""
    _require(len(config.gpus) >= 1, "rollout.sglang.gpus must list at least one GPU index, e.g. [0].")
    _require(
        all(gpu >= 0 for gpu in config.gpus),
        f"rollout.sglang.gpus must hold GPU indices >= 0, got {list(config.gpus)}.",
    )
    _require(len(set(config.gpus)) == len(config.gpus), f"rollout.sglang.gpus lists a GPU twice: {list(config.gpus)}.")
    _require(config.tp_size >= 1, f"rollout.sglang.tp_size must be at least 1, got {config.tp_size}.")
    _require(
        len(config.gpus) % config.tp_size == 0,
        f"rollout.sglang.gpus has {len(config.gpus)} GPUs, "
        f"not a multiple of rollout.sglang.tp_size ({config.tp_size}).",
    )
    last_port = config.port_base + PORTS_PER_SERVER * config.server_count - 1
    _require(
        1024 <= config.port_base and last_port <= 65535,
        f"rollout.sglang.port_base must leave ports {config.port_base}..{last_port} within 1024..65535, "
        f"got {config.port_base}.",
    )
    _require(
        config.startup_timeout_s > 0,
        f"rollout.sglang.startup_timeout_s must be positive, got {config.startup_timeout_s}.",
    )
    _require(config.stop_timeout_s > 0, f"rollout.sglang.stop_timeout_s must be positive, got {config.stop_timeout_s}.")
    _require(
        0.0 < config.mem_fraction < 1.0, f"rollout.sglang.mem_fraction must be in (0, 1), got {config.mem_fraction}."
    )
    _require(
        config.max_running_requests >= 1,
        f"rollout.sglang.max_running_requests must be at least 1, got {config.max_running_requests}.",
    )
    _require(config.dtype in DTYPES, f"rollout.sglang.dtype must be one of {', '.join(DTYPES)}, got '{config.dtype}'.")
    _require(
        config.request_timeout_s > 0,
        f"rollout.sglang.request_timeout_s must be positive, got {config.request_timeout_s}.",
    )
    _require(
        config.max_in_flight_per_server >= 1,
        f"rollout.sglang.max_in_flight_per_server must be at least 1, got {config.max_in_flight_per_server}.",
    )
    _require(
        config.probe_max_new_tokens >= 2,
        "rollout.sglang.probe_max_new_tokens must be at least 2 (a probe needs decode steps), "
        f"got {config.probe_max_new_tokens}.",
    )
    _require(
        config.collapse_accept_length >= 1.0,
        "rollout.sglang.collapse_accept_length must be >= 1.0 (1.0 = no draft token accepted), "
        f"got {config.collapse_accept_length}.",
    )
    for argument in config.extra_args:
        flag = argument.split("=", 1)[0]
        _require(
            flag not in FLAGS_SET_BY_TLT,
            f"rollout.sglang.extra_args sets {flag}, which tlt sets itself; "
            "remove it (see docs/gpu.md for the fields that control it).",
        )
