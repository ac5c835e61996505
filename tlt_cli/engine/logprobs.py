"""The log-prob of chosen tokens from logits: one formula for the rollout engine and the learner.

`chosen_logprobs(logits, tokens, temperature)` is log_softmax(logits.float() / temperature)[token] and the
logsumexp it subtracted. The learner's chunked head (tlt_cli/training/logprobs.py) calls it for the old,
reference and trained log-probs; the generate loop (tlt_cli/rollout/generate_loop.py) calls `decoded_logprobs`,
which feeds it the decode model's own logits of the hidden states that produced each sampled token, so a
rollout's log-probs are the rollout model's (in its dtype) by the learner's definition: with a float32
rollout the two agree to float32 rounding, with a bfloat16 one they differ by the mismatch the trainer
measures and corrects (tlt_cli/training/rollout_correction.py).
"""

from __future__ import annotations

import torch

from tlt_cli.engine.interface import DecodeModel

# rows per head product: 256 x 49152 float32 logits is 50 MB, and 256 rows keep the product efficient
CHUNK_TOKENS = 256


def scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[N,V] float32 logits / temperature (no copy beyond the float32 cast when the temperature is 1)."""
    logits = logits.float()
    return logits if temperature == 1.0 else logits / temperature


def chosen_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(logits / temperature)[tokens], logsumexp(logits / temperature)): logits [N,V], tokens [N]
    -> two [N] float32."""
    scaled = scaled_logits(logits, temperature)
    logsumexp = scaled.logsumexp(dim=-1)
    # log_softmax(z)[token] = z[token] - logsumexp(z)
    return scaled.gather(1, tokens[:, None]).squeeze(1) - logsumexp, logsumexp


def decoded_logprobs(
    decode_model: DecodeModel,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = CHUNK_TOKENS,
) -> torch.Tensor:
    """log_softmax(decode_model.logits(hidden) / temperature)[tokens]: hidden [N,H], tokens [N] -> [N] float32,
    chunk_tokens rows of logits at a time."""
    values = torch.empty(tokens.shape[0], dtype=torch.float32, device=tokens.device)
    for first in range(0, tokens.shape[0], chunk_tokens):
        rows = slice(first, first + chunk_tokens)
        values[rows] = chosen_logprobs(decode_model.logits(hidden[rows]), tokens[rows], temperature)[0]
    return values
