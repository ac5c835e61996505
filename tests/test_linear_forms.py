"""Linear forms (tlt_cli/engine/linear_forms.py, measured by tlt_cli/tuning/linear_forms.py): same products, same
tokens, fresh copies, cached plans, and the policy's own modules never changed.

Plans are forced (every form at every row count, or a mix by rows) so each form really runs: on these
tiny cached models a measured plan would mostly keep F.linear.
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_gpt2, tiny_llama, tiny_qwen2
from torch import nn

from tlt_cli.config import RecipeError, SpeculativeSection
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine.linear_forms import (
    LINEAR,
    TRANSPOSED,
    WEIGHT_MAJOR,
    FormedCopy,
    FormedLinear,
    LinearFormPlan,
    linear_layers,
    shape_key,
)
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.errors import UserError
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.setup import decode_plan_for, speculative_plan
from tlt_cli.tuning import cache
from tlt_cli.tuning.cache import record_path
from tlt_cli.tuning.linear_forms import CACHE_FOLDER, cached_plan, measure_plan, plan_key

torch.set_num_threads(1)

VOCAB = 64
NEVER_EMITTED = VOCAB
# a different form by rows, every form used: 1 transposed, 2 weight-major, 3-4 linear, 5-8 transposed, 9-64 weight-major
MIXED_BUCKETS = (1, 2, 4, 8, 64)
MIXED_FORMS = (TRANSPOSED, WEIGHT_MAJOR, LINEAR, TRANSPOSED, WEIGHT_MAJOR)


MODELS = {
    "qwen2-tied": lambda: tiny_qwen2(VOCAB, max_position_embeddings=256, tie_word_embeddings=True),
    "qwen2-untied": lambda: tiny_qwen2(VOCAB, max_position_embeddings=256, tie_word_embeddings=False),
    "llama-tied": lambda: tiny_llama(VOCAB, 1, 256, tie_word_embeddings=True),
    "llama-untied": lambda: tiny_llama(VOCAB, 1, 256, tie_word_embeddings=False),
}


def forced_plan(modules, form: str) -> LinearFormPlan:
    """`form` at every row count up to 64 for every shape of `modules` ('mixed': MIXED_FORMS by rows)."""
    keys = {shape_key(layer.weight) for layer in linear_layers(modules)}
    if form == "mixed":
        return LinearFormPlan(MIXED_BUCKETS, dict.fromkeys(keys, MIXED_FORMS))
    return LinearFormPlan.uniform(form, keys)


def ragged_requests(count: int, seed: int = 0) -> list[RolloutRequest]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=generator).tolist()
    return [
        RolloutRequest(index, tuple(torch.randint(1, VOCAB, (length,), generator=generator).tolist()))
        for index, length in enumerate(lengths)
    ]


def greedy_tokens(model, requests, max_new_tokens=12, linear_plan=None, speculative=None, eos=NEVER_EMITTED):
    engine = EmbeddedEngine(model, eos, 0, speculative=speculative, linear_plan=linear_plan)
    completions = engine.generate(requests, SamplingParams(max_new_tokens, temperature=0.0), torch.Generator())
    return [completion.response_ids for completion in completions]


def reference_greedy(model, request: RolloutRequest, max_new_tokens: int) -> list[int]:
    prompt = torch.tensor([request.prompt_ids])
    output = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return output[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", [TRANSPOSED, WEIGHT_MAJOR, "mixed"])
def test_every_form_computes_the_same_product(form, dtype):
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24, bias=False)).to(dtype)
    formed = FormedCopy(layers, forced_plan([layers], form))
    assert all(type(layer) is FormedLinear for layer in formed.module) and all(
        type(layer) is nn.Linear for layer in layers
    )
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for leading in [(1,), (3,), (1, 1), (2, 3), (1, 9), (4, 16), (2, 40)]:
        inputs = torch.randn(*leading, 24, dtype=dtype)
        with torch.no_grad():
            expected = [F.linear(inputs, layers[0].weight, layers[0].bias)]
            expected.append(F.linear(expected[0], layers[1].weight))
            first = formed.module[0](inputs)
            second = formed.module[1](first)
        assert first.shape == expected[0].shape and first.is_contiguous()
        torch.testing.assert_close(first, expected[0], **tolerance)
        torch.testing.assert_close(second, expected[1], **tolerance)


@pytest.mark.parametrize("form", [TRANSPOSED, WEIGHT_MAJOR, "mixed"])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_tokens_with_forms_equal_forms_off_and_transformers_generate(name, form):
    model = MODELS[name]()
    requests = ragged_requests(5)
    plan = forced_plan([model], form)
    assert set(plan.forms) and any(name != LINEAR for names in plan.forms.values() for name in names)
    with_forms = greedy_tokens(model, requests, linear_plan=plan)
    assert with_forms == greedy_tokens(model, requests)
    assert with_forms == [reference_greedy(model, request, 12) for request in requests]
    single = greedy_tokens(model, requests[:1], linear_plan=plan)
    assert single == [reference_greedy(model, requests[0], 12)]


@pytest.mark.parametrize("config", [SpeculativeConfig(4), SpeculativeConfig(4, 4, 16)], ids=["chain", "tree"])
def test_speculative_decoding_with_forms_is_token_identical_to_plain(config):
    target = tiny_qwen2(VOCAB, max_position_embeddings=256)
    drafter = EagleDrafter(target, seed=3)
    plan = forced_plan([target, drafter], "mixed")
    for batch_size in (1, 3, 8):
        requests = ragged_requests(batch_size, seed=batch_size)
        plain = greedy_tokens(target, requests, max_new_tokens=16)
        eos = max(set(plain[0][1:-1]), key=plain[0].count)  # a token some responses emit mid-way
        plain = greedy_tokens(target, requests, max_new_tokens=16, eos=eos)
        speculative = SpeculativeDecoder(drafter, config)
        assert greedy_tokens(target, requests, 16, plan, speculative, eos) == plain
        # the drafter drafted through its formed copy (fc included); the drafter itself kept its nn.Linear layers
        assert any(formed.layer is drafter.fc for formed in speculative.drafter_forms.layers)
        assert speculative.drafting is not drafter and type(drafter.fc) is nn.Linear


def test_an_optimizer_step_never_leaves_a_stale_copy():
    model = MODELS["qwen2-untied"]()
    requests = ragged_requests(4)
    plan = forced_plan([model], TRANSPOSED)
    engine = EmbeddedEngine(model, NEVER_EMITTED, 0, linear_plan=plan)
    before = greedy_tokens(model, requests, linear_plan=plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    inputs = torch.tensor([request.prompt_ids[:1] * 6 for request in requests])
    model(inputs, labels=inputs).loss.backward()
    optimizer.step()  # in place: bumps each weight's version, no refresh() called
    after = engine.generate(requests, SamplingParams(12, temperature=0.0), torch.Generator())
    assert [completion.response_ids for completion in after] == greedy_tokens(model, requests)
    assert [completion.response_ids for completion in after] != before
    # the target decodes through its owned forward, whose transposed copies follow the weights too
    for layer, weights in zip(model.model.layers, engine.decode_model.layers, strict=True):
        assert torch.equal(weights.o.transposed, layer.self_attn.o_proj.weight.detach().t())


def write_plan(cache_dir, modules, plan: LinearFormPlan) -> None:
    """Put `plan` in the cache as this machine's plan for `modules`."""
    key = plan_key(modules)
    path = record_path(cache_dir, CACHE_FOLDER, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "plan": plan.to_dict()}))


