"""The composition root's setup (tlt_cli/training/setup.py): a recipe turned into the parts every trainer uses."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from tiny_models import tiny_qwen2

from tlt_cli.config import (
    DEFAULT_RULES,
    LinearForms,
    Precision,
    Recipe,
    RolloutDtype,
    SpeculativeMode,
    SpeculativeSection,
)
from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder, speculative_decoder
from tlt_cli.speculative.plan import SpeculationMode
from tlt_cli.speculative.rules import RuleTableError
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training import rollout_backends, setup, update_precision
from tlt_cli.tuning.cache import record_path
from tlt_cli.tuning.run_plan import RunPlan, UpdatePrecision
from tlt_cli.tuning.threads import torch_threads


class DrafterTrainingPlugin:
    """A plugin that declares it trains the drafter (as the drafter sidecar does)."""

    trains_drafter = True


class LoggingPlugin:
    """A plugin that trains nothing."""


def recipe_with(mode: SpeculativeMode, plugins: list[str], **rollout) -> Recipe:
    recipe = Recipe()
    return dataclasses.replace(
        recipe,
        speculative=dataclasses.replace(recipe.speculative, mode=mode),
        plugins=dataclasses.replace(recipe.plugins, enabled=plugins),
        rollout=dataclasses.replace(recipe.rollout, **rollout),
    )


@pytest.mark.parametrize(
    "mode, plugins, needed",
    [
        (SpeculativeMode.off, [], False),
        (SpeculativeMode.off, [f"{__name__}:LoggingPlugin"], False),
        (SpeculativeMode.off, [f"{__name__}:DrafterTrainingPlugin"], True),
        (SpeculativeMode.fixed, [], True),
        (SpeculativeMode.adaptive, [f"{__name__}:LoggingPlugin"], True),
    ],
)
def test_a_run_needs_a_drafter_when_it_speculates_or_a_plugin_trains_one(mode, plugins, needed):
    assert setup.drafter_needed(recipe_with(mode, plugins)) is needed


def test_no_drafter_is_prepared_for_a_run_that_needs_none(tmp_path):
    recipe = recipe_with(SpeculativeMode.off, [])
    assert setup.prepare_drafter(recipe, tmp_path) == (None, None)
    assert not any(tmp_path.iterdir())


def test_sampling_is_the_recipes_rollout_settings():
    recipe = recipe_with(SpeculativeMode.off, [], max_new_tokens=17, temperature=0.5, top_p=0.9, top_k=7)
    sampling = setup.sampling(recipe)
    assert (sampling.max_new_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (17, 0.5, 0.9, 7)


class Tokens:
    eos_token_id, pad_token_id = 1, 0


def run_plan(recipe: Recipe, decode: DecodePlan | None = None) -> RunPlan:
    """The plan a driver hands the workers of `recipe`, with `decode` given (None: float32, plain forms)."""
    update = UpdatePrecision(Precision.fp32, "as the recipe sets it")
    return RunPlan(update, decode or DecodePlan(), setup.speculative_plan(recipe.speculative))


def test_the_embedded_backend_generates_with_the_policy_it_is_given(tmp_path):
    recipe = recipe_with(SpeculativeMode.off, [], linear_forms="off", temperature=0.0, max_new_tokens=3)
    policy = tiny_qwen2(vocab_size=32, seed=3).eval()
    backend = rollout_backends.rollout_backend(
        recipe, policy, Tokens(), None, rollout_backends.BackendPlace(0, 0, tmp_path, run_plan(recipe))
    )
    assert isinstance(backend, EmbeddedRollout)
    completions, _ = backend.generate([RolloutRequest(0, (2, 3, 4))], setup.sampling(recipe), seed=5)
    with torch.no_grad():
        greedy_first = int(policy(torch.tensor([[2, 3, 4]])).logits[0, -1].argmax())
    assert completions[0].response_ids[0] == greedy_first


def test_an_unknown_rollout_backend_is_refused_in_one_sentence(tmp_path):
    recipe = recipe_with(SpeculativeMode.off, [], backend="vllm")
    with pytest.raises(ValueError, match="rollout.backend is 'vllm'; use one of embedded, sglang"):
        rollout_backends.rollout_backend(
            recipe, None, Tokens(), None, rollout_backends.BackendPlace(0, 0, tmp_path, run_plan(recipe))
        )


def test_the_speculative_plan_is_the_sections_values_with_its_rule_table_parsed_once():
    section = dataclasses.replace(Recipe().speculative, mode=SpeculativeMode.adaptive)
    assert section.rules == []  # mode adaptive without a table: tlt's default one
    adaptive = setup.speculative_plan(section)
    assert adaptive.mode is SpeculationMode.adaptive and len(adaptive.rules) == len(DEFAULT_RULES)
    assert adaptive.rules[0].configs == (SpeculativeConfig(2, 1, 3), SpeculativeConfig(3, 1, 4))
    assert (adaptive.collapse_accept_length, adaptive.reprobe_steps, adaptive.bandit_epsilon) == (
        section.collapse_accept_length,
        section.reprobe_steps,
        section.bandit_epsilon,
    )
    assert adaptive.draft_sources == {"drafter"}
    # mode auto (the default) has no table: the cost model chooses; a table given wins over it
    auto = setup.speculative_plan(Recipe().speculative)
    assert auto.mode is SpeculationMode.auto and auto.rules == () and auto.configs == ()
    given = setup.speculative_plan(dataclasses.replace(Recipe().speculative, rules=[{"batch": [1, None], "use": "s2"}]))
    assert given.mode is SpeculationMode.adaptive and given.configs == (SpeculativeConfig(2),)
    fixed = setup.speculative_plan(dataclasses.replace(section, mode=SpeculativeMode.fixed, steps=3, topk=2))
    assert fixed.mode is SpeculationMode.fixed and fixed.configs == (SpeculativeConfig(3, 2, 0),)
    # the table of the other modes is never read: a broken one is no error there
    broken = dataclasses.replace(section, mode=SpeculativeMode.off, rules=[{"batch": [3, 1]}])
    assert setup.speculative_plan(broken).configs == () and setup.speculative_plan(broken).rules == ()
    with pytest.raises(RuleTableError, match="^speculative.rules: rule 1: batch range"):
        setup.speculative_plan(dataclasses.replace(broken, mode=SpeculativeMode.adaptive))


def test_a_model_free_plan_decodes_without_a_drafter_and_a_drafter_plan_does_not():
    model_free = setup.speculative_plan(SpeculativeSection(rules=[{"batch": [1, None], "use": "ngram4"}]))
    assert model_free.draft_sources == {"ngram"}
    assert isinstance(speculative_decoder(model_free, None), AdaptiveSpeculativeDecoder)
    hybrid = setup.speculative_plan(SpeculativeSection(rules=[{"batch": [1, None], "use": "s2-k1-t3+ngram4"}]))
    assert hybrid.draft_sources == {"drafter", "ngram"} and speculative_decoder(hybrid, None) is None
    off = setup.speculative_plan(SpeculativeSection(mode=SpeculativeMode.off))
    assert off.draft_sources == frozenset() and speculative_decoder(off, tiny_qwen2(vocab_size=32, seed=3)) is None


def test_the_decode_plan_is_resolved_once_in_setup_and_the_rollout_measures_nothing(tmp_path, monkeypatch):
    recipe = dataclasses.replace(
        Recipe(),
        model=dataclasses.replace(Recipe().model, cache_dir=str(tmp_path)),
        plugins=dataclasses.replace(Recipe().plugins, enabled=[]),
        drafter=dataclasses.replace(Recipe().drafter, init="random"),
    )
    plan = setup.decode_plan(recipe)
    # mode auto (the default): the pass costs of this machine in the chosen dtype, up to a worker's rows
    assert plan.pass_costs is not None and plan.pass_costs.dtype == plan.dtype
    assert plan.pass_costs.rows[-1] <= recipe.samples_per_worker and plan.pass_costs.drafter_entries
    assert plan.precision["rows"] == recipe.samples_per_worker and plan.precision["speculates"] is True
    assert any(line.startswith("SD pass costs") for line in plan.log_lines)
    assert type(plan).from_dict(plan.to_dict()) == plan  # as launched ranks read it
    off = setup.decode_plan(recipe, request=setup.PlanRequest(speculates=False))
    assert off.pass_costs is None and off.precision["speculates"] is False
    # every measurement is cached now: the same plan is made again without reading the model's weights
    loaded = setup.policy_and_tokenizer
    monkeypatch.setattr(setup, "policy_and_tokenizer", lambda recipe: pytest.fail("the weights were read"))
    assert setup.decode_plan(recipe) == plan
    monkeypatch.setattr(setup, "policy_and_tokenizer", loaded)
    # the rollout takes the plan and measures nothing: every measurement of tuning/ fails now
    from tlt_cli.tuning import linear_forms, pass_costs, precision

    def no_measurement(*args, **kwargs):
        raise AssertionError("a rollout measured")

    for module, name in (
        (linear_forms, "measure_plan"),
        (precision, "measure_precision"),
        (pass_costs, "measure_pass_costs"),
    ):
        monkeypatch.setattr(module, name, no_measurement)
    policy, tokenizer = setup.policy_and_tokenizer(recipe)
    drafter = setup.starting_drafter(recipe, None, policy)
    place = rollout_backends.BackendPlace(0, 0, tmp_path, run_plan(recipe, plan))
    backend = rollout_backends.rollout_backend(recipe, policy, tokenizer, drafter, place)
    assert isinstance(backend, EmbeddedRollout) and backend.engine.decode_model.dtype == plan.torch_dtype
    completions, _ = backend.generate([RolloutRequest(0, (2, 3, 4), group=0)], setup.sampling(recipe), seed=1)
    assert completions[0].response_ids
    usage = backend.take_usage()
    assert sum(value.decode_steps for value in usage.values()) > 0
    assert all(value.predicted_seconds > 0 for value in usage.values())


def test_a_workers_backend_speculates_as_the_run_plan_says_and_reads_no_choice_of_its_recipe(tmp_path):
    """The worker's rollout takes the speculative plan the driver made (here fixed s2-k1-t3 although the recipe's
    section says off): the recipe's `speculative` section is not read again in a worker."""
    recipe = recipe_with(SpeculativeMode.off, [], linear_forms="off")
    fixed = setup.speculative_plan(SpeculativeSection(mode=SpeculativeMode.fixed, steps=2, topk=1, draft_tokens=3))
    plan = dataclasses.replace(run_plan(recipe), speculative=fixed)
    policy = tiny_qwen2(vocab_size=32, seed=3).eval()
    drafter = setup.starting_drafter(recipe, None, policy)
    backend = rollout_backends.rollout_backend(
        recipe, policy, Tokens(), drafter, rollout_backends.BackendPlace(0, 0, tmp_path, plan)
    )
    assert backend.engine.speculative is not None and backend.engine.speculative.schedule(4) == SpeculativeConfig(
        2, 1, 3
    )
    assert (
        rollout_backends.rollout_backend(
            recipe, policy, Tokens(), drafter, rollout_backends.BackendPlace(0, 0, tmp_path, run_plan(recipe))
        ).engine.speculative
        is None
    )


