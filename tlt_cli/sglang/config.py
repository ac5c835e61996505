"""`SGLangConfig`: the recipe section `rollout.sglang`, read when `rollout.backend: sglang`.

The recipe loader (tlt_cli/config.py) embeds this frozen dataclass; `validate_sglang_config`
checks its values once and raises a `RecipeError` naming the key. Everything the SGLang backend
launches or sends is derived from these fields, the model path and the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass

from tlt_cli.config import RecipeError

# flags that tlt sets itself on every server; extra_args may not repeat them
FLAGS_SET_BY_TLT = (
    "--model-path",
    "--host",
    "--port",
    "--nccl-port",
    "--api-key",
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


@dataclass(frozen=True)
class SGLangConfig:
    """How tlt runs its SGLang rollout servers (one per GPU, or per group of tp_size GPUs)."""

    # GPU indices on this node the servers use, split into consecutive groups of tp_size
    gpus: tuple[int, ...] = (0,)
    # tensor-parallel size of each server (1 = one server per GPU)
    tp_size: int = 1
    # first port of the servers' range on 127.0.0.1; server i takes port_base + 2*i (HTTP) and the next (NCCL)
    port_base: int = 30100
    # seconds to wait for every server to answer /health before giving up with its log tail
    startup_timeout_s: float = 900.0
    # seconds a server gets to exit after SIGTERM before its process group is killed
    stop_timeout_s: float = 30.0
    # fraction of GPU memory for SGLang's weights and KV cache (leave room for a colocated actor)
    mem_fraction: float = 0.6
    # most requests one server runs at once; set explicitly because SGLang caps it at 48 when EAGLE is on
    max_running_requests: int = 256
    # weight and activation dtype of the served model
    dtype: str = "bfloat16"
    # Python interpreter whose environment has sglang installed ("" = the one running tlt)
    python: str = ""
    # send and receive token ids only (no tokenizer in the server)
    skip_tokenizer_init: bool = True
    # actor ranks and servers share a node: push weights as CUDA tensors; false = through a checkpoint on disk
    colocated: bool = True
    # seconds one /generate request may take before the rollout fails
    request_timeout_s: float = 3600.0
    # most requests tlt keeps in flight on one server at a time
    max_in_flight_per_server: int = 1024
    # tokens generated per prompt by the post-sync acceptance probe
    probe_max_new_tokens: int = 64
    # accept length at or below which a drafter that worked before a sync counts as collapsed
    collapse_accept_length: float = 1.1
    # let SGLang turn SD off in a batch-size slot whose acceptance collapses (adaptive mode only)
    auto_off_on_collapse: bool = True
    # more command-line flags for sglang.launch_server, e.g. ["--attention-backend", "fa3"]
    extra_args: tuple[str, ...] = ()

    @property
    def server_count(self) -> int:
        return len(self.gpus) // self.tp_size


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RecipeError(message)


def validate_sglang_config(config: SGLangConfig) -> None:
    """Check values that types alone cannot; raise RecipeError naming the `rollout.sglang` key."""
    _require(len(config.gpus) >= 1, "rollout.sglang.gpus must list at least one GPU index, e.g. [0].")
    _require(all(gpu >= 0 for gpu in config.gpus), f"rollout.sglang.gpus must hold GPU indices >= 0, got {list(config.gpus)}.")
    _require(len(set(config.gpus)) == len(config.gpus), f"rollout.sglang.gpus lists a GPU twice: {list(config.gpus)}.")
    _require(config.tp_size >= 1, f"rollout.sglang.tp_size must be at least 1, got {config.tp_size}.")
    _require(len(config.gpus) % config.tp_size == 0,
             f"rollout.sglang.gpus has {len(config.gpus)} GPUs, not a multiple of rollout.sglang.tp_size ({config.tp_size}).")
    last_port = config.port_base + PORTS_PER_SERVER * config.server_count - 1
    _require(1024 <= config.port_base and last_port <= 65535,
             f"rollout.sglang.port_base must leave ports {config.port_base}..{last_port} within 1024..65535, got {config.port_base}.")
    _require(config.startup_timeout_s > 0, f"rollout.sglang.startup_timeout_s must be positive, got {config.startup_timeout_s}.")
    _require(config.stop_timeout_s > 0, f"rollout.sglang.stop_timeout_s must be positive, got {config.stop_timeout_s}.")
    _require(0.0 < config.mem_fraction < 1.0, f"rollout.sglang.mem_fraction must be in (0, 1), got {config.mem_fraction}.")
    _require(config.max_running_requests >= 1,
             f"rollout.sglang.max_running_requests must be at least 1, got {config.max_running_requests}.")
    _require(config.dtype in DTYPES, f"rollout.sglang.dtype must be one of {', '.join(DTYPES)}, got '{config.dtype}'.")
    _require(config.request_timeout_s > 0, f"rollout.sglang.request_timeout_s must be positive, got {config.request_timeout_s}.")
    _require(config.max_in_flight_per_server >= 1,
             f"rollout.sglang.max_in_flight_per_server must be at least 1, got {config.max_in_flight_per_server}.")
    _require(config.probe_max_new_tokens >= 2,
             f"rollout.sglang.probe_max_new_tokens must be at least 2 (a probe needs decode steps), got {config.probe_max_new_tokens}.")
    _require(config.collapse_accept_length >= 1.0,
             f"rollout.sglang.collapse_accept_length must be >= 1.0 (1.0 = no draft token accepted), got {config.collapse_accept_length}.")
    for argument in config.extra_args:
        flag = argument.split("=", 1)[0]
        _require(flag not in FLAGS_SET_BY_TLT,
                 f"rollout.sglang.extra_args sets {flag}, which tlt sets itself; remove it (see docs/gpu.md for the fields that control it).")
