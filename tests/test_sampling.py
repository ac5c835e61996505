"""Sampling maths: temperature, top-k and top-p masks, greedy, reproducible draws."""

import pytest
import torch

from tlt_cli.engine.sampling import SamplingParams, apply_sampling, next_tokens, sample

torch.set_num_threads(1)

LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 3.0, 0.0, 1.0, 0.0]])


def test_plain_sampling_is_softmax_of_scaled_logits():
    probs = apply_sampling(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.5))
    assert torch.allclose(probs, torch.softmax(LOGITS / 0.5, dim=-1))


def test_greedy_is_a_point_mass_on_the_argmax():
    probs = apply_sampling(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.0))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0, 0.0]]
    generator = torch.Generator().manual_seed(0)
    assert next_tokens(LOGITS, SamplingParams(max_new_tokens=1, temperature=0.0), generator).tolist() == [0, 1]


def test_top_k_keeps_exactly_k_tokens_renormalised():
    probs = apply_sampling(LOGITS, SamplingParams(max_new_tokens=1, top_k=2))
    assert (probs > 0).sum(dim=-1).tolist() == [2, 2]
    expected_first = torch.softmax(torch.tensor([2.0, 1.0]), dim=-1)
    assert torch.allclose(probs[0, :2], expected_first)
    assert probs[1, 1] > 0 and probs[1, 3] > 0


def test_top_p_keeps_smallest_set_reaching_the_mass():
    full = torch.softmax(LOGITS[0], dim=-1)  # ~[0.53, 0.20, 0.12, 0.07, 0.03]
    probs = apply_sampling(LOGITS[:1], SamplingParams(max_new_tokens=1, top_p=0.7))
    # 0.53 < 0.7, 0.53 + 0.20 >= 0.7: the two most likely tokens stay
    assert (probs[0] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs[0, :2], full[:2] / full[:2].sum())
    assert torch.allclose(probs.sum(dim=-1), torch.ones(1))


def test_top_p_always_keeps_the_most_likely_token():
    probs = apply_sampling(LOGITS[:1], SamplingParams(max_new_tokens=1, top_p=0.01))
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_top_k_then_top_p_compose():
    probs = apply_sampling(LOGITS[:1], SamplingParams(max_new_tokens=1, temperature=2.0, top_k=3, top_p=0.6))
    kept = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 2.0, dim=-1)  # ~[0.42, 0.32, 0.26]
    # 0.42 < 0.6 and 0.42 + 0.32 >= 0.6: two survive
    assert torch.allclose(probs[0, :2], kept[:2] / kept[:2].sum())
    assert probs[0, 2:].sum() == 0


def test_sample_is_reproducible_and_follows_probs():
    probs = torch.tensor([[0.1, 0.6, 0.3]]).expand(20000, 3)
    first = sample(probs, torch.Generator().manual_seed(3))
    second = sample(probs, torch.Generator().manual_seed(3))
    assert torch.equal(first, second)
    frequencies = torch.bincount(first, minlength=3).float() / first.shape[0]
    assert torch.allclose(frequencies, torch.tensor([0.1, 0.6, 0.3]), atol=0.02)


@pytest.mark.parametrize(
    "params", [SamplingParams(max_new_tokens=1, top_k=1), SamplingParams(max_new_tokens=1, top_p=0.0)]
)
def test_degenerate_filters_reduce_to_the_argmax(params):
    probs = apply_sampling(LOGITS, params)
    assert probs.argmax(dim=-1).tolist() == [0, 1]
    assert torch.allclose(probs.max(dim=-1).values, torch.ones(2))


def test_sample_draws_unnormalised_rows_by_their_mass_and_never_a_zero_probability_token():
    # zeros first, in the middle and last (top-k masks), a row that does not sum to 1, a lone tiny mass
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1e-30]])
    draws = sample(probs.repeat_interleave(20000, dim=0), torch.Generator().manual_seed(5)).view(2, -1)
    first = torch.bincount(draws[0], minlength=5).float() / draws.shape[1]
    assert first[[0, 2, 4]].sum() == 0
    assert torch.allclose(first[[1, 3]], torch.tensor([0.25, 0.75]), atol=0.02)
    assert bool((draws[1] == 4).all())
