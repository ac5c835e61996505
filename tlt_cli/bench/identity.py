"""Whether greedy SD gave plain decoding's tokens: the first divergence of each response and its verdict.

    divergences = first_divergences(target, prompts, plain_responses, responses, dtype="float32")
    same_verdict(divergences)   # 'yes': identical; 'tie': every divergence at a tie of the target; 'NO'

Lossless SD reproduces the target's greedy tokens, up to the target's own ties: where two tokens' logits are
within TIE_TOLERANCE, a verify pass over several tokens and a plain step over one may round them apart. Used by
`tlt bench rollout` (tlt_cli/bench/rollout.py) and scripts/gpu_check.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tlt_cli.engine import decode_model_for
from tlt_cli.rollout.decode_plan import DECODE_DTYPES

TIE_TOLERANCE = 1e-4


def sequence_logits(target: Callable, ids: list[int], dtype: str) -> torch.Tensor:
    """The last position's logits [V] of `ids` in `dtype`: transformers' forward in float32, the owned forward in
    bfloat16 (the one the engine decodes with)."""
    if dtype == "float32":
        return target(torch.tensor([ids])).logits[0, -1]
    decode_model = decode_model_for(target, dtype=DECODE_DTYPES[dtype])
    length = len(ids)
    positions = torch.arange(length)[None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    hidden = decode_model.forward_block(
        decode_model.new_cache(1, length), torch.tensor([ids]), positions, positions, length, causal
    )
    return decode_model.logits(hidden[0, -1])


def first_divergences(
    target: Callable,
    prompts: Sequence[Sequence[int]],
    reference: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    dtype: str = "float32",
) -> list[dict]:
    """Where each response first differs from the reference's, with the target's logit gap there (the larger of
    the two tokens' distances to the top logit; one full forward over the prompt and the common prefix)."""
    found = []
    for index, (prompt, expected, got) in enumerate(zip(prompts, reference, responses, strict=True)):
        expected, got = list(expected), list(got)
        if got == expected:
            continue
        position = next((at for at, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        divergence = {"prompt": index, "position": position, "off_token": None, "token": None, "logit_gap": None}
        if position < min(len(expected), len(got)):  # not one response ending where the other goes on
            with torch.no_grad():
                logits = sequence_logits(target, list(prompt) + expected[:position], dtype)
            top = float(logits.max())
            gap = max(top - float(logits[expected[position]]), top - float(logits[got[position]]))
            divergence.update(off_token=expected[position], token=got[position], logit_gap=gap)
        found.append(divergence)
    return found


def same_verdict(divergences: list[dict]) -> str:
    """'yes' with no divergence; 'tie' when every one is at a tie of the target (both tokens within TIE_TOLERANCE
    of the top logit); else 'NO'."""
    if not divergences:
        return "yes"
    ties = [item["logit_gap"] is not None and item["logit_gap"] <= TIE_TOLERANCE for item in divergences]
    return "tie" if all(ties) else "NO"
