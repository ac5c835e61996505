"""Plugins for the hostfile tests: ranks fail as the worker builds its plugins, loudly or silently."""

import os

import torch.distributed

FAILING_RANK = 1
# exit status of a rank that dies without reporting
SILENT_EXIT_CODE = 3


class RaiseOnRankOne:
    """Rank 1 raises (the worker reports the error to the driver); the others start normally."""

    def __init__(self, recipe):
        if torch.distributed.get_rank() == FAILING_RANK:
            raise RuntimeError(f"rank {FAILING_RANK} was told to fail")

    def on_rollout_start(self, context):
        """A hook, so that tlt's recipe check takes this class for a plugin."""


class ExitOnEveryRank:
    """Every rank exits at once without a word, as processes killed by the system would."""

    def __init__(self, recipe):
        os._exit(SILENT_EXIT_CODE)

    def on_rollout_start(self, context):
        """A hook, so that tlt's recipe check takes this class for a plugin."""
