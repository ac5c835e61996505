"""The update's packed micro-batches (tlt_cli/training/packed_forward.py): each group's prompt once, no padding,
and the same hidden states, log-probs and gradients as the right-padded rows."""

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_llama, tiny_mistral, tiny_qwen2, tiny_qwen3
from transformers import Qwen2Config

from tlt_cli.bench import update_roofline
from tlt_cli.config import ActorConfig
from tlt_cli.rollout.types import Completion
from tlt_cli.training import packed_forward
from tlt_cli.training.actor import Actor, packs
from tlt_cli.training.grpo import policy_loss
from tlt_cli.training.logprobs import token_logprobs
from tlt_cli.training.packed_forward import (
    attention_segments,
    micro_batch_count,
    packed_hidden,
    packed_layout,
    packed_length,
    packed_micro_batches,
    packing_supported,
    packs_micro_batches,
)
from tlt_cli.training.policy_batch import build_policy_batch

VOCAB = 32
GROUP = 4


def grouped_completions(groups=3, seed=0):
    """`groups` prompts of different lengths, GROUP responses each of different lengths, in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    completions = []
    for group in range(groups):
        prompt = tuple(torch.randint(3, VOCAB, (4 + 2 * group,), generator=generator).tolist())
        for response in range(GROUP):
            length = 1 + (3 * response + group) % 6
            completions.append(
                Completion(
                    request_id=group * GROUP + response,
                    prompt_ids=prompt,
                    response_ids=torch.randint(3, VOCAB, (length,), generator=generator).tolist(),
                    finished_by_eos=True,
                    start=0.0,
                    end=1.0,
                )
            )
    order = torch.randperm(len(completions), generator=generator).tolist()
    return [completions[index] for index in order]


def grouped_batch(groups=3):
    completions = grouped_completions(groups)
    advantages = torch.linspace(-1.0, 1.0, len(completions))
    return build_policy_batch(completions, advantages, pad_token_id=0, group_size=GROUP)


def padded_hidden(decoder, batch):
    return decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).last_hidden_state


def test_a_grouped_batch_keeps_each_groups_rows_together_fewest_tokens_first():
    batch = grouped_batch()
    assert batch.group_spans() == [(0, 4), (4, 8), (8, 12)]
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    # each group's rows carry the same prompt and their own advantages, in request order
    for start, stop in batch.group_spans():
        prompt_length = int(batch.attention_mask[start].sum() - batch.response_mask[start].sum())
        assert all(
            torch.equal(batch.input_ids[row, :prompt_length], batch.input_ids[start, :prompt_length])
            for row in range(start, stop)
        )
    tokens = [packed_length(batch.slice(start, stop), share_prompt=True) for start, stop in batch.group_spans()]
    assert tokens == sorted(tokens)


def test_the_packed_layout_counts_a_groups_prompt_once_and_each_response_sees_only_its_prompt_and_itself():
    batch = grouped_batch(groups=1)
    prompt_length = int(batch.attention_mask[0].sum() - batch.response_mask[0].sum())
    layout = packed_layout(batch, share_prompt=True)
    assert layout.length == prompt_length + batch.response_token_count
    assert packed_length(batch, share_prompt=False) == int(batch.attention_mask.sum())
    mask = layout.attention_mask[0, 0]
    first_response = slice(prompt_length, prompt_length + int(batch.response_mask[0].sum()))
    second_response_start = first_response.stop
    # the second response's first token sees the whole prompt and itself, not the first response
    seen = mask[second_response_start].nonzero().flatten().tolist()
    assert seen == [*range(prompt_length), second_response_start]
    # its rotary position is the one it has in its own row: right after the prompt
    assert int(layout.position_ids[0, second_response_start]) == prompt_length


@pytest.mark.parametrize("make_model", [tiny_qwen2, tiny_llama])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("share_prompt", [True, False])
def test_packed_hidden_states_equal_the_padded_rows(make_model, attention, share_prompt):
    model = make_model(vocab_size=VOCAB).float()
    model.config._attn_implementation = attention
    batch = grouped_batch()
    real = batch.attention_mask.bool()
    with torch.no_grad():
        expected = padded_hidden(model.get_decoder(), batch)
        packed = packed_hidden(model.get_decoder(), batch, share_prompt)
    assert packed.shape == expected.shape
    assert torch.allclose(packed[real], expected[real], atol=1e-5)


def test_a_response_that_saw_a_sibling_would_fail_the_comparison():
    """The probe: a layout whose responses attend to each other changes the hidden states beyond tolerance."""
    model = tiny_qwen2(vocab_size=VOCAB).float()
    batch = grouped_batch(groups=1)
    layout = packed_layout(batch, share_prompt=True)
    causal = torch.ones(layout.length, layout.length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        leaky = model.get_decoder()(
            input_ids=layout.input_ids, attention_mask=causal, position_ids=layout.position_ids, use_cache=False
        ).last_hidden_state[0, layout.gather_index]
        expected = padded_hidden(model.get_decoder(), batch)
    response = batch.response_mask.bool()
    assert not torch.allclose(leaky[response], expected[response], atol=1e-5)


def group_loss_gradients(model, batch, share_prompt):
    """Each parameter's gradient of the GRPO loss over the batch: padded rows (share_prompt None) or packed."""
    model.zero_grad(set_to_none=True)
    decoder = model.get_decoder()
    hidden = padded_hidden(decoder, batch) if share_prompt is None else packed_hidden(decoder, batch, share_prompt)
    logprobs = token_logprobs(hidden, model.get_output_embeddings(), batch.input_ids, needed=batch.response_mask)
    old = logprobs.detach() - 0.1 * batch.response_mask  # ratios away from 1, so the clip shapes the gradient
    loss = policy_loss(
        logprobs,
        old,
        batch.advantages,
        batch.response_mask,
        clip_ratio=0.2,
        total_response_tokens=batch.response_token_count,
    )
    loss.loss.backward()
    return {name: parameter.grad.clone() for name, parameter in model.named_parameters() if parameter.grad is not None}


