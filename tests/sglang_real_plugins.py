"""A plugin for tests/test_sglang_real_train.py: a worker that dies after its first rollout on real SGLang
servers (so the servers are up and have answered when it goes). A hook that raises only disables its plugin,
so the worker is killed outright (SIGKILL, as the kernel's OOM killer does): the driver must then stop the
servers the worker recorded."""

import os
import signal


class KillWorkerAfterFirstRollout:
    """SIGKILLs its own worker process at the end of step 1's rollout."""

    def __init__(self, recipe):
        pass

    def on_rollout_end(self, context):
        os.kill(os.getpid(), signal.SIGKILL)
