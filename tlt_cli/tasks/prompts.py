"""A task's prompt as the model reads it: through its chat template when it has one.

An instruct model was trained on conversations, so `encode_prompt` wraps the task's prompt as
one user message and applies the tokenizer's chat template with the generation prompt (the
assistant turn's header), exactly as the model saw questions in training; the model's reply is
the response. A tokenizer without a chat template (the built-in tiny model, base models) gets
the prompt text as it is, with no special tokens added. The worker loop and the drafter warm-up
encode every prompt here, so the drafter learns on the prompts the rollout serves. The template is the
model folder's own Jinja code: its sandbox stops what it may touch, not how long it loops or how much it
allocates. So the first render of each template in a process runs in a forked child under hard limits that one
C-level operation (`10 ** (10 ** 8)`, `'ab ' * 10**7` tokenized) cannot escape: CHAT_TEMPLATE_SECONDS of CPU
(RLIMIT_CPU, and a wall-clock deadline after which the child is killed) and CHAT_TEMPLATE_MEMORY_BYTES of address
space beyond the process's own (RLIMIT_AS); a template past either is a `ChatTemplateTooSlow`, one sentence, instead
of hanging `tlt recipes validate` or `tlt train` or taking the machine's memory. Later renders of a template that
passed run in the process, stopped on the main thread after CHAT_TEMPLATE_SECONDS (a real template takes
milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import signal
import threading
import time
from collections.abc import Iterator

from transformers import PreTrainedTokenizerBase

from tlt_cli.errors import UserError

# the longest one prompt's chat template may render (wall-clock seconds) before it is stopped
CHAT_TEMPLATE_SECONDS = 5.0
# the memory a template's first render may take beyond the process's own address space (a forked child's RLIMIT_AS)
CHAT_TEMPLATE_MEMORY_BYTES = 1 << 30
# the templates that rendered within the limits in a forked child in this process (by their text)
_PROBED: set[str] = set()


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
    template = str(tokenizer.chat_template)
    if template not in _PROBED:
        probed = _render_in_limited_child(tokenizer, messages)
        _PROBED.add(template)
        if probed is not None:
            return probed
    with _time_limit(CHAT_TEMPLATE_SECONDS):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(encoded["input_ids"])


def _too_slow(seconds: float) -> ChatTemplateTooSlow:
    return ChatTemplateTooSlow(
        f"the tokenizer's chat template ran more than {seconds:g} s on one prompt (a loop too long?); fix "
        "chat_template in the model folder's tokenizer_config.json."
    )


def _render_in_limited_child(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int] | None:
    """The token ids of one render in a forked child under CHAT_TEMPLATE_SECONDS of CPU and wall clock and
    CHAT_TEMPLATE_MEMORY_BYTES more address space; ChatTemplateTooSlow past either; None when the render raised
    (the caller renders again in the process, where the template's own error is raised) or fork is unavailable."""
    if not hasattr(os, "fork"):
        return None
    reading, writing = os.pipe()
    own = _address_space_bytes()
    address_space = own + CHAT_TEMPLATE_MEMORY_BYTES if own else resource.RLIM_INFINITY
    child = os.fork()
    if child == 0:  # pragma: no cover - the child's exit code and pipe are what the parent checks
        code = 1
        try:
            os.close(reading)
            silent = os.open(os.devnull, os.O_WRONLY)  # an allocator's abort report is not the user's to read
            os.dup2(silent, 1)
            os.dup2(silent, 2)
            seconds = int(CHAT_TEMPLATE_SECONDS) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
            encoded = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            payload = json.dumps([int(token) for token in encoded["input_ids"]]).encode()
            with os.fdopen(writing, "wb") as pipe:
                pipe.write(payload)
            code = 0
        except MemoryError:
            code = 3
        except BaseException:  # noqa: BLE001 - the template's own error: rendered again in the parent
            code = 1
        os._exit(code)
    os.close(writing)
    chunks: list[bytes] = []
    deadline = time.monotonic() + CHAT_TEMPLATE_SECONDS
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([reading], [], [], left)[0]:
                os.kill(child, signal.SIGKILL)
                os.waitpid(child, 0)
                raise _too_slow(CHAT_TEMPLATE_SECONDS)
            chunk = os.read(reading, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(reading)
    _, status = os.waitpid(child, 0)
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        raise _too_slow(CHAT_TEMPLATE_SECONDS)
    if (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3) or os.WIFSIGNALED(status):
        raise ChatTemplateTooSlow(
            f"the tokenizer's chat template needed more than {CHAT_TEMPLATE_MEMORY_BYTES >> 20} MiB of memory on one "
            "prompt (an operation too large?); fix chat_template in the model folder's tokenizer_config.json."
        )
    if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
        return None
    return json.loads(b"".join(chunks))


def _address_space_bytes() -> int:
    """This process's virtual memory size (VmSize in /proc/self/status; 0 where it cannot be read)."""
    try:
        for line in open("/proc/self/status", encoding="ascii"):  # noqa: SIM115 - a short read
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise ChatTemplateTooSlow in the block once it has run `seconds` (SIGALRM: on the main thread only; elsewhere
    the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise _too_slow(seconds)

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