@pytest.mark.parametrize("make_model", [tiny_qwen2, tiny_llama])
def test_sharing_the_prompt_gives_every_parameter_the_padded_updates_gradient(make_model):
    model = make_model(vocab_size=VOCAB).float()
    batch = grouped_batch()
    padded = group_loss_gradients(model, batch, share_prompt=None)
    shared = group_loss_gradients(model, batch, share_prompt=True)
    assert shared.keys() == padded.keys()
    for name, gradient in padded.items():
        scale = float(gradient.abs().max()) or 1.0
        assert torch.allclose(shared[name], gradient, atol=1e-5 * scale, rtol=1e-4), name


def test_packed_micro_batches_take_whole_groups_within_the_budget_or_an_exact_count():
    batch = grouped_batch()
    tokens = [packed_length(batch.slice(start, stop), share_prompt=True) for start, stop in batch.group_spans()]
    parts = packed_micro_batches(batch, tokens[0] + tokens[1], share_prompt=True)
    assert [part.group_ids.unique().tolist() for part in parts] == [[0, 1], [2]]
    assert micro_batch_count(batch, tokens[0] + tokens[1], share_prompt=True) == 2
    assert len(packed_micro_batches(batch, 1, share_prompt=True)) == 3  # a group above the budget goes alone
    exact = packed_micro_batches(batch, 10**6, share_prompt=True, count=3)
    assert [part.size for part in exact] == [4, 4, 4]
    with pytest.raises(ValueError, match="cannot split 3 groups into 4"):
        packed_micro_batches(batch, 10**6, share_prompt=True, count=4)


def test_rows_of_one_group_id_with_different_prompts_are_not_shared():
    completions = grouped_completions(groups=1)
    changed = completions[0]
    completions[0] = Completion(
        request_id=changed.request_id,
        prompt_ids=(1, *changed.prompt_ids[1:]),
        response_ids=changed.response_ids,
        finished_by_eos=True,
        start=0.0,
        end=1.0,
    )
    batch = build_policy_batch(completions, torch.zeros(GROUP), pad_token_id=0, group_size=GROUP)
    model = tiny_qwen2(vocab_size=VOCAB).float()
    real = batch.attention_mask.bool()
    with torch.no_grad():
        packed = packed_hidden(model.get_decoder(), batch, share_prompt=True)
        expected = padded_hidden(model.get_decoder(), batch)
    assert torch.allclose(packed[real], expected[real], atol=1e-5)
    prompt_length = len(changed.prompt_ids)
    assert packed_length(batch, share_prompt=True) == int(batch.attention_mask.sum()) - 2 * prompt_length


