"""Plugins used by the tests: one records every hook it sees, one raises."""

import json
from pathlib import Path


class RecordingPlugin:
    """Appends the name of each hook call to <directory>/worker-<rank>.jsonl."""

    metric_prefix = "recorded_"

    def __init__(self, recipe, directory):
        self.directory = Path(directory)
        self.worker = None

    def _record(self, hook, context=None, **fields):
        if context is not None:
            self.worker = context.worker
        path = self.directory / f"worker-{self.worker}.jsonl"
        with path.open("a") as handle:
            handle.write(json.dumps({"hook": hook, **fields}) + "\n")

    def on_rollout_start(self, context):
        self._record("on_rollout_start", context, step=context.step)

    def on_request_finished(self, context, completion):
        self._record("on_request_finished", context, request_id=completion.request_id)

    def on_worker_idle(self, context, rollout_over):
        self._record("on_worker_idle", context)
        while not rollout_over():
            pass

    def on_rollout_end(self, context):
        self._record("on_rollout_end", context)
        context.metrics["recorded_steps"] = 1.0

    def on_hidden_states(self, context, batch, hidden_states):
        self._record("on_hidden_states", context, shape=list(hidden_states.shape))

    def on_weights_updated(self, context):
        self._record("on_weights_updated", context)

    def on_checkpoint_save(self, directory):
        self._record("on_checkpoint_save")


class CrashingPlugin:
    """Raises the first time its rollout-start hook runs."""

    def __init__(self, recipe):
        self.calls = 0

    def on_rollout_start(self, context):
        self.calls += 1
        raise RuntimeError(f"boom on call {self.calls}")


class FailingLogger:
    """A driver-side plugin (a logger) whose step hook raises: the run warns once and goes on."""

    def __init__(self, recipe):
        self.records = 0

    def on_step_record(self, record):
        self.records += 1
        raise OSError(f"logger backend unreachable at step {record['step']}")
