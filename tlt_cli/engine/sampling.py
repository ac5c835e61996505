"""How the next token is drawn (`SamplingParams`): turn logits into that distribution, and draw from it.

`apply_sampling` is the one place temperature, top-k and top-p are applied. The embedded engine
applies it to the target's logits and speculative decoding applies the very same function to the
drafter's logits, so the draft distribution q and the target distribution p are processed alike and
acceptance stays exact. Temperature 0 means greedy: the distribution is a point mass on the argmax; a
positive one is at least MIN_TEMPERATURE (the recipe's bound). `sample` raises `NonFiniteLogits` when a row
has no finite probability mass (logits that are NaN or infinite: a diverged policy), which the worker turns
into one sentence naming the step (tlt_cli/training/worker_loop.py); a drafter's are caught by the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# the smallest positive sampling temperature: below it, logits divided by it leave float32's range (and it is greedy
# in all but name)
MIN_TEMPERATURE = 1e-3


class NonFiniteLogits(ArithmeticError):
    """The logits sampled from are not finite, so the distribution has no mass to draw from."""


class NonFiniteDrafts(NonFiniteLogits):
    """The drafter's logits are not finite: the drafter diverged, not the policy (its drafts are sampled through
    the same check; tlt_cli/speculative/decoder.py names them as the drafter's, and decodes that step plainly)."""


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn. temperature 0 means greedy (argmax)."""

    max_new_tokens: int
    temperature: float = 1.0
    # keep the smallest set of tokens whose probability reaches top_p (1.0 keeps all)
    top_p: float = 1.0
    # keep the top_k most likely tokens (0 keeps all)
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_sampling(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities [N, V] of the next token under `params`, from logits [N, V] (float32 out)."""
    logits = logits.float()
    if params.greedy:
        # temperature 0: all mass on the argmax
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        logits = _keep_top_k(logits, params.top_k)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = _keep_top_p(probs, params.top_p)
    return probs


def _keep_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Logits with everything outside the top_k largest set to -inf (exactly top_k survive)."""
    kept_indices = logits.topk(top_k, dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, kept_indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def _keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised probs restricted to the smallest most-likely set whose mass reaches top_p."""
    sorted_probs, sorted_indices = probs.sort(dim=-1, descending=True)
    # a token stays if the mass of the tokens ranked strictly above it is still below top_p
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_above < top_p
    keep_sorted[..., 0] = True  # the most likely token always stays (top_p 0 is greedy)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_indices, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of probs [N, V] (non-negative, mass > 0, not necessarily normalised), drawn
    with `generator`: ids [N].

    By the inverse CDF: one uniform per row scaled to the row's mass, and the first token whose running
    mass (float64) exceeds it, so token i comes with probability p_i / sum(p) and a zero-probability token
    never. One draw per row, where torch.multinomial draws V exponentials per row (about 2.5 ms a row at a
    49k vocabulary on one CPU thread, 40x this)."""
    cumulative = probs.double().cumsum(dim=-1)
    total = cumulative[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise NonFiniteLogits("the logits sampled from are not finite")
    uniform = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)
    # strictly below the total, so some token's running mass exceeds it even where u * total rounds up
    threshold = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, threshold, right=True).squeeze(-1)


def next_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Next token ids [N] from logits [N, V]: the argmax when greedy, else a draw from apply_sampling."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(apply_sampling(logits, params), generator)
