"""Plugin hooks: discovery, order of calls in real worker processes, and a crashing plugin disabled."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_overrides import PLAIN_DECODING

from tlt_cli.config import RecipeError
from tlt_cli.plugins import (
    DriverPlugins,
    PluginError,
    PluginHost,
    RunInfo,
    StepContext,
    build_plugins,
    metric_prefix,
    plugin_columns,
    plugin_factory,
    plugins_train_drafter,
    trl_reporting,
)
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


class Prefixed:
    name = "prefixed"
    metric_prefix = "prefixed_"

    def __init__(self, key):
        self.key = key

    def on_rollout_end(self, context):
        context.metrics[self.key] = 1.0


def step_context(metrics):
    return StepContext(step=0, worker=0, world_size=1, engine=None, policy=None, metrics=metrics)


def test_a_metric_outside_the_plugins_prefix_is_undone_and_disables_it():
    context = step_context({"sglang_sync_seconds": 0.5})
    host = PluginHost([Prefixed("prefixed_steps")])
    host.call("on_rollout_end", context)
    assert context.metrics == {"sglang_sync_seconds": 0.5, "prefixed_steps": 1.0} and not host.take_failures()
    host = PluginHost([Prefixed("sglang_sync_seconds")])
    host.call("on_rollout_end", context)
    assert context.metrics["sglang_sync_seconds"] == 0.5  # the core's number is left as it was
    (failure,) = host.take_failures()
    assert "MetricKeyError" in failure.message and "'prefixed_'" in failure.message
    assert host.disabled == {"prefixed"}


class Logger:
    def __init__(self, recipe, fail_in=None):
        self.fail_in, self.calls = fail_in, []

    def on_run_start(self, run):
        self._seen("on_run_start", run.name)

    def on_step_record(self, record):
        self._seen("on_step_record", record["step"])

    def on_run_end(self):
        self._seen("on_run_end", None)

    def _seen(self, hook, value):
        self.calls.append((hook, value))
        if hook == self.fail_in:
            raise RuntimeError(f"{hook} failed")


class StepFailingLogger(Logger):
    def __init__(self, recipe):
        super().__init__(recipe, fail_in="on_step_record")


def run_info(tmp_path):
    return RunInfo("run", tmp_path, 1, 2, 0, False, {"train": {"steps": 2}})


def test_driver_plugins_call_loggers_in_order_and_a_failing_one_is_one_warning(tmp_path):
    recipe = load_checked_recipe(
        RECIPE, ["plugins.enabled=[drafter_sidecar,test_plugins:Logger,test_plugins:StepFailingLogger]"]
    )
    warnings = []
    loggers = DriverPlugins(recipe)
    with loggers.running(run_info(tmp_path), warn=warnings.append):
        built = list(loggers.host.plugins)
        for step in (0, 1):
            loggers.step_recorded({"type": "step", "step": step})
    assert [plugin.name for plugin in built] == [
        "test_plugins:Logger",
        "test_plugins:StepFailingLogger",
    ]  # no worker plugin
    healthy, failing = built
    assert healthy.calls == [
        ("on_run_start", "run"),
        ("on_step_record", 0),
        ("on_step_record", 1),
        ("on_run_end", None),
    ]
    assert failing.calls == [("on_run_start", "run"), ("on_step_record", 0)]
    assert warnings == [
        "plugin test_plugins:StepFailingLogger disabled: on_step_record raised RuntimeError: "
        "on_step_record failed; the run goes on."
    ]


def test_a_logger_without_its_package_is_one_warning_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    warnings = []
    loggers = DriverPlugins(load_checked_recipe(RECIPE, ["plugins.enabled=[tensorboard]"]))
    with loggers.running(run_info(tmp_path), warn=warnings.append):
        loggers.step_recorded({"type": "step", "step": 0, "mean_reward": 1.0})
    assert len(warnings) == 1 and "pip install 'tlt[tensorboard]'" in warnings[0], warnings
    assert not (tmp_path / "tensorboard").exists()


def test_shipped_plugins_are_found_by_entry_point_and_declare_what_the_core_shows():
    assert plugins_train_drafter(["drafter_sidecar"]) and not plugins_train_drafter(["tensorboard", "wandb"])
    assert [column.key for column in plugin_columns(["tensorboard", "drafter_sidecar"])] == [
        "drafter_steps",
        "drafter_update_seconds",
        "drafter_train_seconds",
        "drafter_loss",
    ]
    assert metric_prefix("drafter_sidecar", plugin_factory("drafter_sidecar")) == "drafter_"
    assert metric_prefix("tests.plugins:Recorder", object) == "recorder_"


def test_under_trl_the_recipes_loggers_map_to_report_to_writing_under_the_run_directory(tmp_path, monkeypatch):
    from tlt_cli.integrations.trl_recipe import grpo_config_arguments

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    names = ["drafter_sidecar", "tensorboard", "wandb"]
    report_to, environment = trl_reporting(names, {"wandb": {"project": "mine"}}, tmp_path / "run")
    assert report_to == ["tensorboard", "wandb"]
    assert environment["TENSORBOARD_LOGGING_DIR"] == str(tmp_path / "run" / "tensorboard" / "trl")
    assert environment["WANDB_DIR"] == str(tmp_path / "run" / "trl") and environment["WANDB_PROJECT"] == "mine"
    assert environment["WANDB_MODE"] == "offline" and environment["WANDB_NAME"] == "run-trl"
    monkeypatch.setenv("WANDB_API_KEY", "set-up-by-the-user")
    assert "WANDB_MODE" not in trl_reporting(names, {}, tmp_path)[1]
    recipe = load_checked_recipe(RECIPE, ["train.trainer=trl", "plugins.enabled=[tensorboard]"])
    assert grpo_config_arguments(recipe, 2, tmp_path)["report_to"] == ["tensorboard"]
    recipe = load_checked_recipe(RECIPE, ["train.trainer=trl", "plugins.enabled=[]"])
    assert grpo_config_arguments(recipe, 2, tmp_path)["report_to"] == "none"


def test_the_example_plugin_of_docs_plugins_md_runs_on_both_sides(tmp_path, capsys):
    text = (TESTS.parent / "docs" / "plugins.md").read_text()
    source = text.split("## Example", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    module = tmp_path / "rollout_timer_example.py"
    module.write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        name = "rollout_timer_example:RolloutTimer"
        recipe = load_checked_recipe(
            RECIPE, [f"plugins.enabled=[{name}]", f"plugins.options.{name}.threshold_seconds=0"]
        )
        check_recipe(recipe)
        (worker_side,) = build_plugins(recipe.plugins.enabled, dict(recipe.plugins.options), recipe)
        host, context = PluginHost([worker_side]), step_context({})
        host.call("on_rollout_start", context)
        host.call("on_rollout_end", context)
        assert not host.take_failures() and list(context.metrics) == ["timer_generate_seconds"]
        assert [column.key for column in plugin_columns([name])] == ["timer_generate_seconds"]
        loggers = DriverPlugins(recipe)
        with loggers.running(run_info(tmp_path), warn=pytest.fail):
            loggers.step_recorded({"type": "step", "step": 3, **context.metrics})
    finally:
        sys.path.remove(str(tmp_path))
    assert "at step 3" in capsys.readouterr().out


def test_a_trl_run_takes_loggers_and_the_drafter_trainer_but_no_other_worker_plugin():
    trl_recipe = RECIPE.parent / "trl-tiny-cpu.yaml"
    check_recipe(load_checked_recipe(trl_recipe, ["plugins.enabled=[drafter_sidecar,tensorboard,wandb]"]))
    with pytest.raises(RecipeError, match="CrashingPlugin hooks into tlt's own worker loop"):
        check_recipe(load_checked_recipe(trl_recipe, ["plugins.enabled=[plugins_for_tests:CrashingPlugin]"]))
    generating = ["rollout.backend=trl", "speculative.mode=off"]
    with pytest.raises(RecipeError, match="drafter_sidecar trains the drafter, which rollout.backend trl"):
        check_recipe(load_checked_recipe(trl_recipe, [*generating, "plugins.enabled=[drafter_sidecar]"]))
    check_recipe(load_checked_recipe(trl_recipe, [*generating, "plugins.enabled=[tensorboard]"]))
