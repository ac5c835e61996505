"""Plugin hooks: discovery, order of calls in real worker processes, and a crashing plugin disabled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_overrides import PLAIN_DECODING

from tlt_cli.config import RecipeError
from tlt_cli.plugins import PluginError, PluginHost, plugin_factory
from tlt_cli.preflight import check_recipe
from tlt_cli.recipe_checks import load_checked_recipe

TESTS = Path(__file__).resolve().parent
RECIPE = TESTS.parent / "recipes" / "tiny-cpu.yaml"


class Counter:
    name = "counter"

    def __init__(self):
        self.seen = []

    def on_rollout_start(self, context):
        self.seen.append("start")


class Broken:
    name = "broken"

    def on_rollout_start(self, context):
        raise ValueError("bad plugin")


def test_host_disables_a_raising_plugin_and_keeps_calling_the_others():
    counter, broken = Counter(), Broken()
    host = PluginHost([broken, counter])
    host.call("on_rollout_start", None)
    host.call("on_rollout_start", None)
    assert counter.seen == ["start", "start"]
    failures = host.take_failures()
    assert [(failure.plugin, failure.hook) for failure in failures] == [("broken", "on_rollout_start")]
    assert "ValueError: bad plugin" in failures[0].message
    assert host.disabled == {"broken"} and host.wants("on_rollout_start")


def test_collective_hooks_skip_plugins_disabled_on_another_worker():
    counter = Counter()
    counter.on_rollout_end = lambda context: counter.seen.append("end")
    host = PluginHost([counter], agree=lambda disabled: disabled | {"counter"})
    host.call("on_rollout_end", None)
    assert counter.seen == []


def test_unknown_plugins_are_recipe_errors(tmp_path):
    with pytest.raises(PluginError, match="not installed"):
        plugin_factory("no_such_plugin")
    with pytest.raises(RecipeError, match="plugins.enabled"):
        check_recipe(load_checked_recipe(RECIPE, ["plugins.enabled=[no_such_plugin]"]))
    with pytest.raises(RecipeError, match="cannot be imported"):
        check_recipe(load_checked_recipe(RECIPE, ["plugins.enabled=[no_module_here:Thing]"]))


def test_hooks_fire_in_order_in_each_worker_and_a_crashing_plugin_is_disabled(tmp_path, cache_directory):
    from tlt_cli.models.tiny import ensure_tiny_model

    model = ensure_tiny_model(cache_directory, warmup_steps=40)
    record_directory = tmp_path / "hooks"
    record_directory.mkdir()
    command = [
        sys.executable,
        "-m",
        "tlt_cli",
        "train",
        str(RECIPE),
        f"model.path={model}",
        *PLAIN_DECODING,
        f"run.output_dir={tmp_path}",
        "run.name=plugins",
        "train.steps=1",
        "train.prompts_per_step=4",
        "train.group_size=2",
        "rollout.max_new_tokens=48",
        "checkpoint.every=1",
        "plugins.enabled=[plugins_for_tests:RecordingPlugin,plugins_for_tests:CrashingPlugin]",
        f"plugins.options.plugins_for_tests:RecordingPlugin.directory={record_directory}",
    ]
    environment = {**os.environ, "PYTHONPATH": str(TESTS)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "plugin plugins_for_tests:CrashingPlugin disabled on worker 0" in result.stdout
    for worker in (0, 1):
        hooks = [
            json.loads(line)["hook"] for line in (record_directory / f"worker-{worker}.jsonl").read_text().splitlines()
        ]
        compact = [hook for index, hook in enumerate(hooks) if index == 0 or hook != hooks[index - 1]]
        expected = [
            "on_rollout_start",
            "on_request_finished",
            "on_worker_idle",
            "on_rollout_end",
            "on_hidden_states",
            "on_weights_updated",
            "on_checkpoint_save",
        ]
        # the last worker to finish its shard is never idle
        assert compact in (expected, [hook for hook in expected if hook != "on_worker_idle"]), compact
        assert hooks.count("on_request_finished") == 4
    trace = [json.loads(line) for line in (tmp_path / "plugins" / "trace.jsonl").read_text().splitlines()]
    warnings = [record for record in trace if record["type"] == "warning"]
    assert len(warnings) == 2 and all("boom on call 1" in record["message"] for record in warnings)
    step = next(record for record in trace if record["type"] == "step")
    assert step["recorded_steps"] == 2.0
