"""Log-probs of chosen tokens through the output head, chunked over tokens: never [tokens, V] at once.

The actor (actor.py) calls `token_logprobs(hidden, lm_head, input_ids, needed)` for the old,
reference and trained log-probs of a micro-batch; tlt's rollout under TRL
(tlt_cli/integrations/trl.py) calls `head_logprobs` for the sampled tokens' log-probs. Both go
through `ChunkedHeadLogprobs`, an autograd Function that takes CHUNK_TOKENS rows at a time: the
head's product, log_softmax and the gather happen inside the chunk, only each row's logsumexp is
kept, and backward recomputes each chunk's logits. So memory is [CHUNK_TOKENS, V] floats (plus
[tokens, H] hidden states) instead of [B, T, V] logits, their log_softmax and its gradient, while
values and gradients equal log_softmax(lm_head(hidden).float())[token] within float32 rounding. The
formula itself is tlt_cli/engine/logprobs.py's `chosen_logprobs`, which the rollout engine's log-probs use too.
The head's product runs in the head's own dtype with autocast off: under the actor's bfloat16 update
on CPU (autocast over float32 weights) the logits, log-probs and their gradients stay float32, as the
ratio pi / pi_old of the loss needs; the decoder's layers before them run in bfloat16.
"""

from __future__ import annotations

import torch
from torch import nn

from tlt_cli.engine.logprobs import CHUNK_TOKENS, chosen_logprobs, scaled_logits


def token_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    input_ids: torch.Tensor,
    needed: torch.Tensor | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """Log-prob of each next token: hidden [B,T,H] (the decoder's last states), input_ids [B,T] -> [B,T] float32.

    Entry t is log p(input_ids[t] | input_ids[:t]), from hidden[:, t-1]; entry 0 has no context and
    is 0. needed [B,T] (bool or 0/1, e.g. the response mask): only those entries are computed, the
    others are 0 (the policy loss masks them anyway), which skips the head for prompt and padding.
    """
    batch, length = input_ids.shape
    positions = torch.ones(batch, length - 1, dtype=torch.bool, device=input_ids.device)
    if needed is not None:
        positions = needed[:, 1:].bool()
    rows = hidden[:, :-1][positions]
    tokens = input_ids[:, 1:][positions]
    values = head_logprobs(rows, head, tokens, chunk_tokens=chunk_tokens)
    shifted = torch.zeros(batch, length - 1, dtype=values.dtype, device=values.device).masked_scatter(positions, values)
    return nn.functional.pad(shifted, (1, 0), value=0.0)


def head_logprobs(
    hidden: torch.Tensor,
    head: nn.Linear,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """log_softmax(head(hidden).float() / temperature)[tokens]: hidden [N,H], tokens [N] -> [N] float32."""
    return ChunkedHeadLogprobs.apply(hidden, head.weight, head.bias, tokens, temperature, chunk_tokens)


class ChunkedHeadLogprobs(torch.autograd.Function):
    """values[n] = log_softmax(hidden[n] @ weight.T + bias)[tokens[n]], CHUNK rows at a time both ways."""

    @staticmethod
    @torch.autocast("cpu", enabled=False)
    def forward(ctx, hidden, weight, bias, tokens, temperature, chunk_tokens):  # type: ignore[override]
        values = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(values)
        for rows in _chunks(hidden.shape[0], chunk_tokens):
            logits = nn.functional.linear(hidden[rows], weight, bias)
            values[rows], logsumexp[rows] = chosen_logprobs(logits, tokens[rows], temperature)
        ctx.save_for_backward(hidden, weight, bias, tokens, logsumexp)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return values

    @staticmethod
    def backward(ctx, grad_values):  # type: ignore[override]
        hidden, weight, bias, tokens, logsumexp = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if needs_bias else None
        for rows in _chunks(hidden.shape[0], ctx.chunk_tokens):
            grad = grad_values[rows, None]
            # d value / d logits = onehot(token) - softmax(logits), times the upstream gradient, / temperature
            grad_logits = _logits(hidden[rows], weight, bias, ctx.temperature)
            grad_logits.sub_(logsumexp[rows, None]).exp_().mul_(-grad)
            grad_logits.scatter_add_(1, tokens[rows, None], grad)
            grad_logits = grad_logits.div_(ctx.temperature).to(weight.dtype)
            if needs_hidden:
                grad_hidden[rows] = grad_logits @ weight
            if needs_weight:
                grad_weight += (grad_logits.T @ hidden[rows]).float()
            if needs_bias:
                grad_bias += grad_logits.float().sum(dim=0)
        grad_weight = grad_weight.to(weight.dtype) if needs_weight else None
        grad_bias = grad_bias.to(bias.dtype) if needs_bias else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """[n,V] float32 logits / temperature, the product in the head's dtype as lm_head(hidden) computes it."""
    return scaled_logits(nn.functional.linear(hidden.to(weight.dtype), weight, bias), temperature)


def _chunks(count: int, chunk_tokens: int) -> list[slice]:
    return [slice(first, min(first + chunk_tokens, count)) for first in range(0, count, chunk_tokens)]
