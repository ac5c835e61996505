"""`tlt export-policy`: a checkpoint's policy as a Hugging Face folder transformers loads with the same log-probs."""

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from tests.test_export import partly_right_drafter, tiny_target, write_recipe
from tlt_cli.checkpoint import prepare_staging, publish
from tlt_cli.cli import app
from tlt_cli.config import ActorConfig
from tlt_cli.drafter import library
from tlt_cli.drafter.model import save_drafter
from tlt_cli.export_policy import held_out_prompt_ids, policy_at_checkpoint, token_log_probs
from tlt_cli.models.tiny import build_tiny_model, save_model_folder
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.training import setup
from tlt_cli.training.actor import Actor

torch.set_num_threads(1)
runner = CliRunner()


def save_checkpoint(run, policy, step, drafter=False):
    staging = prepare_staging(run / "checkpoints", step)
    Actor(policy, ActorConfig(precision="fp32", micro_batch_size=2), sequences_per_update=2).save(staging)
    if drafter:
        save_drafter(partly_right_drafter(policy), staging / "drafter")
    publish(run / "checkpoints", step, {"world_size": 1}, keep=3)


@pytest.fixture
def trained_run(single_process_group, tmp_path):
    """A run directory with checkpoints after steps 2 and 3, whose policies differ from the model folder and
    from each other."""
    base, tokenizer = tiny_target()
    save_model_folder(base, tokenizer, tmp_path / "model")
    run = tmp_path / "run"
    run.mkdir()
    write_recipe(run / "recipe.yaml", tmp_path / "model")
    policies = {}
    for step, scale in ((2, 1.25), (3, 1.5)):
        policy = build_tiny_model(0, base.config)
        with torch.no_grad():
            policy.model.norm.weight.mul_(scale)
        save_checkpoint(run, policy, step, drafter=step == 3)
        policies[step] = policy.eval()
    return run, policies


def test_export_loads_in_transformers_with_the_checkpoints_log_probs_exactly(tmp_path, trained_run):
    run, policies = trained_run
    out = tmp_path / "policy"
    result = runner.invoke(app, ["export-policy", str(run), str(out)])
    assert result.exit_code == 0, result.output
    assert "checkpoint step_000003, written after RL step 2" in result.output
    assert "log-probs equal the checkpoint's" in result.output
    assert {"config.json", "model.safetensors", "tlt_policy.json", "tokenizer_config.json"} <= {
        path.name for path in out.iterdir()
    }
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".policy")]  # no staging left
    assert json.loads((out / "tlt_policy.json").read_text())["rl_step"] == 2
    # the run's drafter is held for the exported policy, so a run on `out` starts with it (drafter.init auto)
    assert "the run's drafter is held for the exported policy" in result.output
    held, record = library.newest(setup.model_cache(load_checked_recipe(run / "recipe.yaml")), out)
    assert str(held) == json.loads((out / "tlt_policy.json").read_text())["held_drafter"]
    assert record.source.startswith("run ") and record.source.endswith("(its exported policy)")
    assert (held / "drafter.safetensors").read_bytes() == (
        run / "checkpoints" / "step_000003" / "drafter" / "drafter.safetensors"
    ).read_bytes()

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.dtype == torch.float32
    recipe = load_checked_recipe(run / "recipe.yaml")
    checkpoint_policy, _ = policy_at_checkpoint(recipe, run / "checkpoints" / "step_000003")
    prompts = held_out_prompt_ids(recipe, AutoTokenizer.from_pretrained(out), 3)
    for prompt in prompts:
        expected = token_log_probs(policies[3], prompt)
        assert torch.equal(token_log_probs(loaded, prompt), expected)
        assert torch.equal(token_log_probs(checkpoint_policy, prompt), expected)
    # the probe can fail: the step-2 policy gives other log-probs
    assert not torch.equal(token_log_probs(policies[2], prompts[0]), token_log_probs(loaded, prompts[0]))


def test_step_picks_an_earlier_checkpoint_and_an_empty_output_folder_is_filled(tmp_path, trained_run):
    run, policies = trained_run
    out = tmp_path / "policy-2"
    out.mkdir()
    result = runner.invoke(app, ["export-policy", str(run), str(out), "--step", "1"])
    assert result.exit_code == 0, result.output
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(loaded.model.norm.weight, policies[2].model.norm.weight)


