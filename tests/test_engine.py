"""The embedded engine against transformers' own greedy generation, on tiny seeded models."""

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from tlt_cli.engine.kv_cache import SlotCache
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest

torch.set_num_threads(1)

VOCAB = 64
NEVER_EMITTED = VOCAB  # an EOS id outside the vocabulary: requests run to max_new_tokens


def tiny_target_qwen2() -> Qwen2ForCausalLM:
    return tiny_qwen2(vocab_size=VOCAB, max_position_embeddings=256)


def tiny_llama_untied() -> LlamaForCausalLM:
    model = tiny_llama(VOCAB, 1, 256, num_key_value_heads=4, tie_word_embeddings=False)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


def ragged_requests(count: int, seed: int = 0) -> list[RolloutRequest]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 12, (count,), generator=generator).tolist()
    return [
        RolloutRequest(
            request_id=100 + index, prompt_ids=tuple(torch.randint(1, VOCAB, (length,), generator=generator).tolist())
        )
        for index, length in enumerate(lengths)
    ]


def reference_greedy(model, request: RolloutRequest, max_new_tokens: int, eos_token_id: int) -> list[int]:
    prompt = torch.tensor([request.prompt_ids])
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )[0, prompt.shape[1] :].tolist()
    return output[: output.index(eos_token_id) + 1] if eos_token_id in output else output


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)


@pytest.mark.parametrize("build", [tiny_target_qwen2, tiny_llama_untied])
def test_greedy_matches_transformers_generate_on_ragged_prompts(build):
    model = build()
    requests = ragged_requests(6)
    no_eos = EmbeddedEngine(model, eos_token_id=NEVER_EMITTED, pad_token_id=0)
    completions = no_eos.generate(requests, greedy(10), torch.Generator().manual_seed(0))
    # an EOS that some (not all) responses emit, at different steps
    eos_token_id = completions[0].response_ids[4]
    engine = EmbeddedEngine(model, eos_token_id=eos_token_id, pad_token_id=0)
    completions = engine.generate(requests, greedy(10), torch.Generator().manual_seed(0))
    assert [completion.request_id for completion in completions] == [request.request_id for request in requests]
    for request, completion in zip(requests, completions):
        assert completion.response_ids == reference_greedy(model, request, 10, eos_token_id)
        assert completion.finished_by_eos == (completion.response_ids[-1] == eos_token_id)
    assert any(completion.finished_by_eos for completion in completions)
    assert any(not completion.finished_by_eos for completion in completions)


def test_finished_rows_leave_the_batch():
    model = tiny_target_qwen2()
    requests = ragged_requests(8, seed=3)
    free_run = EmbeddedEngine(model, NEVER_EMITTED, 0).generate(requests, greedy(12), torch.Generator())
    eos_token_id = free_run[0].response_ids[2]
    rows_per_call: list[int] = []
    engine = EmbeddedEngine(model, eos_token_id, 0)
    forward_block = engine.decode_model.forward_block

    def counting_forward_block(cache, input_ids, *args):
        rows_per_call.append(input_ids.shape[0])
        return forward_block(cache, input_ids, *args)

    engine.decode_model.forward_block = counting_forward_block
    completions = engine.generate(requests, greedy(12), torch.Generator())
    decode_calls = rows_per_call[1:]
    assert rows_per_call[0] == len(requests)
    assert decode_calls == sorted(decode_calls, reverse=True)
    assert decode_calls[-1] < len(requests)
    # each row is fed once per response token after the first: no compute on finished rows
    assert sum(decode_calls) == sum(len(completion.response_ids) - 1 for completion in completions)


def test_max_new_tokens_and_eos_end_requests():
    model = tiny_target_qwen2()
    requests = ragged_requests(5, seed=4)
    free_run = EmbeddedEngine(model, NEVER_EMITTED, 0).generate(requests, greedy(7), torch.Generator())
    assert all(len(completion.response_ids) == 7 and not completion.finished_by_eos for completion in free_run)
    eos_token_id = free_run[1].response_ids[3]
    stopped = EmbeddedEngine(model, eos_token_id, 0).generate(requests, greedy(7), torch.Generator())
    for free, stop in zip(free_run, stopped):
        if eos_token_id in free.response_ids:
            assert stop.response_ids == free.response_ids[: free.response_ids.index(eos_token_id) + 1]
            assert stop.finished_by_eos
        else:
            assert stop.response_ids == free.response_ids
    one_token = EmbeddedEngine(model, NEVER_EMITTED, 0).generate(requests, greedy(1), torch.Generator())
    assert [completion.response_ids for completion in one_token] == [
        completion.response_ids[:1] for completion in free_run
    ]


def test_sampling_is_reproducible_with_a_seeded_generator():
    model = tiny_target_qwen2()
    requests = ragged_requests(4, seed=5)
    engine = EmbeddedEngine(model, NEVER_EMITTED, 0)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9)
    first = engine.generate(requests, params, torch.Generator().manual_seed(7))
    second = engine.generate(requests, params, torch.Generator().manual_seed(7))
    other = engine.generate(requests, params, torch.Generator().manual_seed(8))
    assert [c.response_ids for c in first] == [c.response_ids for c in second]
    assert [c.response_ids for c in first] != [c.response_ids for c in other]


def test_target_hidden_is_what_produced_each_token_and_modes_are_restored():
    model = tiny_llama_untied()
    model.train()
    model.model.layers[0].eval()
    completions = EmbeddedEngine(model, NEVER_EMITTED, 0).generate(
        ragged_requests(3, seed=6), greedy(6), torch.Generator(), return_hidden=True
    )
    for completion in completions:
        assert completion.target_hidden.shape == (6, 32)
        assert model.lm_head(completion.target_hidden).argmax(dim=-1).tolist() == completion.response_ids
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training


def test_finished_callback_and_wall_clock():
    model = tiny_target_qwen2()
    requests = ragged_requests(4, seed=7)
    seen = []
    completions = EmbeddedEngine(model, NEVER_EMITTED, 0).generate(requests, greedy(3), torch.Generator(), seen.append)
    assert sorted(c.request_id for c in seen) == sorted(c.request_id for c in completions)
    assert all(completion.start <= completion.end for completion in completions)


def test_user_errors_name_what_to_fix():
    engine = EmbeddedEngine(tiny_target_qwen2(), NEVER_EMITTED, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(ragged_requests(1), SamplingParams(max_new_tokens=0), torch.Generator())
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([RolloutRequest(1, ())], greedy(2), torch.Generator())


@pytest.mark.parametrize(
    "call_style",
    [
        pytest.param(lambda cache, key, value: cache.update(key, value, 0), id="5.23: update(k, v, layer_idx)"),
        pytest.param(lambda cache, key, value: cache.update(key, value, 0, {}), id="5.23: with cache_kwargs"),
        pytest.param(lambda cache, key, value: cache.update(key, value, 0, kwargs={}), id="5.24: kwargs=..."),
    ],
)
def test_slot_cache_takes_every_update_call_transformers_makes(call_style):
    """transformers 5.24's attention layers call `cache.update(k, v, layer_idx, kwargs=kwargs)`; the
    cache the engine hands them stores the entries at the prepared slots however it is called."""
    cache = SlotCache(batch_size=2, capacity=8)
    cache.prepare(torch.tensor([[3], [5]]), kv_length=6)
    key, value = torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    keys, values = call_style(cache, key, value)
    assert keys.shape == (2, 1, 6, 4)
    assert torch.equal(keys[0, :, 3], key[0, :, 0]) and torch.equal(values[1, :, 5], value[1, :, 0])