def test_the_run_plan_is_made_once_with_the_recipes_choices_concrete(tmp_path, monkeypatch):
    """setup.planned_run: actor.precision auto (here read from a cached record, so the policy is never loaded),
    the decode plan and the speculative plan; the recipe it gives has the chosen precision, and the plan survives
    JSON as launched ranks read it."""
    recipe = dataclasses.replace(
        recipe_with(SpeculativeMode.fixed, [], linear_forms=LinearForms.off, dtype=RolloutDtype.float32),
        model=dataclasses.replace(Recipe().model, cache_dir=str(tmp_path)),
        actor=dataclasses.replace(Recipe().actor, precision=Precision.auto),
    )
    with torch_threads(recipe.workers.threads_per_worker):  # the measurement's thread count, a worker's
        key = update_precision.measurement_key(recipe, torch.device("cpu"))
    path = record_path(tmp_path, update_precision.CACHE_FOLDER, key)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"key": key, "seconds": {"fp32": 1.0, "bf16": 0.5}}))
    monkeypatch.setattr(setup, "policy_and_tokenizer", lambda recipe: pytest.fail("the policy was loaded"))
    planned, plan = setup.planned_run(recipe, None)
    assert planned.actor.precision == plan.update.precision == Precision.bf16 and recipe.actor.precision == "auto"
    assert plan.update.seconds == {"fp32": 1.0, "bf16": 0.5}
    assert plan.speculative == setup.speculative_plan(recipe.speculative)
    assert plan.decode.dtype == "float32" and plan.log_lines[0] == plan.update.describe()
    assert RunPlan.from_dict(plan.to_dict()) == plan
