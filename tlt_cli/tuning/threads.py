"""The one helper that sets torch's thread count for a while and gives the old one back.

    with torch_threads(recipe.workers.threads_per_worker):   # as a worker decodes, updates and measures
        plan = measure(...)

Everything that measures or decodes outside a worker (the plan's maker in training/setup.py, the update
precision's timing, `tlt profile`, `tlt calibrate`, `tlt bench`) runs on a worker's thread count through this,
so its figures are a worker's; the process entry points (processes/distributed.py, integrations/trl_run.py) set
the count once for the process's life and restore nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Inside: torch on `count` threads; after (an error included): the count it had before."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
