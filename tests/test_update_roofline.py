"""The update's roofline (tlt_cli/bench/update_roofline.py) and its profile's phases
(tlt_cli/bench/update_profile.py): the operation counts against torch's own flop counter on the tiny
model, each product form timed as the update lays it out, the report's arithmetic on made-up seconds, and
each operator's self time put in one category and one phase."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tlt_cli.bench import update_profile, update_roofline
from tlt_cli.bench.update_roofline import MicroBatchShape, Product
from tlt_cli.models.tiny import build_tiny_model
from tlt_cli.training.memory import ModelShape


def tiny_shape(model) -> ModelShape:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return ModelShape(
        parameters=sum(parameter.numel() for parameter in model.parameters()),
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        attention_heads=config.num_attention_heads,
        query_width=config.num_attention_heads * head_dim,
        key_value_width=config.num_key_value_heads * head_dim,
        vocab_size=config.vocab_size,
    )


def phase_total(products: Counter[Product]) -> int:
    return sum(product.operations * times for product, times in products.items())


def test_the_decoders_counted_operations_equal_torchs_flop_counter_on_the_tiny_model():
    model = build_tiny_model(seed=0)
    # eager attention: its products are aten::matmul, which the flop counter counts (not SDPA's CPU kernel)
    model.set_attn_implementation("eager")
    shape = tiny_shape(model)
    part = MicroBatchShape(rows=2, tokens=24, head_tokens=30)
    input_ids = torch.randint(3, shape.vocab_size, (part.rows, part.tokens))
    decoder = model.get_decoder()
    with FlopCounterMode(display=False) as forward_counter:
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    with FlopCounterMode(display=False) as backward_counter:
        hidden.sum().backward()
    assert phase_total(update_roofline.decoder_forward(shape, part)) == forward_counter.get_total_flops()
    assert phase_total(update_roofline.decoder_backward(shape, part)) == backward_counter.get_total_flops()


def test_update_operations_counts_recomputation_only_with_it_and_the_head_over_its_tokens_in_chunks():
    shape = tiny_shape(build_tiny_model(seed=0))
    parts = [MicroBatchShape(4, 50, 120), MicroBatchShape(3, 70, 100)]
    plain = update_roofline.update_operations(shape, parts, recomputation=False, chunk_tokens=64)
    recomputed = update_roofline.update_operations(shape, parts, recomputation=True, chunk_tokens=64, ppo_epochs=2)
    assert plain.phase_operations("recomputation") == 0
    assert recomputed.phase_operations("recomputation") == recomputed.phase_operations("forward")
    assert recomputed.phase_operations("forward") == 2 * plain.phase_operations("forward")
    # the head: logits twice (forward, backward's recomputation), the gradients of its input and weight: 8 H V a token
    assert plain.phase_operations("log-prob head") == 8 * shape.hidden * shape.vocab_size * (120 + 100)
    assert Product("x @ W.T", 56, shape.hidden, shape.vocab_size) in plain.products["log-prob head"]  # 120 = 64 + 56
    assert plain.phase_operations("optimizer") == update_roofline.OPTIMIZER_OPERATIONS_PER_PARAMETER * shape.parameters
    assert plain.phase_operations("all-reduce") == 0 and plain.all_reduce_bytes == 0
    two_ranks = update_roofline.update_operations(shape, parts, recomputation=False, world_size=2)
    assert two_ranks.phase_operations("all-reduce") == shape.parameters // 2
    assert two_ranks.all_reduce_bytes == 4 * shape.parameters
    zero_two = update_roofline.update_operations(
        shape, parts, False, world_size=2, reductions_per_epoch=update_roofline.gradient_reductions(2, len(parts))
    )
    assert zero_two.all_reduce_bytes == 2 * 4 * shape.parameters  # each of the 2 micro-batches' gradients
    assert update_roofline.gradient_reductions(1, len(parts)) == 1


@pytest.mark.parametrize("form", update_roofline.FORMS)
def test_each_product_form_runs_the_product_it_counts(form):
    product = Product(form, rows=5, inner=7, columns=3, batch=2 if form in ("Q @ K.T", "P @ V") else 1)
    result = update_roofline.product_call(product, torch.float32)()
    expected = (product.batch, 5, 3) if product.batch > 1 else (5, 3)
    assert tuple(result.shape) == expected
    seconds = update_roofline.measure_product_rates([product], ["fp32", "bf16"], repeats=1)
    assert seconds["fp32"][product] > 0 and seconds["bf16"][product] > 0


def test_the_roofline_bounds_each_phase_by_its_products_seconds_and_the_head_by_float32s():
    shape = tiny_shape(build_tiny_model(seed=0))
    operations = update_roofline.update_operations(shape, [MicroBatchShape(1, 16, 15)], recomputation=True)
    products = operations.distinct_products()
    rates = {"fp32": dict.fromkeys(products, 1e-3), "bf16": dict.fromkeys(products, 4e-3)}
    phase_seconds = {phase: 1.0 for phase in update_roofline.PHASES}
    report = update_roofline.roofline(operations, rates, phase_seconds, update_seconds=10.0, compute_dtype="bf16")
    by_name = {phase.phase: phase for phase in report.phases}
    forward = by_name["forward"]
    calls = sum(operations.products["forward"].values())
    assert forward.bound_seconds == {"fp32": pytest.approx(calls * 1e-3), "bf16": pytest.approx(calls * 4e-3)}
    assert forward.fraction("bf16") == pytest.approx(calls * 4e-3 / 1.0)
    head = by_name["log-prob head"]
    assert head.bound_seconds["bf16"] == head.bound_seconds["fp32"]  # the head runs in float32 either way
    assert by_name["optimizer"].bound_seconds == {} and by_name["optimizer"].fraction("bf16") is None
    assert report.fraction() == pytest.approx(report.bound_seconds("bf16") / 10.0)
    assert report.as_dict()["operations"] == sum(operations.phase_operations(phase) for phase in update_roofline.PHASES)


def test_profile_puts_each_operators_self_time_in_one_category_and_one_phase():
    category, phase = update_profile.category, update_profile.phase
    head_backward = {"autograd::engine::evaluate_function: ChunkedHeadLogprobsBackward", "ChunkedHeadLogprobsBackward"}
    assert category("aten::mm", head_backward) == "log-prob head: products over the vocabulary"
    assert category("aten::logsumexp", {"ChunkedHeadLogprobs"}) == "log-prob head: log-softmax over the vocabulary"
    assert category("aten::addmm", {"aten::linear"}) == "matrix products"
    assert category("aten::_to_copy", {"aten::to", "aten::linear"}) == "dtype casts and copies"
    assert category("aten::addcdiv_", {"Optimizer.step#AdamW.step", update_profile.STEP_LABEL}) == (
        "optimizer step (AdamW)"
    )
    assert category("aten::norm", {update_profile.STEP_LABEL}) == (
        "DeepSpeed step (gradient norm, clipping, ZeRO copies)"
    )
    assert category("autograd::engine::evaluate_function: MmBackward0", set()) == "Python and dispatch"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu", set()) == "attention"
    assert category("gloo:all_reduce", {update_profile.BACKWARD_LABEL}) == "all-reduce"
    recomputed = {update_profile.BACKWARD_LABEL, update_profile.LAYER_LABEL, "aten::mm"}
    assert phase(recomputed) == "recomputation"
    assert phase({update_profile.BACKWARD_LABEL, "aten::mm"}) == "backward"
    assert phase({update_profile.LAYER_LABEL, "aten::mm"}) == "forward"
    assert phase({update_profile.STEP_LABEL, "aten::add_"}) == "optimizer"
    assert phase(head_backward | {update_profile.BACKWARD_LABEL, "aten::mm"}) == "log-prob head"
    assert phase({"ChunkedHeadLogprobs", "aten::mm"}) == "log-prob head"
    assert phase({update_profile.BACKWARD_LABEL, "gloo:all_reduce"}) == "all-reduce"
    assert set(update_profile.CATEGORIES) >= {"all-reduce", "other operators (norms, activations, elementwise)"}


def test_a_profiles_phases_in_cpu_seconds_are_their_wall_clock_shares_of_the_updates_cpu_time():
    profile = update_profile.UpdateProfile(
        seconds=10.0,
        cpu_seconds=2.0,
        metrics=None,
        categories_seconds={},
        phases_seconds={"forward": 4.0, "backward": 6.0},
        outside_operators_seconds=0.0,
        costliest_operators_seconds={},
    )
    assert profile.phases_cpu_seconds() == {"forward": pytest.approx(0.8), "backward": pytest.approx(1.2)}


def test_a_decoder_layers_recomputation_in_backward_is_its_own_phase():
    from torch.profiler import ProfilerActivity, profile, record_function

    from tlt_cli.training.actor import enable_recomputation

    model = build_tiny_model(seed=0)
    enable_recomputation(model)
    model.train()
    update_profile.label_decoder_layers(model)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 16))
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        hidden = model.get_decoder()(input_ids=input_ids, use_cache=False).last_hidden_state
        with record_function(update_profile.BACKWARD_LABEL):
            hidden.sum().backward()
    phases = update_profile.categorise(profiler.events(), wall_seconds=0.0)["phases_seconds"]
    assert phases["recomputation"] > 0 and phases["forward"] > 0 and phases["backward"] > 0
