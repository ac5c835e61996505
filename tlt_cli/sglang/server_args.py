"""The `sglang.launch_server` command line and environment of each rollout server.

`server_placements(config)` gives every server its GPUs (CUDA_VISIBLE_DEVICES) and ports;
`speculative_flags(plan, draft_model_path, adaptive_config_path)` turns an
`SGLangSpeculativePlan` into SGLang's speculative flags; `server_command(...)` assembles the whole
command. The API key is never on the command line (which every local user can read in `ps`): it
goes in a YAML file passed with `--config`, which SGLang 0.5.23's `prepare_server_args` merges
into the arguments (it reads no API key from the environment); `api_key_config` is that file's
text. Flag names are those of SGLang 0.5.23's `ServerArgs` (checked by
tests/test_sglang_server_args.py against SGLang's own argument parser when it is installed).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tlt_cli.sglang.adaptive import PlanMode, SGLangSpeculativePlan
from tlt_cli.sglang.config import PORTS_PER_SERVER, SGLangConfig
from tlt_cli.speculative.ngram import DEFAULT_MAX_MATCH
from tlt_cli.speculative.types import SpeculativeConfig

SERVER_HOST = "127.0.0.1"
# SGLang's name for the EAGLE drafter: fc(concat(embed, hidden)) -> decoder layer(s) -> lm_head
SPECULATIVE_ALGORITHM = "EAGLE"
# SGLang's model-free drafting: an n-gram trie over the server's requests
NGRAM_ALGORITHM = "NGRAM"
# SGLang 0.5.23's CPU serving path (rollout.sglang.extra_args; with rollout.sglang.dtype: float32): plain PyTorch
# attention and sampling, no overlap scheduler. `server_environment` adds the environment it needs.
CPU_SERVER_ARGS = (
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--disable-overlap-schedule",
)
# what a server on --device cpu needs in its environment: SGLang's CPU platform, and the Python radix tree
# (the wheel's Rust one is linked against torch 2.14.1, which a CPU environment does not have)
CPU_SERVER_ENVIRONMENT = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}
# SGLang's switch for return_logprob: log-probs of the raw logits (temperature 1) instead of the tempered ones
RETURN_ORIGINAL_LOGPROB = "SGLANG_RETURN_ORIGINAL_LOGPROB"


class LaunchConfigError(ValueError):
    """A server cannot be launched as asked (missing drafter, unknown plan)."""


@dataclass(frozen=True)
class ServerPlacement:
    """Where server `index` runs: its GPUs (as the node numbers them) and its two ports."""

    index: int
    gpus: tuple[int, ...]
    port: int
    nccl_port: int

    @property
    def url(self) -> str:
        return f"http://{SERVER_HOST}:{self.port}"


def server_placements(config: SGLangConfig) -> list[ServerPlacement]:
    """One placement per consecutive group of tp_size GPUs; ports from port_base upwards."""
    placements = []
    for index in range(config.server_count):
        gpus = tuple(config.gpus[index * config.tp_size : (index + 1) * config.tp_size])
        port = config.port_base + PORTS_PER_SERVER * index
        placements.append(ServerPlacement(index=index, gpus=gpus, port=port, nccl_port=port + 1))
    return placements


def _shape_flags(shape: SpeculativeConfig) -> list[str]:
    return [
        "--speculative-num-steps",
        str(shape.steps),
        "--speculative-eagle-topk",
        str(shape.topk),
        "--speculative-num-draft-tokens",
        str(shape.verified_tokens),
    ]


def ngram_flags(shape: SpeculativeConfig) -> list[str]:
    """SGLang's NGRAM flags for model-free `ngram<k>`: k proposed tokens plus the root verified, suffix matches
    of 1 to tlt's longest match, one branch (a chain, as tlt proposes)."""
    return [
        "--speculative-algorithm",
        NGRAM_ALGORITHM,
        "--speculative-num-draft-tokens",
        str(shape.ngram_tokens + 1),
        "--speculative-ngram-min-match-window-size",
        "1",
        "--speculative-ngram-max-match-window-size",
        str(DEFAULT_MAX_MATCH),
        "--speculative-ngram-min-bfs-breadth",
        "1",
        "--speculative-ngram-max-bfs-breadth",
        "1",
    ]


