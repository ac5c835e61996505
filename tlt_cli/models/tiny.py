"""The built-in tiny policy `builtin:tiny-arith`: a small Qwen2 that half-solves the arithmetic task, with slips.

`tiny_model_config` and `build_tiny_model` make a seeded, randomly initialised causal LM over
the arithmetic task's character vocabulary (Qwen2 by default, Llama for tests). `warm_up`
teaches it the task with a supervised pass on worked solutions in which each step's total is
off by one with a small probability (a slip that carries forward): the model learns the method
(solid up to three terms, shaky beyond) and, sampled at temperature 1, slips as often
as its teacher did. So GRPO starts from a clearly non-zero reward with two kinds of room to
improve within minutes: unlearning the slips, and longer problems.

`builtin:tiny-arith` is the folder SHIPPED_TINY_MODEL, committed with the package: the defaults
below built and warmed up by `scripts/make_tiny_model.py` (about 6 minutes on 2 CPU cores, too
long to make every new user wait) and saved in bfloat16. `ensure_tiny_model` builds a model with
other settings (tests use short warm-ups) once into a cache directory keyed by a hash of every
setting, written atomically.
"""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import logging
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tlt_cli.models.tokenizer import build_char_tokenizer
from tlt_cli.tasks.arithmetic import CHARACTERS, ArithmeticTask, prompt_digits, step_totals, worked_solution
from tlt_cli.tasks.base import Problem, Task

LOGGER = logging.getLogger(__name__)
BUILTIN_TINY_MODEL = "builtin:tiny-arith"
# the committed folder `builtin:tiny-arith` names (made by scripts/make_tiny_model.py)
SHIPPED_TINY_MODEL = Path(__file__).resolve().parent / "tiny_arith"
# bump when the task, tokenizer or warm-up recipe changes, so old cached folders are not reused
TINY_MODEL_FORMAT = 4
# label value the loss ignores (prompt and padding positions)
IGNORED_LABEL = -100
ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}


@dataclass(frozen=True)
class WarmUpSettings:
    """How a tiny model is warmed up: the shipped one with these defaults (part of ensure_tiny_model's cache key).

    tail_exponent: the warm-up task's P(n) ~ n^-alpha (the RL task's default).
    slip_probability: the chance that a step of a worked solution has its total off by one.
    The defaults (2000 steps of 16 solutions, about 6 minutes on 2 CPU cores for the default
    8-layer model) teach the format, addition and the look-up of the first terms: sampled at
    temperature 1 the model solves about 80% of one-term problems (the rest are slips), 60% of
    two-term, 45% of four-term, 30% of five- to eight-term ones and almost none past sixteen, so
    the long responses are mostly wrong, as in real reasoning RL, and most GRPO groups differ in
    reward.
    """

    steps: int = 2000
    batch_size: int = 16
    learning_rate: float = 1e-3
    tail_exponent: float = 1.5
    slip_probability: float = 0.2


def default_cache_dir() -> Path:
    """$TLT_CACHE_DIR, else ~/.cache/tlt."""
    return Path(os.environ.get("TLT_CACHE_DIR", Path.home() / ".cache" / "tlt"))


def cache_directory(cache_dir: str | None) -> Path:
    """Where built models, measured plans and compiled DeepSpeed ops go: the recipe's model.cache_dir, else the
    default."""
    return Path(cache_dir).expanduser() if cache_dir else default_cache_dir()


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """The character tokenizer of the arithmetic task (specials first, then its characters)."""
    return build_char_tokenizer(CHARACTERS)