def test_after_update_refreshes_copies_written_behind_autograds_back(tmp_path):
    model = MODELS["llama-tied"]()
    drafter = EagleDrafter(model, seed=2)
    write_plan(tmp_path, [model, drafter], forced_plan([model, drafter], TRANSPOSED))
    speculative = speculative_plan(SpeculativeSection(rules=[{"batch": [1, None], "use": "s2-k1-t3"}]))
    plan = decode_plan_for(model, drafter, "float32", "auto", tmp_path, rows=1, speculates=True, costs=False)
    rollout = EmbeddedRollout(model, NEVER_EMITTED, 0, speculative, drafter=drafter, decode=plan)
    # the owned forward multiplies the policy by copies of its own; the drafter drafts through its formed copy
    drafter_forms = rollout.engine.speculative.drafter_forms
    assert {id(formed.layer) for formed in drafter_forms.layers} == set(map(id, linear_layers([drafter])))
    assert drafter_forms.extra_bytes == sum(layer.weight.numel() * 4 for layer in linear_layers([drafter]))
    assert rollout.copy_bytes == rollout.engine.decode_model.extra_bytes + drafter_forms.extra_bytes
    precision_line, forms_line = plan.log_lines
    [decode_path_line] = rollout.start()
    assert precision_line == "rollout dtype: float32 (given)"
    assert decode_path_line.startswith("decode path: owned llama-family")
    assert forms_line.startswith("linear forms: ") and "weight shapes use a faster form than linear" in forms_line
    requests = ragged_requests(3)
    before, _ = rollout.generate(requests, SamplingParams(10, temperature=0.0), seed=0)
    with torch.no_grad():
        for parameter in model.parameters():  # as DeepSpeed writes ZeRO partitions: no version bump
            parameter.data.copy_(torch.randn_like(parameter) * 0.1)
    rollout.after_update("step-1", drafter_version=None, probe_prompts=())
    after, _ = rollout.generate(requests, SamplingParams(10, temperature=0.0), seed=0)
    assert [completion.response_ids for completion in after] == greedy_tokens(model, requests, 10)
    assert [completion.response_ids for completion in after] != [completion.response_ids for completion in before]