def speculative_flags(
    plan: SGLangSpeculativePlan, draft_model_path: str | None, adaptive_config_path: str | Path | None
) -> list[str]:
    """SGLang's speculative flags for `plan`; none for an off plan (an ngram plan needs no drafter)."""
    if plan.mode is PlanMode.off:
        return []
    if plan.mode is PlanMode.ngram:
        return ngram_flags(plan.launch)
    if draft_model_path is None:
        raise LaunchConfigError(
            "the rule table turns SD on but no drafter was given: export the drafter in SGLang's EAGLE layout first "
            "(tlt export-drafter) and pass its folder."
        )
    flags = ["--speculative-algorithm", SPECULATIVE_ALGORITHM, "--speculative-draft-model-path", str(draft_model_path)]
    flags += _shape_flags(plan.launch)
    if plan.mode is PlanMode.adaptive:
        if adaptive_config_path is None:
            raise LaunchConfigError(
                "an adaptive plan needs the path of its slot file (adaptive.write_adaptive_config)."
            )
        flags += ["--speculative-adaptive", "--speculative-adaptive-config", str(adaptive_config_path)]
    elif plan.mode is not PlanMode.static:
        raise LaunchConfigError(f"unknown plan mode '{plan.mode.value}'.")
    return flags


def server_command(
    config: SGLangConfig,
    placement: ServerPlacement,
    model_path: str,
    api_key_file: Path,
    speculative: list[str],
    seed: int,
) -> list[str]:
    """The full argv of one server; GPUs are chosen by `server_environment`, so base GPU is 0.

    api_key_file: the `--config` YAML of `api_key_config` (SGLang takes one --config, so extra_args may not).
    """
    python = config.python or sys.executable
    command = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        SERVER_HOST,
        "--port",
        str(placement.port),
        "--nccl-port",
        str(placement.nccl_port),
        "--config",
        str(api_key_file),
        "--tp-size",
        str(config.tp_size),
        "--base-gpu-id",
        "0",
        "--mem-fraction-static",
        str(config.mem_fraction),
        "--max-running-requests",
        str(config.max_running_requests),
        "--dtype",
        str(config.dtype),
        "--random-seed",
        str(seed),
    ]
    if config.skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    return command + speculative + list(config.extra_args)


def api_key_config(api_key: str) -> str:
    """The `--config` YAML that gives SGLang its API key; quoted, so a key of digits stays a string."""
    return f'api-key: "{api_key}"\n'


def serves_on_cpu(extra_args: tuple[str, ...] | list[str]) -> bool:
    """Whether rollout.sglang.extra_args put the server on SGLang's CPU platform (`--device cpu`)."""
    arguments = list(extra_args)
    return "--device=cpu" in arguments or any(
        flag == "--device" and value == "cpu" for flag, value in zip(arguments, arguments[1:])
    )


def server_environment(
    placement: ServerPlacement, base_environment: Mapping[str, str], on_cpu: bool = False
) -> dict[str, str]:
    """The server's environment: the caller's, with only this server's GPUs visible and the sampled tokens'
    log-probs before temperature (unless the caller set SGLANG_RETURN_ORIGINAL_LOGPROB); on the CPU platform
    (`serves_on_cpu`), SGLang's CPU settings unless the caller set them."""
    environment = dict(base_environment)
    environment["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu) for gpu in placement.gpus)
    # return_logprob gives log_softmax(logits)[token] before temperature: the learner's log-probs (rollout_correction)
    environment.setdefault(RETURN_ORIGINAL_LOGPROB, "true")
    if on_cpu:
        for name, value in CPU_SERVER_ENVIRONMENT.items():
            environment.setdefault(name, value)
    return environment
