"""A task's prompt as the model reads it: through its chat template when it has one.

An instruct model was trained on conversations, so `encode_prompt` wraps the task's prompt as
one user message and applies the tokenizer's chat template with the generation prompt (the
assistant turn's header), exactly as the model saw questions in training; the model's reply is
the response. A tokenizer without a chat template (the built-in tiny model, base models) gets
the prompt text as it is, with no special tokens added. The worker loop and the drafter warm-up
encode every prompt here, so the drafter learns on the prompts the rollout serves. The template is the
model folder's own Jinja code: its sandbox stops what it may touch, not how long it loops, so on the main
thread a render is stopped after CHAT_TEMPLATE_SECONDS (a real template takes milliseconds) with a
`ChatTemplateTooSlow`, one sentence, instead of hanging `tlt recipes validate` or `tlt train`.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from transformers import PreTrainedTokenizerBase

from tlt_cli.errors import UserError

# the longest one prompt's chat template may render (wall-clock seconds) before it is stopped
CHAT_TEMPLATE_SECONDS = 5.0


class ChatTemplateTooSlow(UserError):
    """The tokenizer's chat template ran past CHAT_TEMPLATE_SECONDS on one prompt."""


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt`: one user turn of the chat template plus the assistant header, or the
    plain text when the tokenizer has no chat template.

    Example (a ChatML model): "What is 2 + 3?" -> the ids of
    "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n<|im_start|>assistant\\n"
    """
    if not uses_chat_template(tokenizer):
        return tokenizer.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": prompt}]
    with _time_limit(CHAT_TEMPLATE_SECONDS):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise ChatTemplateTooSlow in the block once it has run `seconds` (SIGALRM: on the main thread only; elsewhere
    the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise ChatTemplateTooSlow(
            f"the tokenizer's chat template ran more than {seconds:g} s on one prompt (a loop too long?); fix "
            "chat_template in the model folder's tokenizer_config.json."
        )

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def uses_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether prompts go through the tokenizer's chat template (it has one)."""
    return bool(getattr(tokenizer, "chat_template", None))
