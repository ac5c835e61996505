"""Offline drafter warm-up before RL (as EAGLE trains its drafter): the target teaches its drafter.

`warm_up_drafter` samples responses from the target on a task's prompts with the embedded
engine, collects the target's hidden states with one forward per length bucket, trains a fresh
`EagleDrafter` for a number of steps, and measures its top-1 agreement with the target on
held-out greedy generations. That agreement
is the teacher-forced greedy acceptance rate at draft depth 1: the fraction of response tokens
where the drafter, given the target's true hidden state, proposes exactly the target's argmax.
Called by the training setup before the first RL step, and by the benchmark scripts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer, collect_drafter_batch, evaluate_drafter
from tlt_cli.rollout.engine import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest, SamplingParams
from tlt_cli.tasks.base import Task

# held-out sequences per no-grad evaluation forward
EVALUATION_BUCKET_SIZE = 64


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up did and how well the drafter agrees with the target afterwards.

    train_tokens / held_out_tokens: drafter positions counted by the loss (response tokens);
    held_out_accuracy_before / held_out_accuracy: top-1 agreement with the greedy target on
    held-out generations before and after training; final_train_loss: mean total loss of the
    last 10 steps; generate_seconds: sampling + hidden-state collection; train_seconds: the steps.
    """

    steps: int
    steps_skipped: int
    train_sequences: int
    train_tokens: int
    held_out_sequences: int
    held_out_tokens: int
    held_out_accuracy_before: float
    held_out_accuracy: float
    held_out_loss: float
    final_train_loss: float
    generate_seconds: float
    train_seconds: float


def encode_prompts(tokenizer: PreTrainedTokenizerBase, task: Task, indices: range) -> list[list[int]]:
    """Token ids of the task's prompts at `indices` (no special tokens added)."""
    return [tokenizer(task.problem(index).prompt, add_special_tokens=False)["input_ids"] for index in indices]


def generate_responses(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    sampling: SamplingParams,
    seed: int,
) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs from the embedded engine; responses end with EOS when finished."""
    engine = EmbeddedEngine(target, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    requests = [RolloutRequest(request_id=index, prompt_ids=tuple(prompt)) for index, prompt in enumerate(prompts)]
    completions = engine.generate(requests, sampling, torch.Generator(device=target.device).manual_seed(seed))
    return [(list(completion.prompt_ids), completion.response_ids) for completion in completions]


def collect_length_buckets(
    target: PreTrainedModel, pairs: list[tuple[list[int], list[int]]], bucket_size: int, pad_token_id: int
) -> list[DrafterBatch]:
    """DrafterBatches of `bucket_size` sequences of similar length (little padding), one forward each."""
    ordered = sorted(pairs, key=lambda pair: len(pair[0]) + len(pair[1]))
    return [
        collect_right_padded(target, ordered[start : start + bucket_size], pad_token_id)
        for start in range(0, len(ordered), bucket_size)
    ]


def collect_right_padded(
    target: PreTrainedModel, pairs: list[tuple[list[int], list[int]]], pad_token_id: int
) -> DrafterBatch:
    length = max(len(prompt) + len(response) for prompt, response in pairs)
    sequences = torch.full((len(pairs), length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((len(pairs), length), dtype=torch.bool)
    attention_mask = torch.zeros((len(pairs), length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(pairs):
        end = len(prompt) + len(response)
        sequences[row, :end] = torch.tensor(prompt + response)
        response_mask[row, len(prompt) : end] = True
        attention_mask[row, :end] = True
    device = target.device
    return collect_drafter_batch(target, sequences.to(device), response_mask.to(device), attention_mask.to(device))


def held_out_metrics(drafter: EagleDrafter, buckets: list[DrafterBatch]) -> tuple[float, float]:
    """Token-weighted (accuracy, loss) over held-out buckets."""
    losses = [evaluate_drafter(drafter, bucket) for bucket in buckets]
    tokens = sum(loss.token_count for loss in losses)
    accuracy = sum(float(loss.accuracy) * loss.token_count for loss in losses) / max(tokens, 1)
    total = sum(float(loss.total) * loss.token_count for loss in losses) / max(tokens, 1)
    return accuracy, total


def train_on_buckets(
    trainer: DrafterTrainer, buckets: list[DrafterBatch], steps: int, seed: int
) -> list[float]:
    """`steps` train steps, each on a bucket drawn uniformly (seeded), the learning rate decaying
    on a cosine from the trainer's to a tenth of it; returns each step's total loss."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.randint(0, len(buckets), (steps,), generator=generator).tolist()
    base_lr = trainer.optimizer.param_groups[0]["lr"]
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(
        trainer.optimizer, T_max=max(steps, 1), eta_min=0.1 * base_lr
    )
    losses = []
    for choice in choices:
        losses.append(float(trainer.train_step(buckets[choice]).total))
        schedule.step()
    return losses


