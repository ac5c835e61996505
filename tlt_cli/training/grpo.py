"""GRPO maths: group-normalized advantages and the clipped policy loss with optional KL.

Pure tensor functions, no I/O: the actor calls `policy_loss` on each micro-batch (its log-probs
come from logprobs.py, chunked over tokens); the worker calls `group_advantages` on a rollout's
rewards. Shapes are written on arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ADVANTAGE_EPSILON = 1e-6


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Advantages [N] from rewards [N] laid out as consecutive groups of `group_size` responses.

    A_i = (r_i - mean(group)) / (std(group) + eps): responses better than their siblings get
    positive advantage; a group where all rewards are equal carries no signal (all zeros).
    """
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}.")
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, unbiased=False, keepdim=True)
    return ((grouped - mean) / (std + ADVANTAGE_EPSILON)).view(-1)


@dataclass
class PolicyLoss:
    """One micro-batch's loss (already divided by the token count of the whole batch) and its stats."""

    loss: torch.Tensor
    clip_fraction: float
    kl: float
    ratio_mean: float


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float,
    total_response_tokens: int,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    importance_weights: torch.Tensor | None = None,
) -> PolicyLoss:
    """Clipped-ratio GRPO loss, summed over this micro-batch's response tokens / total_response_tokens.

    logprobs, old_logprobs, ref_logprobs, response_mask: [B,T]; advantages: [B]. importance_weights: [B,T]
    detached weights of each token's surrogate for the rollout/learner mismatch (rollout_correction.py).
    Dividing by the token count of the whole rollout batch (not this micro-batch) makes the
    sum over micro-batches a token mean, whatever the micro-batch split.
    """
    mask = response_mask.float()
    advantage = advantages.unsqueeze(1)
    # ratio = pi_theta / pi_old, computed in log space for stability
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantage
    clipped = torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio) * advantage
    # PPO surrogate: maximize min(r A, clip(r) A) -> minimize its negative
    per_token = -torch.minimum(unclipped, clipped)
    if importance_weights is not None:
        # truncated importance sampling: the tokens were sampled from pi_rollout, the surrogate assumes pi_old
        per_token = per_token * importance_weights
    kl_value = torch.zeros((), dtype=per_token.dtype)
    if ref_logprobs is not None and kl_coef > 0.0:
        log_ratio_ref = ref_logprobs - logprobs
        # k3 estimator of KL(pi_theta || pi_ref): exp(x) - x - 1 with x = log(pi_ref / pi_theta), always >= 0
        kl_per_token = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
        per_token = per_token + kl_coef * kl_per_token
        kl_value = (kl_per_token * mask).sum() / mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / total_response_tokens
    with torch.no_grad():
        token_count = mask.sum().clamp(min=1.0)
        was_clipped = ((ratio - 1.0).abs() > clip_ratio).float()
        clip_fraction = float((was_clipped * mask).sum() / token_count)
        ratio_mean = float((ratio * mask).sum() / token_count)
    return PolicyLoss(loss=loss, clip_fraction=clip_fraction, kl=float(kl_value), ratio_mean=ratio_mean)
