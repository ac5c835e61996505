"""Plugins for the chaos suite (tests/test_faults.py), so a test orders events exactly instead of guessing with sleeps.

HoldUntilReleased holds a worker before its first step until the test releases it, then lets it go on
or fail (this run has made and holds its run directory; now another run starts; now this one fails).
MarkRollouts marks each rank's rollout start with its pid (the test stops or kills that rank mid-rollout).
KillInCheckpoint kills one rank outright in the middle of a checkpoint.
"""

import os
import signal
import time
from pathlib import Path

import torch.distributed

# a held worker gives up waiting after this long, so a broken test cannot leave it behind
HOLD_LIMIT_SECONDS = 600


class HoldUntilReleased:
    """In a worker: writes `<release>.held`, waits until the file `release` exists, then raises if `fail`."""

    def __init__(self, recipe, release, fail=False):
        if not torch.distributed.is_initialized():
            return  # the whole-recipe check builds plugins in the driver too: hold only in workers
        release = Path(release)
        Path(f"{release}.held").touch()
        deadline = time.monotonic() + HOLD_LIMIT_SECONDS
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if fail:
            raise RuntimeError("the test told this worker to fail before its first step")

    def on_rollout_start(self, context):
        """A hook, so that tlt's recipe check takes this class for a plugin."""


class MarkRollouts:
    """Writes <directory>/rollout-<rank>-<step>, holding the rank's pid, as each rollout starts."""

    def __init__(self, recipe, directory):
        self.directory = Path(directory)

    def on_rollout_start(self, context):
        marker = self.directory / f"rollout-{context.worker}-{context.step}"
        partial = marker.with_name(f"{marker.name}.partial")
        partial.write_text(str(os.getpid()))
        partial.rename(marker)  # whole or absent: the test reads the pid as soon as the name appears


class KillInCheckpoint:
    """Rank `rank` SIGKILLs itself while it writes its part of the first checkpoint (its peers wait in a barrier)."""

    def __init__(self, recipe, rank=1):
        self.rank = rank

    def on_checkpoint_save(self, directory):
        if torch.distributed.get_rank() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)