def test_the_drafters_formed_copy_follows_a_drafter_written_behind_autograds_back():
    """Drafter averaging writes through .data: the formed copy's transposed weights are re-read every generate call."""
    target = tiny_qwen2(VOCAB, max_position_embeddings=256)
    drafter = EagleDrafter(target, seed=3)
    plan = forced_plan([target, drafter], TRANSPOSED)
    requests = ragged_requests(3, seed=1)
    formed = EmbeddedEngine(target, NEVER_EMITTED, 0, SpeculativeDecoder(drafter, SpeculativeConfig(4)), plan)
    plain = EmbeddedEngine(target, NEVER_EMITTED, 0, SpeculativeDecoder(drafter, SpeculativeConfig(4)))
    greedy, generator = SamplingParams(12, temperature=0.0), torch.Generator()
    formed.generate(requests, greedy, generator)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.data.copy_(torch.randn_like(parameter) * 0.3)
    stats = [
        [completion.speculative for completion in engine.generate(requests, greedy, generator)]
        for engine in (formed, plain)
    ]
    assert stats[0] == stats[1]  # the same drafts accepted: the formed copy drafted with the new weights
    for layer in formed.speculative.drafter_forms.layers:
        assert torch.equal(layer.transposed.buffer, layer.layer.weight.detach().t())


def test_the_policys_modules_are_never_changed_and_off_forms_nothing(tmp_path):
    model = tiny_gpt2(VOCAB, 10, 256)  # the transformers path: it decodes through a formed copy of the policy
    modules_before = list(model.named_modules())
    off_plan = decode_plan_for(model, None, "float32", "off", tmp_path, rows=1, speculates=False, costs=False)
    off = EmbeddedRollout(model, NEVER_EMITTED, 0, decode=off_plan)
    assert off_plan.linear_plan is None and off.engine.decode_model.formed is None
    assert [*off_plan.log_lines, *off.start()] == ["rollout dtype: float32 (given)", off.engine.decode_model.describe()]
    assert not (tmp_path / "linear_forms").exists()
    write_plan(tmp_path, [model], forced_plan([model], WEIGHT_MAJOR))
    plan = decode_plan_for(model, None, "float32", "auto", tmp_path, rows=1, speculates=False, costs=False)
    rollout = EmbeddedRollout(model, NEVER_EMITTED, 0, decode=plan)
    formed = rollout.engine.decode_model.formed
    assert [type(formed.module.get_output_embeddings())] == [FormedLinear]
    untouched_during = []

    def look(completion) -> None:
        untouched_during.append(
            list(model.named_modules()) == modules_before
            and all("forward" not in vars(module) for _, module in modules_before)
        )

    rollout.generate(ragged_requests(2), SamplingParams(4, temperature=0.0), seed=0, on_request_finished=look)
    assert untouched_during == [True, True]
    assert list(model.named_modules()) == modules_before
    assert rollout.engine.decode_model.extra_bytes == 0  # weight-major needs no copy
    with pytest.raises(ValueError, match="linear_forms"):
        decode_plan_for(model, None, "float32", "fast", tmp_path, rows=1, speculates=False, costs=False)


def test_a_recipe_names_a_bad_linear_forms_value():
    with pytest.raises(RecipeError, match="rollout.linear_forms must be one of auto, off, got 'fast'"):
        load_checked_recipe(RECIPES_DIRECTORY / "tiny-cpu.yaml", ["rollout.linear_forms=fast"])


def loss_and_gradients(model, inputs):
    model.zero_grad()
    loss = model(inputs, labels=inputs).loss
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters()]


def test_the_actors_backward_is_unaffected():
    model = tiny_gpt2(VOCAB, 10, 256)
    model.train()  # the actor trains; decoding must not put a module of it in eval mode or keep one formed
    untouched = copy.deepcopy(model)
    inputs = torch.randint(1, VOCAB, (2, 7))
    plan = forced_plan([model], "mixed")
    expected_loss, expected_gradients = loss_and_gradients(untouched.eval(), inputs)
    formed = FormedCopy(model, plan)
    model.eval()
    loss, gradients = loss_and_gradients(model, inputs)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(got, want) for got, want in zip(gradients, expected_gradients, strict=True))
    # with gradients enabled even the formed copy computes F.linear, so its backward is the policy's
    formed_loss, _ = loss_and_gradients(formed.module, inputs)
    assert torch.equal(formed_loss, expected_loss)
    model.train()
    greedy_tokens(model, ragged_requests(2), 4, plan)
    assert all(module.training for module in model.modules())
    loss, gradients = loss_and_gradients(model.eval(), inputs)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(got, want) for got, want in zip(gradients, expected_gradients, strict=True))