def test_a_packed_update_moves_the_weights_as_the_padded_one(single_process_group):
    results = {}
    before = tiny_qwen2(vocab_size=VOCAB).state_dict()
    for name, tokens in (("padded", 0), ("packed", 64)):
        config = ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=tokens, kl_coef=0.1)
        actor = Actor(
            tiny_qwen2(vocab_size=VOCAB), config, sequences_per_update=12, reference=tiny_qwen2(VOCAB, seed=1)
        )
        seen = []
        metrics = actor.update(
            grouped_batch(), on_hidden_states=lambda part, hidden, seen=seen: seen.append((part, hidden))
        )
        results[name] = (metrics, seen, actor.policy.state_dict())
    (padded, _, _), (packed, packed_seen, packed_weights) = results.values()
    assert packed.loss == pytest.approx(padded.loss, rel=1e-5)
    assert packed.kl > 0  # in the loss above; the metric itself is a mean over micro-batches, which differ
    assert packed.grad_norm == pytest.approx(padded.grad_norm, rel=1e-5)
    # the drafter's hook sees each packed micro-batch as [b, t, hidden] rows, every response token once
    assert sum(int(part.response_mask.sum()) for part, _ in packed_seen) == grouped_batch().response_token_count
    assert all(hidden.shape[:2] == part.input_ids.shape for part, hidden in packed_seen)
    # each parameter's gradient: test_sharing_the_prompt_gives_every_parameter_the_padded_updates_gradient (AdamW's
    # first step, about lr * sign(g), would magnify float32 rounding in near-zero gradients here)
    changed = [name for name, value in packed_weights.items() if not torch.equal(value, before[name])]
    assert len(changed) == len(before)


def test_the_roofline_counts_a_packed_micro_batchs_attention_by_its_segments():
    batch = grouped_batch(groups=1)
    prompt_length = int(batch.attention_mask[0].sum() - batch.response_mask[0].sum())
    responses = batch.response_mask.sum(dim=1).tolist()
    segments = attention_segments(batch, share_prompt=True)
    assert segments == [(prompt_length, prompt_length), *[(length, prompt_length + length) for length in responses]]
    (part,) = update_roofline.micro_batch_shapes([batch], [segments])
    assert part.rows == 1 and part.tokens == packed_length(batch, share_prompt=True)
    # against the padded rows' squares, the packed attention's pairs are the segments' only
    pairs = sum(queries * keys for queries, keys, _ in part.attention_shapes())
    assert pairs == prompt_length**2 + sum(length * (prompt_length + length) for length in responses)
    assert pairs < part.tokens**2


