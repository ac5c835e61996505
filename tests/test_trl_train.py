"""`tlt train` on a TRL recipe (train.trainer: trl): TRL's GRPOTrainer with tlt's rollout, run as tlt runs.

The shipped recipes/trl-tiny-cpu.yaml trains for a few steps in two data-parallel processes and
leaves a run directory `tlt profile` and `tlt export-drafter` read unchanged, with the trace's
record types and checkpoints `--resume` continues from. Bad input (a TRL option that does not
exist or that the recipe sets by its own key, a tokenizer of another model, an unsupported TRL) is
one sentence and exit 2 from both `tlt recipes validate` and `tlt train`, with nothing written.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("trl")

from tlt_cli.cli import LOADING_LINE, app
from tlt_cli.config import load_recipe
from tlt_cli.integrations import trl_support
from tlt_cli.integrations.trl_recipe import grpo_config_arguments
from tlt_cli.integrations.trl_support import UnsupportedTrlError
from tlt_cli.models.loading import load_config_and_tokenizer
from tlt_cli.models.tiny import SHIPPED_TINY_MODEL
from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.trace import read_trace
from tlt_cli.versions import supported_ranges

RECIPE = RECIPES_DIRECTORY / "trl-tiny-cpu.yaml"
# a short run: 4 prompts x 4 samples a step, short responses, no drafter warm-up
SHORT = [
    "train.prompts_per_step=4",
    "train.group_size=4",
    "rollout.max_new_tokens=40",
    "drafter.init=random",
    "checkpoint.every=1",
]
runner = CliRunner()


def tlt(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tlt_cli", *arguments], cwd=cwd, capture_output=True, text=True, check=False, timeout=900
    )


@pytest.mark.slow
def test_a_trl_run_writes_the_trace_checkpoints_profile_and_export_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    trained = tlt("train", str(RECIPE), "train.steps=2", *SHORT, cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    run = tmp_path / "runs" / "trl-tiny-cpu"
    records = read_trace(run / "trace.jsonl")
    assert {"run", "request", "worker", "sd_config", "step"} <= {record["type"] for record in records}
    steps = [record for record in records if record["type"] == "step"]
    assert [step["step"] for step in steps] == [0, 1]
    assert all(
        step["actor_loss"] is not None and step["rollout_seconds"] > 0 and step["update_seconds"] > 0 for step in steps
    )
    # the rollout/learner mismatch of tlt's rollout, measured every step as in a native run
    assert all(isinstance(step["actor_rollout_kl_k3"], float) and step["actor_rollout_kl_k3"] >= 0 for step in steps)
    assert all(step["actor_rollout_weight_min"] <= step["actor_rollout_weight_max"] for step in steps)
    requests = [record for record in records if record["type"] == "request"]
    assert len(requests) == 2 * 4 * 4 and {request["worker"] for request in requests} == {0, 1}
    assert all(0.0 <= request["reward"] <= 1.0 for request in requests)
    assert sum(step.get("drafter_steps", 0) for step in steps) > 0  # the sidecar trained in the processes' wait
    (run_record,) = [record for record in records if record["type"] == "run"]
    assert {choice["dtype"] for choice in run_record["rollout_precision"].values()} <= {"float32", "bfloat16"}

    profiled = tlt("profile", str(run), "--json", "--no-plots", cwd=tmp_path)
    assert profiled.returncode == 0, profiled.stderr
    profile = json.loads(profiled.stdout)
    assert [step["mismatch"]["kl_k3"] for step in profile["steps"]] == [step["actor_rollout_kl_k3"] for step in steps]
    exported = tlt(
        "export-drafter", str(run), str(tmp_path / "exported"), "--prompts", "2", "--max-new-tokens", "24", cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "exported" / "model.safetensors").is_file()

    resumed = tlt("train", "--resume", str(run), "train.steps=3", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    records = read_trace(run / "trace.jsonl")
    assert [record["step"] for record in records if record["type"] == "step"] == [0, 1, 2]
    assert [record["resumed_from_step"] for record in records if record["type"] == "run"] == [None, 2]


def test_grpo_config_takes_the_recipes_keys_and_its_trl_section(tmp_path):
    recipe = load_recipe(RECIPE, ["actor.ppo_epochs=2"])
    arguments = grpo_config_arguments(recipe, processes=2, run_directory=tmp_path)
    assert arguments["per_device_train_batch_size"] == recipe.actor.micro_batch_size
    # 8 prompts x 8 samples over 2 processes, 4 per micro-batch: one generation batch per tlt step
    assert arguments["gradient_accumulation_steps"] == arguments["steps_per_generation"] == 8
    assert arguments["max_steps"] == recipe.train.steps * 2 and arguments["num_iterations"] == 2
    assert arguments["num_generations"] == recipe.train.group_size
    assert arguments["loss_type"] == recipe.trl["loss_type"] == "grpo"
    # the rollout correction's TRL form (tlt's trainer applies it to tlt's rollout; TRL itself only under vLLM)
    assert arguments["vllm_importance_sampling_mode"] == "token_truncate"
    assert arguments["vllm_importance_sampling_clip_max"] == 2.0 and arguments["vllm_importance_sampling_correction"]
    sequence = load_recipe(RECIPE, ["actor.rollout_correction=sequence", "actor.rollout_correction_cap=3"])
    assert grpo_config_arguments(sequence, 2, tmp_path)["vllm_importance_sampling_mode"] == "sequence_truncate"
    off = load_recipe(RECIPE, ["actor.rollout_correction=off"])
    assert grpo_config_arguments(off, 2, tmp_path)["vllm_importance_sampling_correction"] is False


def assert_refused(tmp_path: Path, overrides: list[str], named: str) -> str:
    """validate and train both exit 2 with the same one line naming `named`; nothing is written."""
    output = f"run.output_dir={tmp_path / 'runs'}"
    validated = runner.invoke(app, ["recipes", "validate", str(RECIPE), output, *overrides])
    trained = runner.invoke(app, ["train", str(RECIPE), output, *overrides])
    for result in (validated, trained):
        assert result.exit_code == 2, result.output
        refusal = result.output.replace(LOADING_LINE + "\n", "")  # `tlt train`'s line before its heavy imports
        assert len(refusal.strip().splitlines()) == 1 and "Traceback" not in result.output, result.output
    message = trained.output.replace(LOADING_LINE + "\n", "").strip().removeprefix("error: ")
    assert validated.output.strip().removeprefix("invalid ") == message
    assert named in message, message
    assert not (tmp_path / "runs").exists()
    return message


def test_a_trl_option_that_does_not_exist_is_refused_naming_it(tmp_path):
    message = assert_refused(tmp_path, ["trl.loss_typ=grpo"], "trl.loss_typ")
    assert "trl.loss_type" in message  # the closest field is suggested


def test_a_trl_option_the_recipe_sets_is_refused_naming_its_key(tmp_path):
    assert "actor.lr" in assert_refused(tmp_path, ["trl.learning_rate=0.1"], "trl.learning_rate")


def test_a_tokenizer_of_another_model_is_refused(tmp_path):
    mismatched = tmp_path / "mismatched-model"
    shutil.copytree(SHIPPED_TINY_MODEL, mismatched)
    _, tokenizer = load_config_and_tokenizer(str(mismatched))
    tokenizer.add_tokens([f"<extra_{index}>" for index in range(8)])
    tokenizer.save_pretrained(mismatched)
    assert_refused(tmp_path, [f"model.path={mismatched}"], "tokenizer")


def test_an_unsupported_trl_version_is_one_sentence_naming_the_range(tmp_path, monkeypatch):
    with pytest.raises(UnsupportedTrlError, match=re.escape(supported_ranges()["trl"])):
        trl_support.check_trl_version("0.19.1")
    monkeypatch.setattr(trl_support, "installed_trl_version", lambda: "0.19.1")
    message = assert_refused(tmp_path, [], supported_ranges()["trl"])
    assert "0.19.1" in message and message.count(". ") == 0