def collect_warmup_buckets(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    train_prompts: int,
    held_out_prompts: int,
    batch_size: int,
    sampling: SamplingParams,
    seed: int,
) -> tuple[list[DrafterBatch], list[DrafterBatch]]:
    """Training buckets (sampled responses to problems 0..train_prompts-1, `batch_size` sequences
    each) and held-out buckets (greedy responses to the next held_out_prompts problems)."""
    train_prompt_ids = encode_prompts(tokenizer, task, range(train_prompts))
    held_out_prompt_ids = encode_prompts(tokenizer, task, range(train_prompts, train_prompts + held_out_prompts))
    greedy = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    train_pairs = generate_responses(target, tokenizer, train_prompt_ids, sampling, seed)
    held_out_pairs = generate_responses(target, tokenizer, held_out_prompt_ids, greedy, seed)
    return (
        collect_length_buckets(target, train_pairs, batch_size, tokenizer.pad_token_id),
        collect_length_buckets(target, held_out_pairs, EVALUATION_BUCKET_SIZE, tokenizer.pad_token_id),
    )


def counted_tokens(buckets: list[DrafterBatch]) -> int:
    return sum(int(bucket.loss_mask.sum()) for bucket in buckets)


def warm_up_drafter(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    train_prompts: int = 1024,
    held_out_prompts: int = 64,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    weight_decay: float = 0.1,
) -> tuple[EagleDrafter, WarmupReport]:
    """Train a fresh drafter on the target's own sampled responses to `task` (temperature given).

    Example:
        drafter, report = warm_up_drafter(policy, tokenizer, ArithmeticTask(seed=0), steps=600,
                                          batch_size=16, lr=1e-3, seed=0)
    """
    generate_start = time.perf_counter()
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    train_buckets, held_out_buckets = collect_warmup_buckets(
        target, tokenizer, task, train_prompts, held_out_prompts, batch_size, sampling, seed
    )
    generate_seconds = time.perf_counter() - generate_start
    drafter = EagleDrafter(target, seed=seed)
    trainer = DrafterTrainer(drafter, lr=lr, weight_decay=weight_decay)
    accuracy_before, _ = held_out_metrics(drafter, held_out_buckets)
    train_start = time.perf_counter()
    step_losses = train_on_buckets(trainer, train_buckets, steps, seed)
    train_seconds = time.perf_counter() - train_start
    accuracy_after, held_out_loss = held_out_metrics(drafter, held_out_buckets)
    drafter.eval()
    last_losses = step_losses[-10:]
    return drafter, WarmupReport(
        steps=steps,
        steps_skipped=trainer.steps_skipped,
        train_sequences=sum(bucket.size for bucket in train_buckets),
        train_tokens=counted_tokens(train_buckets),
        held_out_sequences=sum(bucket.size for bucket in held_out_buckets),
        held_out_tokens=counted_tokens(held_out_buckets),
        held_out_accuracy_before=accuracy_before,
        held_out_accuracy=accuracy_after,
        held_out_loss=held_out_loss,
        final_train_loss=sum(last_losses) / max(len(last_losses), 1),
        generate_seconds=generate_seconds,
        train_seconds=train_seconds,
    )
