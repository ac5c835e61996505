"""The engine's decode models (tlt_cli/engine/) against transformers' own greedy `generate`, on tiny seeded
models of every family: the owned Llama-family forward, and the transformers path for what it refuses."""

import pytest
import torch
from test_engine import NEVER_EMITTED, greedy, ragged_requests, reference_greedy
from tiny_models import tiny_gpt2, tiny_llama, tiny_mistral, tiny_phi, tiny_qwen2, tiny_qwen3

from tlt_cli.drafter.model import EagleDrafter, causal_attention_mask
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.layers import DecoderLayer, rotary_tables
from tlt_cli.engine.linear_forms import (
    LINEAR,
    TRANSPOSED,
    WEIGHT_MAJOR,
    FormedLinear,
    LinearFormPlan,
    linear_layers,
    shape_key,
)
from tlt_cli.engine.llama_family import PATH_NAME as OWNED
from tlt_cli.engine.llama_family import LlamaFamilyModel, refusal
from tlt_cli.engine.transformers_path import PATH_NAME as TRANSFORMERS
from tlt_cli.rollout.embedded import EmbeddedRollout
from tlt_cli.rollout.generate_loop import EmbeddedEngine

torch.set_num_threads(1)

VOCAB = 64
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

OWNED_FAMILIES = {
    "llama tied": lambda: tiny_llama(VOCAB, 1, 256),
    "llama untied, multi-head": lambda: tiny_llama(VOCAB, 2, 256, num_key_value_heads=4, tie_word_embeddings=False),
    "llama 3 rope scaling": lambda: tiny_llama(VOCAB, 3, 256, rope_parameters=LLAMA3_ROPE),
    "llama linear rope": lambda: tiny_llama(
        VOCAB, 4, 256, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "qwen2 (q/k/v bias)": lambda: tiny_qwen2(VOCAB, 5, 256),
    "qwen3 (q/k norm, head_dim 16)": lambda: tiny_qwen3(VOCAB, 6, 256),
    "mistral, one kv head": lambda: tiny_mistral(VOCAB, 7, 256, num_key_value_heads=1),
    "odd vocabulary 61": lambda: tiny_llama(61, 8, 256, tie_word_embeddings=False),
    "odd vocabulary 97, qwen2": lambda: tiny_qwen2(97, 9, 256),
}

REFUSED = {
    "gpt-2": lambda: tiny_gpt2(VOCAB, 10, 256),
    "phi": lambda: tiny_phi(VOCAB, 14, 256),
    "llama, dynamic rope": lambda: tiny_llama(
        VOCAB, 11, 256, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "mistral, sliding window in use": lambda: tiny_mistral(VOCAB, 12, 256, sliding_window=8),
}


def assert_engine_matches_generate(model, batch_size: int, path: str, max_new_tokens: int = 12, **engine_options):
    engine = EmbeddedEngine(model, eos_token_id=NEVER_EMITTED, pad_token_id=0, **engine_options)
    assert engine.decode_model.path == path
    vocab_size = model.config.vocab_size
    requests = [
        request
        for request in ragged_requests(batch_size, seed=batch_size)
        if max(request.prompt_ids) < vocab_size  # every family's vocabulary holds the ids
    ]
    completions = engine.generate(requests, greedy(max_new_tokens), torch.Generator().manual_seed(0))
    for request, completion in zip(requests, completions):
        assert completion.response_ids == reference_greedy(model, request, max_new_tokens, NEVER_EMITTED)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("family", list(OWNED_FAMILIES))
def test_owned_greedy_matches_generate(family, batch_size):
    model = OWNED_FAMILIES[family]()
    assert refusal(model) is None
    assert_engine_matches_generate(model, batch_size, OWNED)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("family", list(REFUSED))
def test_refused_families_take_the_transformers_path_and_match_generate(family, batch_size):
    model = REFUSED[family]()
    assert refusal(model) is not None
    with pytest.raises(ValueError, match="does not reproduce"):
        LlamaFamilyModel(model)
    assert_engine_matches_generate(model, batch_size, TRANSFORMERS)


def test_no_transformers_module_runs_during_an_owned_decode():
    model = tiny_qwen3(VOCAB, 0, 256)
    engine = EmbeddedEngine(model, eos_token_id=NEVER_EMITTED, pad_token_id=0)

    def refuse(module, args):
        raise AssertionError(f"{type(module).__name__}.forward ran during an owned decode")

    hooks = [module.register_forward_pre_hook(refuse) for module in model.modules()]
    try:
        completions = engine.generate(ragged_requests(3, seed=1), greedy(5), torch.Generator())
    finally:
        for hook in hooks:
            hook.remove()
    assert all(len(completion.response_ids) == 5 for completion in completions)


def test_refresh_reads_weights_changed_in_place():
    """DeepSpeed writes updated weights through .data: no version counter tells, refresh() must."""
    model = tiny_qwen2(VOCAB, 0, 256)
    engine = EmbeddedEngine(model, eos_token_id=NEVER_EMITTED, pad_token_id=0)
    requests = ragged_requests(4, seed=2)
    before = engine.generate(requests, greedy(10), torch.Generator())
    updated = tiny_qwen2(VOCAB, 1, 256)
    for parameter, new in zip(model.parameters(), updated.parameters(), strict=True):
        parameter.data.copy_(new.data)
    engine.decode_model.refresh()
    after = engine.generate(requests, greedy(10), torch.Generator())
    assert [completion.response_ids for completion in after] != [completion.response_ids for completion in before]
    for request, completion in zip(requests, after):
        assert completion.response_ids == reference_greedy(updated, request, 10, NEVER_EMITTED)


def test_released_copies_are_rebuilt_exactly_after_an_update():
    """The embedded rollout frees the decode model's copies after generating (the update's room) and rebuilds
    them at after_update; a generate without an after_update rebuilds them itself."""
    model = tiny_llama(VOCAB, 13, 256, tie_word_embeddings=False)
    rollout = EmbeddedRollout(model, NEVER_EMITTED, 0)
    decode_model, requests = rollout.engine.decode_model, ragged_requests(4, seed=3)
    copies = decode_model.extra_bytes
    assert copies > 0  # fused q/k/v and gate/up
    rollout.generate(requests, greedy(10), seed=0)
    assert decode_model.extra_bytes == 0
    updated = tiny_llama(VOCAB, 14, 256, tie_word_embeddings=False)
    for parameter, new in zip(model.parameters(), updated.parameters(), strict=True):
        parameter.data.copy_(new.data)  # as DeepSpeed writes: no version counter moves
    rollout.after_update("step-1", drafter_version=None, probe_prompts=())
    assert decode_model.extra_bytes == copies
    for completions in (
        rollout.generate(requests, greedy(10), seed=0)[0],
        rollout.generate(requests, greedy(10), 0)[0],
    ):
        for request, completion in zip(requests, completions):
            assert completion.response_ids == reference_greedy(updated, request, 10, NEVER_EMITTED)


@pytest.mark.parametrize("batch_size", [1, 4])
def test_every_product_form_of_a_plan_matches_generate(batch_size):
    """A plan mixing the three forms across row counts (fused q/k/v and gate/up included) stays exact."""
    model = tiny_llama(VOCAB, 13, 256, tie_word_embeddings=False)
    keys = {shape_key(layer.weight) for layer in linear_layers([model])}
    plan = LinearFormPlan((1, 2, 4, 8), {key: (TRANSPOSED, WEIGHT_MAJOR, TRANSPOSED, LINEAR) for key in keys})
    decode_model = decode_model_for(model, linear_plan=plan)
    assert decode_model.extra_bytes > 0
    assert "1 transposed, 2 weight_major, 3-4 transposed" in decode_model.describe()
    assert_engine_matches_generate(model, batch_size, OWNED, decode_model=decode_model)


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("family", list(REFUSED))
def test_the_transformers_path_with_every_product_form_matches_generate(family, batch_size):
    """The transformers path decodes through a formed copy of the policy: every nn.Linear (the head included)
    replaced in that copy only, by forms mixed across row counts; tokens stay those of `generate`."""
    model = REFUSED[family]()
    keys = {shape_key(layer.weight) for layer in linear_layers([model])}
    plan = LinearFormPlan((1, 2, 4, 8), {key: (TRANSPOSED, WEIGHT_MAJOR, TRANSPOSED, LINEAR) for key in keys})
    decode_model = decode_model_for(model, linear_plan=plan)
    assert decode_model.path == TRANSFORMERS and len(decode_model.formed.layers) == len(linear_layers([model]))
    assert decode_model.extra_bytes > 0 and f"({decode_model.extra_bytes} bytes)" in decode_model.describe()
    rows_seen = set()

    def count_rows(module, inputs, output) -> None:
        rows_seen.add(inputs[0].numel() // inputs[0].shape[-1])

    for formed in decode_model.formed.layers:
        formed.register_forward_hook(count_rows)
    assert_engine_matches_generate(model, batch_size, TRANSFORMERS, decode_model=decode_model)
    assert batch_size in rows_seen  # the decode steps ran through the formed layers (1 row: transposed, 4: too)
    assert not any(isinstance(module, FormedLinear) for module in model.modules())


def test_describe_names_the_path():
    assert decode_model_for(tiny_qwen2(VOCAB)).describe().startswith(f"decode path: {OWNED} (float32")
    transformers_line = decode_model_for(tiny_gpt2(VOCAB)).describe()
    assert transformers_line.startswith(f"decode path: {TRANSFORMERS} (model type 'gpt2'")


@pytest.mark.parametrize(
    "build", [OWNED_FAMILIES["qwen2 (q/k/v bias)"], OWNED_FAMILIES["qwen3 (q/k norm, head_dim 16)"]]
)
def test_drafter_layer_is_the_owned_layer_code_and_equals_transformers_layer(build):
    """The drafter's layer (tlt's DecoderLayer, trained with autograd) computes what the target's transformers
    layer computes with the same weights, and its gradient reaches every parameter."""
    target = build()
    drafter = EagleDrafter(target, seed=0)
    assert isinstance(drafter.decoder_layer, DecoderLayer)
    reference = type(target.get_decoder().layers[0])(drafter.config, layer_idx=0)
    reference.input_layernorm = torch.nn.Identity()
    reference.load_state_dict(drafter.decoder_layer.state_dict(), strict=True)
    features = torch.randn(2, 5, target.config.hidden_size)
    positions = torch.arange(3, 8).expand(2, 5)
    mask = causal_attention_mask(2, 5, 0, features.device)
    rotary = drafter.rotary_emb
    expected = reference(
        features, attention_mask=mask, position_ids=positions, position_embeddings=rotary(features, positions)
    )
    tables = rotary_tables(rotary.inv_freq, rotary.attention_scaling, positions, features.dtype)
    observed = drafter.decoder_layer(features, tables, mask)
    torch.testing.assert_close(observed, expected)
    observed.square().sum().backward()
    assert all(
        parameter.grad is not None and parameter.grad.abs().sum() > 0
        for parameter in drafter.decoder_layer.parameters()
    )
