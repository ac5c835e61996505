"""The run's fidelity guard (tlt_cli/processes/fidelity_guard.py) on step records, and end to end on a
two-process `tlt train` whose bfloat16 rollout rounds to nearest (it fires) or stochastically (quiet).

The end-to-end model is the tests' tiny model with a third of its weights exactly halfway between two
bfloat16 values and a third on the bfloat16 grid (as SmolLM2 dequantized from its GGUF, and a checkpoint
stored in bfloat16), trained at an RL learning rate (1e-6, far below a bfloat16 ulp).
"""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from recipe_overrides import small_run
from test_bfloat16_fidelity import on_grid_and_halfway

from tlt_cli.config import load_recipe
from tlt_cli.models.loading import load_policy
from tlt_cli.processes import worker_events
from tlt_cli.processes.fidelity_guard import (
    FLOAT32_CEILING,
    FLOOR,
    JUMP,
    FidelityGuard,
    fidelity_advice,
    rounding_ceiling,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def step(number: int, rollout_kl: float | None = None, precision_kl: float | None = None) -> dict:
    record = {"type": "step", "step": number}
    if rollout_kl is not None:
        record["actor_rollout_kl_k3"] = rollout_kl
    if precision_kl is not None:
        record["actor_precision_kl_k3"] = precision_kl
    return record


def test_a_jump_from_the_first_steps_kl_is_one_sentence_once_per_figure():
    guard = FidelityGuard("likely cause: X; set Y")
    assert guard.check(step(0, 7e-4, 2e-4)) == []
    assert guard.check(step(1, 3.2e-3, 9e-4)) == []  # 4.6x and 4.5x: under the jump
    (message,) = guard.check(step(2, 2.3e-2, 2.1e-4))
    assert message.startswith("step 2: the rollout/learner KL is 2.3e-02, 33x the first step's 7.0e-04")
    assert message.endswith("(likely cause: X; set Y).") and message.count("\n") == 0
    assert guard.check(step(3, 5e-2)) == []  # said once per run
    (message,) = guard.check(step(4, 2.4e-2, 2.1e-3))
    assert "the bfloat16 learner's KL from its float32 weights is 2.1e-03, 10x" in message


def test_noise_below_the_floor_and_missing_or_bad_figures_say_nothing():
    guard = FidelityGuard("advice")
    assert guard.check(step(0, 4.6e-12)) == []
    assert guard.check(step(1, FLOOR / 2)) == []  # 1e11x a float32 run's noise, still noise
    assert guard.check(step(2)) == [] and guard.check({**step(3), "actor_rollout_kl_k3": -1.0}) == []
    assert guard.check({**step(4), "actor_rollout_kl_k3": "a lot"}) == []
    assert len(guard.check(step(5, JUMP * FLOOR))) == 1


@pytest.mark.parametrize("broken", [float("nan"), float("inf")])
def test_a_kl_that_is_no_longer_a_number_is_a_jump(broken):
    guard = FidelityGuard("advice")
    assert guard.check(step(0, 7e-4)) == []
    (message,) = guard.check(step(1, broken))
    assert message.startswith(f"step 1: the rollout/learner KL is {broken:.1e}, up from the first step's 7.0e-04")
    assert guard.check(step(2, broken)) == []


def test_a_resumed_run_does_not_warn_again_about_a_figure_it_warned_about():
    warned = {"type": "warning", "kind": "fidelity", "figure": "actor_rollout_kl_k3", "step": 2, "message": "..."}
    guard = FidelityGuard("advice", [step(0, 7e-4), step(2, 2.3e-2), warned])
    assert guard.check(step(3, 5e-2)) == []


def test_a_damaged_trace_line_before_a_resume_keeps_the_first_steps_baseline(tmp_path):
    lines = [{"type": "run"}, step(0, 7e-4), step(1, 9e-4)]
    trace = "\n".join(json.dumps(record) for record in lines[:2]) + '\n{"type": "st\n' + json.dumps(lines[2]) + "\n"
    (tmp_path / "trace.jsonl").write_text(trace)
    recipe = load_recipe(RECIPES / "tiny-cpu.yaml", [])
    run_spec = SimpleNamespace(plan=None, run_directory=tmp_path, start_step=2, recipe=recipe)
    guard = worker_events._fidelity_guard(run_spec)
    assert guard.baselines == {"actor_rollout_kl_k3": 7e-4}
    assert len(guard.check(step(2, 7e-3))) == 1


def test_a_resumed_run_keeps_its_first_steps_kl_as_the_baseline():
    guard = FidelityGuard("advice", [step(1, 5e-3), step(0, 7e-4)])
    assert len(guard.check(step(2, 8e-3))) == 1


def test_the_advice_names_the_setting_that_avoids_the_cause():
    recipe = load_recipe(RECIPES / "tiny-cpu.yaml", ["actor.precision=fp32", "actor.bfloat16_rounding=nearest"])
    assert "set actor.bfloat16_rounding=stochastic" in fidelity_advice(recipe, "bfloat16")
    assert "a weight sync that did not land" in fidelity_advice(recipe, "float32")
    stochastic = load_recipe(RECIPES / "tiny-cpu.yaml", ["actor.precision=bf16"])
    assert "rollout.dtype=float32 actor.precision=fp32" in fidelity_advice(stochastic, "float32")


def test_a_float32_run_whose_first_step_is_already_off_the_policy_warns_at_step_0():
    """A learner that computes another model from the start (issue 65: 3.5e-3 where float32 measures 1e-14) is its
    own first step's baseline, so no jump shows it; the dtype's rounding bound does, once."""
    guard = FidelityGuard("advice", ceiling=FLOAT32_CEILING)
    (message,) = guard.check(step(0, 3.5e-3))
    assert message.startswith("step 0: the rollout/learner KL is 3.5e-03, above the 1e-06 that float32 rounding")
    assert message.endswith("(advice).") and guard.check(step(1, 3.6e-3)) == []
    quiet = FidelityGuard("advice", ceiling=FLOAT32_CEILING)
    assert quiet.check(step(0, 1e-14)) == [] and quiet.check(step(1, FLOAT32_CEILING)) == []
    assert quiet.check(step(2, 0.0, precision_kl=1e-4)) == []  # the bound is the rollout/learner KL's alone
    assert FidelityGuard("advice").check(step(0, 3.5e-3)) == []  # no bound: the first step is the baseline


def test_only_a_float32_rollout_and_learner_on_cpu_have_a_rounding_bound():
    fp32 = load_recipe(RECIPES / "tiny-cpu.yaml", ["actor.precision=fp32"])
    assert rounding_ceiling(fp32, "float32") == FLOAT32_CEILING
    assert rounding_ceiling(fp32, "bfloat16") is None
    assert rounding_ceiling(load_recipe(RECIPES / "tiny-cpu.yaml", ["actor.precision=bf16"]), "float32") is None
    on_gpu = load_recipe(RECIPES / "tiny-cpu.yaml", ["actor.precision=fp32", "actor.devices=[0]"])
    assert rounding_ceiling(on_gpu, "float32") is None


@pytest.fixture(scope="module")
def gridded_model(small_model, tmp_path_factory) -> Path:
    """The tests' tiny model, float32, with weights on and halfway between bfloat16 values."""
    policy, tokenizer = load_policy(str(small_model))
    policy = on_grid_and_halfway(policy.to(torch.float32))
    folder = tmp_path_factory.mktemp("gridded") / "model"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def trace(run_directory: Path) -> list[dict]:
    return [json.loads(line) for line in (run_directory / "trace.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_two_process_bfloat16_run_keeps_its_rollout_on_the_policy_and_the_guard_quiet(gridded_model, tmp_path):
    """Round-to-nearest copies of this tiny, confident model do not jump measurably (1.5e-5 -> 2.1e-5 over 3
    steps, measured): its jump is shown on SmolLM2 (BENCHMARKS.md), where the guard fires."""
    extra = ("rollout.dtype=bfloat16", "actor.precision=bf16", "actor.lr=1e-6", "rollout.linear_forms=off")
    result = subprocess.run(small_run(gridded_model, tmp_path, "run", 3, *extra), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    records = trace(tmp_path / "run")
    steps = [record for record in records if record["type"] == "step"]
    rollout = [step["actor_rollout_kl_k3"] for step in steps]
    learner = [step["actor_precision_kl_k3"] for step in steps]
    assert max(rollout[1:]) <= 3 * rollout[0] and max(learner[1:]) <= 3 * learner[0], (rollout, learner)
    assert not [record for record in records if record.get("kind") == "fidelity"]
    assert "no longer samples" not in result.stdout
