"""Whether an SD shape can run: one problem sentence naming the field to fix, or None.

`shape_problem(config)` says what keeps a `SpeculativeConfig` from being drafted by any drafter;
`topk_fit_problem(config, draft_vocab_size)` whether its branches fit a drafter's draft vocabulary. The
decoder (decoder.py) checks each shape it is handed with both and raises; the recipe gate
(tlt_cli/recipe_checks.py, the recipe's shapes and rule table) and `tlt calibrate` (its --configs) refuse with
the sentence, after the key or option that gave the shape.
"""

from __future__ import annotations

from tlt_cli.speculative.types import MAX_DRAFT_STEPS, MAX_DRAFT_TOPK, MAX_VERIFIED_TOKENS, SpeculativeConfig


def shape_problem(config: SpeculativeConfig) -> str | None:
    """The sentence naming the field to fix when `config` cannot be drafted by any drafter, else None (whether
    its topk fits a given drafter's vocabulary: `topk_fit_problem`)."""
    if config.ngram_tokens < 0:
        return f"ngram tokens is {config.ngram_tokens}; set it to 0 (none) or more."
    if config.ngram_tokens > MAX_DRAFT_STEPS:
        return f"ngram tokens is {config.ngram_tokens}; set it to at most {MAX_DRAFT_STEPS}."
    if config.steps > MAX_DRAFT_STEPS:
        return f"speculative steps is {config.steps}; set it to at most {MAX_DRAFT_STEPS}."
    if config.topk > MAX_DRAFT_TOPK:
        return f"speculative topk is {config.topk}; set it to at most {MAX_DRAFT_TOPK}."
    if config.draft_tokens > MAX_VERIFIED_TOKENS:
        return f"speculative draft_tokens is {config.draft_tokens}; set it to at most {MAX_VERIFIED_TOKENS}."
    if config.steps == 0 and config.uses_ngram:
        if config.topk != 1 or config.draft_tokens != 0:
            return (
                f"a model-free shape (steps 0, ngram {config.ngram_tokens}) drafts no tree; "
                f"set topk to 1 and draft_tokens to 0, not {config.topk} and {config.draft_tokens}."
            )
        return None
    if config.steps < 1:
        return f"speculative steps is {config.steps}; set it to at least 1."
    if config.topk < 1:
        return f"speculative topk is {config.topk}; set it to at least 1."
    if config.picks_source and not (config.is_chain and config.uses_ngram):
        return (
            f"a per-row choice of source (|) verifies one chain per row; give the drafter a chain (topk 1, not "
            f"{config.topk}) and ngram tokens >= 1 (not {config.ngram_tokens}), e.g. s2-k1-t3|ngram4."
        )
    if config.is_chain:
        if config.draft_tokens not in (0, config.steps + 1):
            return (
                f"a chain (topk 1) of {config.steps} steps verifies {config.steps + 1} tokens; "
                f"set draft_tokens to {config.steps + 1} or 0, not {config.draft_tokens}."
            )
        return None
    candidates = config.topk + (config.steps - 1) * config.topk**2
    if not 2 <= config.verified_tokens <= candidates + 1:
        return (
            f"speculative draft_tokens is {config.verified_tokens}; with steps {config.steps} and topk "
            f"{config.topk} set it between 2 and {candidates + 1}."
        )
    return None


def topk_fit_problem(config: SpeculativeConfig, draft_vocab_size: int) -> str | None:
    """The sentence refusing `config` when it branches over more tokens than the drafter proposes from (its
    draft vocabulary, N tokens; a model-free shape uses no drafter), else None."""
    if config.uses_drafter and config.topk > draft_vocab_size:
        return f"speculative topk is {config.topk}; set it between 1 and the draft vocabulary size {draft_vocab_size}."
    return None
