"""Helpers of the tests against the real SGLang 0.5.23 (marker `real_sglang`): where its side environment is,
the skip when it is missing, and a server on SGLang's CPU platform started through tlt's own launcher.

The side environment is built by scripts/build_sglang_cpu_env.py; the tests find its interpreter in
$TLT_SGLANG_CPU_PYTHON, else at the script's default path ($TLT_CACHE_DIR/sglang-cpu-env, read when this
module is imported, before the tests point TLT_CACHE_DIR at their own cache).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sglang_fakes import free_port_range

from tlt_cli.config import SGLangConfig
from tlt_cli.sglang.adaptive import PlanMode, SGLangSpeculativePlan
from tlt_cli.sglang.server import ServerGroup, launch_sglang_servers
from tlt_cli.sglang.server_args import CPU_SERVER_ARGS

SIDE_PYTHON = Path(
    os.environ.get(
        "TLT_SGLANG_CPU_PYTHON",
        Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt")) / "sglang-cpu-env" / "bin" / "python",
    )
)
SHIPPED_TINY_MODEL = Path(__file__).resolve().parent.parent / "tlt_cli" / "models" / "tiny_arith"
# a KV pool of a few thousand tokens: SGLang on CPU otherwise sizes it from the machine's whole memory
CPU_TEST_ARGS = (*CPU_SERVER_ARGS, "--max-total-tokens", "4096", "--log-level", "info")

requires_real_sglang = pytest.mark.skipif(
    not SIDE_PYTHON.exists(),
    reason=f"no SGLang CPU environment at {SIDE_PYTHON}: build it with scripts/build_sglang_cpu_env.py "
    "(or set TLT_SGLANG_CPU_PYTHON)",
)


def real_sglang_overrides(port_base: int) -> list[str]:
    """`tlt train` overrides that run the SGLang backend on one real CPU server of the side environment."""
    extra = ",".join(f'"{argument}"' for argument in CPU_TEST_ARGS)
    return [
        "rollout.backend=sglang",
        "rollout.sglang.gpus=[0]",
        "rollout.sglang.colocated=false",
        "rollout.sglang.dtype=float32",
        f"rollout.sglang.python={SIDE_PYTHON}",
        f"rollout.sglang.port_base={port_base}",
        "rollout.sglang.startup_timeout_s=300",
        "rollout.sglang.stop_timeout_s=10",
        f"rollout.sglang.extra_args=[{extra}]",
    ]


def copy_tiny_model(destination: Path) -> Path:
    """The shipped tiny Qwen2 (8 layers, hidden 256, vocabulary 66, tokenizer included) in a folder of its own."""
    shutil.copytree(SHIPPED_TINY_MODEL, destination)
    return destination


def start_cpu_server(model_dir: Path, run_dir: Path, skip_tokenizer_init: bool = False) -> ServerGroup:
    """One real SGLang server on CPU for `model_dir`, started (and later stopped) by tlt's launcher."""
    config = SGLangConfig(
        gpus=(0,),
        port_base=free_port_range(2),
        startup_timeout_s=300.0,
        stop_timeout_s=10.0,
        dtype="float32",
        python=str(SIDE_PYTHON),
        skip_tokenizer_init=skip_tokenizer_init,
        max_running_requests=16,
        extra_args=CPU_TEST_ARGS,
    )
    plan = SGLangSpeculativePlan(mode=PlanMode.off, launch=None, slots=(), differences=())
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return launch_sglang_servers(config, str(model_dir), run_dir, plan, None, seed=0)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