def test_step_numbers_count_from_0_as_the_trace_does(tmp_path, trained_run):
    """step_000003 holds next_step 3, written after the trace's steps 0, 1 and 2: `--step 2` is that checkpoint, and
    the output, tlt_policy.json and the refusal of `--step 3` say step 2, as the trace and --resume do."""
    run, policies = trained_run
    out = tmp_path / "policy"
    result = runner.invoke(app, ["export-policy", str(run), str(out), "--step", "2"])
    assert result.exit_code == 0, result.output
    assert "exported the policy of checkpoint step_000003, written after RL step 2" in result.output
    assert json.loads((out / "tlt_policy.json").read_text())["rl_step"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(loaded.model.norm.weight, policies[3].model.norm.weight)
    refused = runner.invoke(app, ["export-policy", str(run), str(tmp_path / "later"), "--step", "3"])
    assert refused.exit_code == 2, refused.output
    assert "no checkpoint written after step 3; its checkpoints were written after steps 1, 2" in refused.output


def test_refusals_are_one_sentence_and_write_nothing(tmp_path, trained_run):
    run, _ = trained_run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("keep me")
    cases = {
        (str(run), str(tmp_path / "full")): "is not empty",
        (str(run), str(tmp_path / "a"), "--step", "7"): "no checkpoint written after step 7; its checkpoints were",
        (str(tmp_path / "nowhere"), str(tmp_path / "b")): "is not a run directory",
    }
    for arguments, message in cases.items():
        result = runner.invoke(app, ["export-policy", *arguments])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
    assert (tmp_path / "full" / "notes.txt").read_text() == "keep me"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_current_folder_or_one_above_it_is_refused_in_one_sentence(tmp_path, trained_run, monkeypatch):
    run, _ = trained_run
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")  # empty: the not-empty refusal does not apply
    for output in (".", "..", "/", "policy/.."):
        result = runner.invoke(app, ["export-policy", str(run), output])
        assert result.exit_code == 2, result.output
        assert "is the current folder or holds it" in result.output and "Traceback" not in result.output
    assert list((tmp_path / "empty").iterdir()) == []


def test_the_drafter_cards_serving_command_exports_the_policy_first(tmp_path, trained_run):
    run, _ = trained_run
    result = runner.invoke(app, ["export-drafter", str(run), str(tmp_path / "drafter"), "--prompts", "1"])
    assert result.exit_code == 0, result.output
    card = (tmp_path / "drafter" / "README.md").read_text()
    assert f"tlt export-policy {run} policy-step-2 --step 2\n" in card
    assert "--model-path policy-step-2 " in card


def test_a_link_and_a_folder_in_the_runs_checkpoints_are_refused_in_one_sentence(tmp_path, trained_run):
    run, _ = trained_run
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    cases = {
        tmp_path / "link": "is a symbolic link; name a new folder to export into",
        run / "checkpoints" / "policy": "is inside the run's checkpoints/, which the run's later checkpoints replace",
    }
    for output, message in cases.items():
        result = runner.invoke(app, ["export-policy", str(run), str(output)])
        assert result.exit_code == 2, result.output
        assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert list((tmp_path / "target").iterdir()) == [] and not (run / "checkpoints" / "policy").exists()


def test_the_next_export_removes_the_staging_folder_a_killed_export_left_and_keeps_a_live_ones(tmp_path, trained_run):
    run, _ = trained_run
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left, live = tmp_path / f".policy.tmp-{gone.pid}", tmp_path / f".policy.tmp-{os.getppid()}"
    for folder in (left, live):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 64)
    result = runner.invoke(app, ["export-policy", str(run), str(tmp_path / "policy")])
    assert result.exit_code == 0, result.output
    assert not left.exists() and live.exists()


# an export that SIGTERM reaches while its staging folder holds the written model (the reload check)
TERMINATED_EXPORT = """
import os, signal, sys, time
from tlt_cli import export_policy
from tlt_cli.cli import app

def check_reload(*arguments):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

export_policy._check_reload = check_reload
app(["export-policy", sys.argv[1], sys.argv[2]])
"""


def test_sigterm_during_an_export_removes_its_staging_folder_in_one_line(tmp_path, trained_run):
    run, _ = trained_run
    stopped = subprocess.run(
        [sys.executable, "-c", TERMINATED_EXPORT, str(run), str(tmp_path / "policy")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stopped.returncode == 143, stopped.stderr
    assert (
        stopped.stderr.strip()
        .splitlines()[-1]
        .endswith("terminated; nothing was exported (its staging folder is removed).")
    )
    assert "Traceback" not in stopped.stderr
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".policy")] == []