# a window of 3 tokens, shorter than every row of grouped_batch (prompts of 4-8 tokens, responses of 1-6), so it
# changes every row's attention: Mistral's on every layer, Qwen2's above max_window_layers, Qwen3's by layer_types
WINDOW = 3
WINDOWED_MODELS = {
    "mistral": lambda: tiny_mistral(VOCAB, sliding_window=WINDOW),
    "qwen2": lambda: tiny_qwen2(VOCAB, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": lambda: tiny_qwen3(
        VOCAB, use_sliding_window=True, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
}


@pytest.mark.parametrize("family", WINDOWED_MODELS)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("share_prompt", [True, False])
def test_packed_hidden_states_equal_the_padded_rows_within_a_sliding_window(family, attention, share_prompt):
    model = WINDOWED_MODELS[family]().float()
    model.config._attn_implementation = attention
    batch = grouped_batch()
    real = batch.attention_mask.bool()
    with torch.no_grad():
        expected = padded_hidden(model.get_decoder(), batch)
        packed = packed_hidden(model.get_decoder(), batch, share_prompt)
    assert torch.allclose(packed[real], expected[real], atol=1e-5)


@pytest.mark.parametrize("family", WINDOWED_MODELS)
def test_sharing_the_prompt_gives_the_padded_updates_gradient_within_a_sliding_window(family):
    model = WINDOWED_MODELS[family]().float()
    batch = grouped_batch()
    padded = group_loss_gradients(model, batch, share_prompt=None)
    shared = group_loss_gradients(model, batch, share_prompt=True)
    for name, gradient in padded.items():
        scale = float(gradient.abs().max()) or 1.0
        assert torch.allclose(shared[name], gradient, atol=1e-5 * scale, rtol=1e-4), name


def test_the_window_is_what_the_comparison_sees():
    """The probe: the same Mistral without its window gives other hidden states, so the tests above can fail."""
    windowed, unlimited = tiny_mistral(VOCAB, sliding_window=WINDOW), tiny_mistral(VOCAB)
    batch = grouped_batch()
    real = batch.attention_mask.bool()
    with torch.no_grad():
        expected = padded_hidden(windowed.get_decoder(), batch)
        without_window = padded_hidden(unlimited.get_decoder(), batch)
    assert not torch.allclose(without_window[real], expected[real], atol=1e-3)


def test_a_model_with_layers_the_layout_does_not_reproduce_trains_padded_rows_and_says_so_once(capsys):
    chunked = Qwen2Config(num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    windowed = WINDOWED_MODELS["qwen2"]().config
    assert packing_supported(windowed) is None and packing_supported(Qwen2Config()) is None
    assert "chunked_attention" in packing_supported(chunked)
    config = ActorConfig(micro_batch_tokens=64)
    assert packs_micro_batches(64, windowed) and not packs_micro_batches(0, windowed)
    assert not packs_micro_batches(64, chunked)
    assert packs(config, windowed) and not packs(replace(config, micro_batch_tokens=0), chunked)
    assert capsys.readouterr().out == ""
    assert not packs(config, chunked)
    (line,) = capsys.readouterr().out.splitlines()
    assert "right-padded rows" in line and "chunked_attention" in line


def layout_storage_bytes(layout):
    """The bytes each tensor of a packed layout stores (a view of one value stores one)."""
    tensors = (layout.input_ids, layout.position_ids, layout.attention_mask, layout.gather_index, layout.window_mask)
    return [tensor.untyped_storage().nbytes() for tensor in tensors if tensor is not None]


def test_a_large_packed_micro_batch_laid_out_by_segments_builds_no_square_mask():
    """33k tokens once took 0.41 -> 5.83 GB just to lay out: the masks were [L,L] although no kernel read them."""
    completions = [
        Completion(row, tuple(range(3, 1003)) if row < 4 else tuple(range(4, 1004)), [5] * 4000, True, 0.0, 1.0)
        for row in range(8)
    ]
    batch = build_policy_batch(completions, torch.zeros(8), pad_token_id=0, group_size=GROUP)
    layout = packed_layout(batch, share_prompt=True, window=WINDOW, by_segments=True)
    assert layout.length == 2 * 1000 + 8 * 4000 and layout.attention_mask.shape == (1, 1, layout.length, layout.length)
    assert max(layout_storage_bytes(layout)) < layout.length**2 // 1000


@pytest.mark.parametrize("family", WINDOWED_MODELS)
def test_a_decoder_that_attends_by_segments_gets_no_square_mask_and_eager_gets_the_dense_one(family, monkeypatch):
    layouts = []
    monkeypatch.setattr(
        packed_forward, "packed_layout", lambda *arguments: layouts.append(packed_layout(*arguments)) or layouts[-1]
    )
    model = WINDOWED_MODELS[family]().float()
    batch = grouped_batch()
    with torch.no_grad():
        for attention in ("sdpa", "eager"):
            model.config._attn_implementation = attention
            packed_hidden(model.get_decoder(), batch, share_prompt=True)
    by_segments, dense = layouts
    assert max(layout_storage_bytes(by_segments)) < by_segments.length**2
    assert dense.attention_mask.untyped_storage().nbytes() == dense.length**2
