"""A plugin for tests/test_sglang_real_train.py: a worker that fails after its first rollout on real SGLang
servers (so the servers are up and have answered when the worker raises)."""


class FailAfterFirstRollout:
    """Raises at the end of step 1's rollout, in the worker."""

    def __init__(self, recipe):
        pass

    def on_rollout_end(self, context):
        raise RuntimeError("the test told this worker to fail after its first rollout")