def tiny_model_config(
    tokenizer: PreTrainedTokenizerBase | None = None,
    architecture: str = "qwen2",
    hidden_size: int = 256,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = True,
) -> PretrainedConfig:
    """A Qwen2 (or Llama) config sized for CPU, with the tokenizer's vocabulary and special ids."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(ARCHITECTURES)}, got {architecture!r}.")
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    config_class, _ = ARCHITECTURES[architecture]
    return config_class(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(seed: int, config: PretrainedConfig | None = None) -> PreTrainedModel:
    """A randomly initialised causal LM for a copy of `config` (default: the tiny Qwen2), seeded."""
    config = copy.deepcopy(config) if config is not None else tiny_model_config()
    model_classes = {config_class: model_class for config_class, model_class in ARCHITECTURES.values()}
    torch.manual_seed(seed)
    model = model_classes[type(config)](config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    return model


def warm_up(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    slip_probability: float = 0.0,
) -> list[float]:
    """Supervised pass on worked solutions of arithmetic problems; returns the loss of every step.

    Each example is prompt + solution + EOS with the loss on the solution and EOS tokens only;
    the solution is the reference one with, per step, a slip of probability `slip_probability`
    (see `slipped_solution`).
    Batches are drawn from pools sorted by length so padding stays small despite the long tail.
    The learning rate warms up linearly over 10% of the steps, then decays on a cosine.
    """
    generator = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _warm_up_lr_scale(step, steps))
    model.train()
    losses = []
    batches = _length_sorted_batches(tokenizer, task, steps, batch_size, generator, slip_probability)
    for input_ids, attention_mask, labels in batches:
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return losses


def _warm_up_lr_scale(step: int, total_steps: int) -> float:
    warmup_steps = max(1, total_steps // 10)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine from 1 down to 0


def _length_sorted_batches(tokenizer, task, steps, batch_size, generator, slip_probability=0.0):
    """Yield `steps` padded batches; each pool of 32 batches is sorted by length, then shuffled."""
    pool_batches = 32
    problem_index = 0
    for pool_start in range(0, steps, pool_batches):
        pool_size = min(pool_batches, steps - pool_start)
        problems = [task.problem(problem_index + offset) for offset in range(pool_size * batch_size)]
        problem_index += len(problems)
        examples = [
            _supervised_example(tokenizer, problem.prompt, slipped_solution(problem, slip_probability, generator))
            for problem in problems
        ]
        examples.sort(key=lambda example: len(example[0]))  # by token count, so padding stays small
        chunks = [examples[start : start + batch_size] for start in range(0, len(examples), batch_size)]
        generator.shuffle(chunks)
        for chunk in chunks:
            yield pad_supervised_batch(chunk, tokenizer.pad_token_id)


def slipped_solution(problem: Problem, slip_probability: float, generator: random.Random) -> str:
    """The problem's worked solution where each step's total is, with `slip_probability`, one too
    high or one too low (staying within 0..18); the slipped total's ones digit is the running sum
    the next step adds to, so a slip carries into every later total and the answer."""
    if slip_probability == 0.0:
        return problem.solution

    def as_written(total: int) -> int:
        if generator.random() >= slip_probability:
            return total
        return total + 1 if total == 0 or (total < 18 and generator.random() < 0.5) else total - 1

    digits = prompt_digits(problem.prompt)
    return worked_solution(digits, step_totals(digits, as_written))


def _supervised_example(tokenizer, prompt: str, solution: str) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    solution_ids = tokenizer(solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids + solution_ids, [IGNORED_LABEL] * len(prompt_ids) + solution_ids


def pad_supervised_batch(examples, pad_token_id: int):
    """(input_ids, labels) examples right-padded to the longest: input_ids, attention_mask, labels, each [B, L]
    (labels IGNORED_LABEL where no loss is taken)."""
    longest = max(len(input_ids) for input_ids, _ in examples)
    input_rows, mask_rows, label_rows = [], [], []
    for input_ids, labels in examples:
        padding = longest - len(input_ids)
        input_rows.append(input_ids + [pad_token_id] * padding)
        mask_rows.append([1] * len(input_ids) + [0] * padding)
        label_rows.append(labels + [IGNORED_LABEL] * padding)
    return torch.tensor(input_rows), torch.tensor(mask_rows), torch.tensor(label_rows)


def tiny_model_key(seed: int, config: PretrainedConfig, settings: WarmUpSettings) -> str:
    """A short hash of everything that determines the built model."""
    description = {
        "format": TINY_MODEL_FORMAT,
        "seed": seed,
        "config": config.to_diff_dict(),
        "warm_up": asdict(settings),
        "characters": CHARACTERS,
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def ensure_tiny_model(
    cache_dir: Path | None = None,
    seed: int = 0,
    warmup_steps: int = WarmUpSettings.steps,
    config: PretrainedConfig | None = None,
) -> Path:
    """The folder of a warmed-up tiny model (default config and warm-up unless given), built first if the cache
    lacks it.

    The folder is `<cache_dir>/tiny-arith-<hash of settings>`; it is built in a temporary
    sibling and renamed into place, under a file lock so concurrent ranks build it once.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    config = config if config is not None else tiny_model_config()
    settings = WarmUpSettings(steps=warmup_steps)
    model_dir = cache_dir / f"tiny-arith-{tiny_model_key(seed, config, settings)}"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / f"{model_dir.name}.lock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released when the file closes
        if not (model_dir / "config.json").is_file():
            LOGGER.info("Building a tiny model into %s (once).", model_dir)
            model, tokenizer, _ = build_warmed_up_model(seed, config, settings)
            save_model_folder(model, tokenizer, model_dir)
    return model_dir


def build_warmed_up_model(
    seed: int, config: PretrainedConfig, settings: WarmUpSettings
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[float]]:
    """The tiny model built from `config` and warmed up on the arithmetic task; also the losses."""
    tokenizer = tiny_tokenizer()
    model = build_tiny_model(seed, config)
    task = ArithmeticTask(seed=seed, tail_exponent=settings.tail_exponent)
    losses = warm_up(
        model,
        tokenizer,
        task,
        settings.steps,
        settings.batch_size,
        settings.learning_rate,
        seed,
        settings.slip_probability,
    )
    return model, tokenizer, losses


def save_model_folder(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, model_dir: Path) -> None:
    """Save model and tokenizer into a temporary sibling of `model_dir`, then rename it into place.

    An existing `model_dir` is moved aside first and deleted only once the new folder is in place.
    """
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    staging_dir = Path(tempfile.mkdtemp(prefix=f".{model_dir.name}-", dir=model_dir.parent))
    previous_dir = model_dir.parent / f".{model_dir.name}-previous"
    try:
        model.save_pretrained(staging_dir)
        tokenizer.save_pretrained(staging_dir)
        if model_dir.exists():
            os.replace(model_dir, previous_dir)
        os.replace(staging_dir, model_dir)
    finally:
        shutil.rmtree(staging_dir, ignore_errors=True)
        shutil.rmtree(previous_dir, ignore_errors=True)
