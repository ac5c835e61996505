"""GRPO maths on CPU: advantages and the clipped loss with its gradient (log-probs: test_logprobs.py)."""

import math

import pytest
import torch

from tlt_cli.training.grpo import group_advantages, policy_loss
from tlt_cli.training.rollout_correction import MismatchTotals, importance_weights


def test_group_advantages_normalize_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    advantages = group_advantages(rewards, group_size=4)
    first = advantages[:4]
    assert torch.allclose(first.mean(), torch.tensor(0.0), atol=1e-6)
    assert first[0] > 0 and (first[1:] < 0).all()
    # std of [1,0,0,0] is sqrt(3)/4: (1 - 0.25) / 0.433 = sqrt(3)
    assert first[0].item() == pytest.approx(3**0.5, rel=1e-4)
    # a group with equal rewards carries no signal
    assert torch.equal(advantages[4:], torch.zeros(4))


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(torch.zeros(6), group_size=4)


def test_on_policy_loss_gradient_is_advantage_weighted_logprob_gradient():
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    result = policy_loss(logprobs, logprobs.detach(), advantages, mask, clip_ratio=0.2, total_response_tokens=3)
    result.loss.backward()
    # at ratio 1 the gradient of -r*A w.r.t. log pi is -A on each counted token, divided by the token count
    expected = torch.tensor([[0.0, -1 / 3, -1 / 3], [0.0, 2 / 3, 0.0]])
    assert torch.allclose(logprobs.grad, expected)
    assert result.clip_fraction == 0.0 and result.ratio_mean == pytest.approx(1.0)


def test_clipping_stops_gradient_beyond_the_trust_region():
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.0, 0.5]], requires_grad=True)  # ratio e^0.5 = 1.65 > 1.2
    result = policy_loss(
        logprobs, old, torch.tensor([1.0]), torch.tensor([[0, 1]]), clip_ratio=0.2, total_response_tokens=1
    )
    result.loss.backward()
    assert logprobs.grad[0, 1].item() == 0.0
    assert result.clip_fraction == 1.0
    # with a negative advantage the clipped branch is not the minimum: the gradient flows
    logprobs.grad = None
    result = policy_loss(
        logprobs, old, torch.tensor([-1.0]), torch.tensor([[0, 1]]), clip_ratio=0.2, total_response_tokens=1
    )
    result.loss.backward()
    assert logprobs.grad[0, 1].item() == pytest.approx(torch.exp(torch.tensor(0.5)).item(), rel=1e-5)


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    logprobs = torch.tensor([[0.0, -1.0]])
    mask = torch.tensor([[0, 1]])
    same = policy_loss(logprobs, logprobs, torch.zeros(1), mask, 0.2, 1, ref_logprobs=logprobs, kl_coef=0.5)
    assert same.kl == pytest.approx(0.0) and same.loss.item() == pytest.approx(0.0)
    away = policy_loss(
        logprobs, logprobs, torch.zeros(1), mask, 0.2, 1, ref_logprobs=torch.tensor([[0.0, -2.0]]), kl_coef=0.5
    )
    # k3: exp(-1) - (-1) - 1 = e^-1
    assert away.kl == pytest.approx(torch.exp(torch.tensor(-1.0)).item(), rel=1e-5)
    assert away.loss.item() == pytest.approx(0.5 * away.kl, rel=1e-5)


def test_micro_batch_split_does_not_change_the_total_loss():
    torch.manual_seed(1)
    logprobs = torch.randn(4, 6)
    old = logprobs + 0.1 * torch.randn(4, 6)
    mask = (torch.rand(4, 6) > 0.3).long()
    advantages = torch.randn(4)
    total = int(mask.sum())
    whole = policy_loss(logprobs, old, advantages, mask, 0.2, total).loss
    halves = sum(
        policy_loss(logprobs[i : i + 2], old[i : i + 2], advantages[i : i + 2], mask[i : i + 2], 0.2, total).loss
        for i in (0, 2)
    )
    assert whole.item() == pytest.approx(halves.item(), rel=1e-6)


def test_truncated_importance_sampling_weights_each_tokens_surrogate_as_computed_by_hand():
    logprobs = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]], requires_grad=True)
    old = torch.tensor([[0.0, -1.1, -1.9], [0.0, -0.6, -0.7]])
    rollout = torch.tensor([[0.0, -1.0, -3.0], [0.0, -0.5, -0.2]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    advantages = torch.tensor([1.0, -2.0])
    weights = importance_weights(old, rollout, mask, "token", cap=2.0)
    # pi_old / pi_rollout per token: e^-0.1, e^1.1 = 3.0 -> the cap 2.0; e^-0.1; off the mask 1
    expected_weights = torch.tensor([[1.0, math.exp(-0.1), 2.0], [1.0, math.exp(-0.1), 1.0]])
    assert torch.allclose(weights, expected_weights) and not weights.requires_grad
    result = policy_loss(logprobs, old, advantages, mask, 0.2, total_response_tokens=3, importance_weights=weights)
    # per token -min(r A, clip(r) A) with r = pi / pi_old, times its weight, summed over the mask / 3
    by_hand = 0.0
    for row, column in [(0, 1), (0, 2), (1, 1)]:
        ratio = math.exp(logprobs[row, column].item() - old[row, column].item())
        advantage = advantages[row].item()
        surrogate = min(ratio * advantage, min(max(ratio, 0.8), 1.2) * advantage)
        by_hand += -surrogate * expected_weights[row, column].item()
    assert result.loss.item() == pytest.approx(by_hand / 3, rel=1e-6)
    result.loss.backward()
    # every ratio is inside the clip range: d loss / d log pi = -A r w / 3 on the mask, the weights detached
    ratio = torch.exp(logprobs.detach() - old)
    expected_gradient = -advantages[:, None] * ratio * expected_weights * mask / 3
    assert torch.allclose(logprobs.grad, expected_gradient, atol=1e-6)


def test_sequence_weights_are_one_truncated_product_per_response_and_off_gives_none():
    old = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, -0.7]])
    rollout = torch.tensor([[0.0, -1.2, -2.1], [0.0, -0.1, -0.7]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    weights = importance_weights(old, rollout, mask, "sequence", cap=1.2)
    # row 0: e^(0.2 + 0.1) = 1.35 -> the cap 1.2 on every token; row 1: e^-0.4 (the third token is off the mask)
    assert torch.allclose(weights, torch.tensor([[1.2] * 3, [math.exp(-0.4)] * 3]))
    assert importance_weights(old, rollout, mask, "off", cap=2.0) is None
    totals = MismatchTotals("sequence", cap=1.2)
    totals.add(old, rollout, mask)
    metrics = totals.metrics()
    assert metrics["rollout_weight_max"] == pytest.approx(math.exp(0.3))
    assert metrics["rollout_weight_min"] == pytest.approx(math.exp(-0.4))
    assert metrics["rollout_weight_truncated"] == 0.5
    # k3 over the three response tokens: exp(x) - x - 1 for x = 0.2, 0.1, -0.4
    k3 = sum(math.exp(x) - x - 1 for x in (0.2, 0.1, -0.4)) / 3
    assert metrics["rollout_kl_k3"] == pytest.approx(k3)
