"""A task's prompt as the model reads it: through its chat template when it has one.

An instruct model was trained on conversations, so `encode_prompt` wraps the task's prompt as
one user message and applies the tokenizer's chat template with the generation prompt (the
assistant turn's header), exactly as the model saw questions in training; the model's reply is
the response. A tokenizer without a chat template (the built-in tiny model, base models) gets
the prompt text as it is, with no special tokens added. The worker loop and the drafter warm-up
encode every prompt here, so the drafter learns on the prompts the rollout serves.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of `prompt`: one user turn of the chat template plus the assistant header, or the
    plain text when the tokenizer has no chat template.

    Example (a ChatML model): "What is 2 + 3?" -> the ids of
    "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nWhat is 2 + 3?<|im_end|>\\n<|im_start|>assistant\\n"
    """
    if not uses_chat_template(tokenizer):
        return tokenizer.encode(prompt, add_special_tokens=False)
    messages = [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def uses_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether prompts go through the tokenizer's chat template (it has one)."""
    return bool(getattr(tokenizer, "chat_template", None))
