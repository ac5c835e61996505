"""Where an online drafter starts: a draft vocabulary read from the task's prompts, without the model.

With `drafter.init: online` (the default) a run starts from a fresh drafter and trains it while it runs
(the drafter sidecar), so nothing waits before step 0. A fresh drafter over a 49k-150k vocabulary spends
most of each draft and training step in its head. The task's prompts, encoded as the rollout encodes
them, already name the tokens a response uses most (a worked example, the question's own words, the
chat template's markers), and reading them costs no forward pass: `prompt_vocabulary` keeps the N
most frequent (N from `drafter.vocab_size`, as the warm-up's), EOS always among them. Verification
stays over the full vocabulary, so decoding stays lossless whatever the vocabulary misses.

The composition root (tlt_cli/training/setup.py `starting_drafter`) calls `online_drafter` in every
worker and wherever a plan measures the drafter's passes, so all of them build the same drafter.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.vocabulary import DraftVocabulary, most_frequent_tokens, resolve_draft_vocab_size
from tlt_cli.tasks.base import Task
from tlt_cli.tasks.prompts import encode_prompt

# task prompts read for the vocabulary (SmolLM2's word_arithmetic: about a second through the chat template)
PROMPT_SAMPLE = 256


def prompt_vocabulary(
    tokenizer: PreTrainedTokenizerBase, task: Task, draft_vocab_size: int, target_vocab_size: int
) -> DraftVocabulary:
    """The `draft_vocab_size` tokens (0: the default for the target) most frequent in the task's first
    PROMPT_SAMPLE prompts, EOS always among them; the full vocabulary when that is no larger."""
    size = resolve_draft_vocab_size(draft_vocab_size, target_vocab_size)
    if size >= target_vocab_size:
        return DraftVocabulary.full(target_vocab_size)
    prompts = [encode_prompt(tokenizer, task.problem(index).prompt) for index in range(PROMPT_SAMPLE)]
    required = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return most_frequent_tokens(prompts, target_vocab_size, size, required)


def online_drafter(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task, draft_vocab_size: int, seed: int
) -> EagleDrafter:
    """A fresh drafter over `target` that drafts over the task prompts' vocabulary (module docstring)."""
    vocabulary = prompt_vocabulary(tokenizer, task, draft_vocab_size, target.config.vocab_size)
    return EagleDrafter(target, seed=seed, vocabulary=vocabulary)
