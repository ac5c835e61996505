"""Shared test fixtures: one thread per test process, and a process group for DeepSpeed tests.

Also gives the test process a terminal's Ctrl-C: a shell starts background jobs (`pytest &`,
some CI runners) with SIGINT ignored, children inherit that, and the tests that press Ctrl-C on a
`tlt train` subprocess would then see it run on untouched.
"""

import os
import signal
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def cache_directory() -> Path:
    """The tlt cache (compiled DeepSpeed ops, built models): $TLT_CACHE_DIR or ~/.cache/tlt."""
    return Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt"))


@pytest.fixture(scope="session")
def single_process_group(cache_directory):
    """A world of one gloo rank, as a worker process would have, for in-process DeepSpeed tests."""
    from tlt_cli.processes.distributed import WorkerAddress, free_port, init_worker_process

    if not torch.distributed.is_initialized():
        init_worker_process(
            WorkerAddress(0, 1, free_port()), threads=1, extensions_dir=cache_directory / "torch_extensions"
        )
    yield