def test_measure_plan_covers_every_shape_with_known_forms():
    model = MODELS["qwen2-untied"]()
    drafter = EagleDrafter(model, seed=0)
    plan, milliseconds = measure_plan([model, drafter], row_buckets=(1, 2, 5), rounds=1)
    keys = {shape_key(layer.weight) for layer in linear_layers([model, drafter])}
    assert set(plan.forms) == keys == set(milliseconds) and plan.row_buckets == (1, 2, 5)
    for key in keys:
        assert len(plan.forms[key]) == 3 and set(plan.forms[key]) <= {LINEAR, TRANSPOSED, WEIGHT_MAJOR}
        assert all(0 < value < float("inf") for times in milliseconds[key].values() for value in times)
    assert plan.forms_by_rows(next(iter(keys)))[0] == LINEAR and len(plan.forms_by_rows(next(iter(keys)))) == 6


def test_the_cached_plan_is_reused_and_measured_again_when_the_key_changes(tmp_path, monkeypatch):
    model = MODELS["llama-untied"]()
    quick = {"row_buckets": (1, 3), "rounds": 1}
    plan, path = cached_plan([model], tmp_path, **quick)
    assert path.is_file() and json.loads(path.read_text())["key"] == plan_key([model], (1, 3))
    assert plan.row_buckets == (1, 3) and set(plan.forms) == {
        shape_key(layer.weight) for layer in linear_layers([model])
    }
    sentinel = LinearFormPlan((1, 3), {key: (WEIGHT_MAJOR, TRANSPOSED) for key in plan.forms})
    path.write_text(json.dumps({"key": plan_key([model], (1, 3)), "plan": sentinel.to_dict()}))
    assert cached_plan([model], tmp_path, **quick) == (sentinel, path)  # read back, not measured again
    with monkeypatch.context() as patch:  # this model on another machine: another key, another file
        patch.setattr(cache, "processor_name", lambda device: "Another CPU")
        other_path = cached_plan([model], tmp_path, **quick)[1]
    assert other_path != path and json.loads(other_path.read_text())["key"]["processor"] == "Another CPU"
    wider = tiny_qwen2(VOCAB, hidden_size=48)
    assert cached_plan([wider], tmp_path, **quick)[1] not in (path, other_path)
    stored = json.loads(path.read_text())
    stored["key"]["torch"] = "0.0"  # a file at this name written for another key is measured again
    path.write_text(json.dumps(stored))
    cached_plan([model], tmp_path, **quick)
    assert json.loads(path.read_text())["key"] == plan_key([model], (1, 3))
    assert "milliseconds" in json.loads(path.read_text())


def test_the_trl_rollout_refreshes_the_copies_before_every_rollout(tmp_path):
    pytest.importorskip("trl")
    from tlt_cli.integrations.trl import HiddenStateRollout, tlt_rollout

    model = MODELS["qwen2-untied"]()
    write_plan(tmp_path, [model], forced_plan([model], TRANSPOSED))
    plan = decode_plan_for(model, None, "float32", "auto", tmp_path, rows=3, speculates=False, costs=False)
    rollout = HiddenStateRollout(model, NEVER_EMITTED, 0, decode=plan)
    requests, greedy = ragged_requests(3), SamplingParams(8, temperature=0.0)
    rollout.generate_with_hidden(requests, greedy, seed=0, logprob_temperature=1.0)
    with torch.no_grad():
        for parameter in model.parameters():  # an update TRL makes between rollouts, unseen by autograd
            parameter.data.copy_(torch.randn_like(parameter) * 0.1)
    completions, _ = rollout.generate_with_hidden(requests, greedy, seed=0, logprob_temperature=1.0)
    assert [completion.response_ids for completion in completions] == greedy_tokens(model, requests, 8)
    with pytest.raises(UserError, match="^linear_forms must be one of auto, off, got 'fast'.$"):
        tlt_rollout(linear_forms="fast")


@pytest.mark.parametrize("form", [TRANSPOSED, WEIGHT_MAJOR, "mixed"])
def test_bfloat16_weights_generate_the_same_greedy_tokens_with_forms(form):
    model = MODELS["qwen2-untied"]().to(torch.bfloat16)
    requests = ragged_requests(5)
    plan = forced_plan([model], form)
    assert plan.forms and all(key.endswith("bfloat16") for key in plan.forms)
    assert greedy_tokens(model, requests, linear_plan=plan) == greedy_tokens(model, requests)
