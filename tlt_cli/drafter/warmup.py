"""Offline drafter warm-up before RL (as EAGLE trains its drafter): the target teaches its drafter.

`warm_up_drafter` runs four phases, each reported to an optional progress callback:
  1. generate: the embedded engine samples responses to the task's training prompts and answers
     the held-out prompts greedily, keeping the target's hidden state of every response token
     (so no second forward over the responses is needed);
  2. prompt states: one target forward over the prompts alone (length buckets) completes the
     hidden states;
  3. train: the draft vocabulary is chosen, the N tokens the target emitted most often in its
     training responses (tlt_cli/drafter/vocabulary.py; N from `draft_vocab_size`), and a fresh
     `EagleDrafter` over it takes `steps` optimizer steps on length buckets of the training
     sequences, the hidden states computed once and reused every step;
  4. evaluate: on held-out responses sampled as the rollout samples, before and after, the chance a
     draft token sampled at the rollout's temperature is accepted (sum_v min(p_v, q_v), what lossless
     sampling accepts: tlt_cli/drafter/loss.py) and top-1 agreement with the target.
`collect_warmup_data` (phases 1-2) and `train_warmup_drafter` (phases 3-4) are its two halves,
so several drafters can be trained on one collection. Prompts are encoded as the rollout encodes
them, through the model's chat template when it has one (tlt_cli/tasks/prompts.py).
Both are teacher-forced at draft depth 1 (the drafter given the target's true hidden state): the
agreement is greedy decoding's acceptance rate, the acceptance sampled decoding's. Called by the training
setup before the first RL step (tlt_cli/drafter/initial.py), `tlt drafter warmup` and the benchmarks.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tlt_cli.checkpoint import CheckpointError, load_checkpoint_file
from tlt_cli.drafter.loss import EAGLE_OBJECTIVE, DrafterObjective
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer, evaluate_drafter
from tlt_cli.drafter.vocabulary import choose_vocabulary, token_coverage
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.tasks.base import Task
from tlt_cli.tasks.prompts import encode_prompt

# held-out sequences per no-grad evaluation forward (its logits are [bucket, length, N])
EVALUATION_BUCKET_SIZE = 8
# prompts per target forward when completing the prompts' hidden states
PROMPT_BUCKET_SIZE = 16
# prompts the warm-up decodes at once. Every batch ends in a long tail of a few rows decoding up to max_new_tokens:
# batches of 32 on real-cpu (a loaded 2-core AMX Xeon) spent 180 of 250 s on their last 4 rows, and over 850 s on
# their last 10, so a warm-up's prompts (192 + 32 on real-cpu) go in one batch and pay one tail. (SmolLM2-135M on a
# 2-core avx512_bf16 EPYC sampled 96 tokens/s at 32 rows in bfloat16 against 46 in float32: BENCHMARKS.md, "A drafter
# that pays at T=0.7".)
GENERATION_ROWS = 256
# held-out prompts the warm-up samples and scores its drafter on
HELD_OUT_PROMPTS = 32
# the layout save_warmup_data writes (a file of another is sampled again)
WARMUP_DATA_FORMAT = 1
# held-out evaluations during training: every this many steps; training stops once the held-out accept length rose
# less than PLATEAU_GAIN over PLATEAU_EVALUATIONS evaluations, and the best drafter evaluated is kept
EVALUATE_EVERY = 50
PLATEAU_GAIN = 0.005
PLATEAU_EVALUATIONS = 3

# a warm-up report's "started_from" (training/setup.py `warm_up_into`) when it trained a fresh drafter
FRESH_START = "a fresh drafter"

# (phase, done, total): phase is one of "generate", "prompt states", "train", "evaluate"
WarmupProgress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class WarmupReport:
    """What the warm-up did and how well the drafter agrees with the target afterwards.

    train_tokens / held_out_tokens: drafter positions counted by the loss (response tokens);
    held_out_accuracy_before / held_out_accuracy: top-1 agreement with the target's next token on held-out
    responses before and after training; held_out_acceptance_before / held_out_acceptance: the chance a draft
    token sampled at the objective's temperature is accepted there; held_out_acceptance_by_depth: that chance for
    each draft token of a chain of the objective's depths, and held_out_accept_length the tokens a verify pass
    keeps from it (`HeldOutMetrics.accept_length`); final_train_loss: mean total loss of the last
    10 steps; draft_vocab_size: N; draft_vocab_coverage: the share of held-out response tokens in
    the draft vocabulary (a ceiling on the agreement); generate_seconds: sampling the responses;
    prompt_seconds: the prompts' hidden states; train_seconds: the steps and the evaluations among them;
    evaluate_seconds: the held-out evaluations before and after; learning_curve: (step, held-out acceptance, held-out
    accept length) at each evaluation during training; steps: the steps taken (fewer than asked when the accept
    length stopped rising).
    """

    steps: int
    steps_skipped: int
    train_sequences: int
    train_tokens: int
    held_out_sequences: int
    held_out_tokens: int
    held_out_accuracy_before: float
    held_out_accuracy: float
    held_out_acceptance_before: float
    held_out_acceptance: float
    held_out_acceptance_by_depth: list[float]
    held_out_accept_length: float
    held_out_loss: float
    final_train_loss: float
    draft_vocab_size: int
    draft_vocab_coverage: float
    generate_seconds: float
    prompt_seconds: float
    train_seconds: float
    evaluate_seconds: float
    learning_curve: list[tuple[int, float, float]] = field(default_factory=list)


def report_lines(report: dict, temperature: float) -> list[str]:
    """The console's lines on a finished warm-up (a `WarmupReport` as a dict with what it "started_from", as
    training/setup.py `warm_up_into` returns it), sampled at `temperature`."""
    by_depth = ", ".join(f"{acceptance:.1%}" for acceptance in report["held_out_acceptance_by_depth"])
    curve = ", ".join(f"{step}: {accept_length:.2f}" for step, _, accept_length in report["learning_curve"])
    trained = "" if report["started_from"] == FRESH_START else f" (trained further: {report['started_from']})"
    return [
        f"drafter warmed up{trained}: a sampled draft token is accepted {report['held_out_acceptance']:.1%} of the "
        f"time on held-out responses at T={temperature:g} (from {report['held_out_acceptance_before']:.1%}), top-1 "
        f"agreement {report['held_out_accuracy']:.1%}",
        f"draft tokens 1, 2, ... of a chain accepted {by_depth}: about {report['held_out_accept_length']:.2f} tokens "
        "a verify pass",
        f"held-out accept length by step ({report['steps']} steps taken): {curve}",
    ]


def encode_prompts(tokenizer: PreTrainedTokenizerBase, task: Task, indices: range) -> list[list[int]]:
    """Token ids of the task's prompts at `indices`, encoded as the rollout encodes them
    (through the model's chat template when it has one: tlt_cli/tasks/prompts.py)."""
    return [encode_prompt(tokenizer, task.problem(index).prompt) for index in indices]


def generate_responses(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    sampling: SamplingParams,
    seed: int,
) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) pairs from the embedded engine; responses end with EOS when finished."""
    completions = sample_completions(target, tokenizer, prompts, sampling, seed, return_hidden=False)
    return [(list(completion.prompt_ids), completion.response_ids) for completion in completions]


def sample_completions(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    sampling: SamplingParams,
    seed: int,
    return_hidden: bool,
    on_finished: Callable[[int], None] | None = None,
    dtype: torch.dtype | None = None,
    rows: int | None = None,
) -> list[Completion]:
    """The engine's completions of `prompts`, in order, decoded in `dtype` (None: the model's own), `rows` prompts
    at a time (None: all at once); on_finished(count done) as each one ends."""
    engine = EmbeddedEngine(
        target, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype=dtype
    )
    requests = [RolloutRequest(request_id=index, prompt_ids=tuple(prompt)) for index, prompt in enumerate(prompts)]
    finished = 0

    def count_finished(completion: Completion) -> None:
        nonlocal finished
        finished += 1
        if on_finished is not None:
            on_finished(finished)

    generator = torch.Generator(device=target.device).manual_seed(seed)
    chunk = rows or max(len(requests), 1)
    completions: list[Completion] = []
    for start in range(0, len(requests), chunk):
        completions += engine.generate(
            requests[start : start + chunk],
            sampling,
            generator,
            on_request_finished=count_finished,
            return_hidden=return_hidden,
        )
    return completions


@torch.no_grad()
def prompt_hidden_states(target: PreTrainedModel, prompts: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The target's last hidden state at every prompt position, [P_i, H] per prompt (right-padded
    buckets of similar length, one forward each)."""
    order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
    states: list[torch.Tensor | None] = [None] * len(prompts)
    for start in range(0, len(order), PROMPT_BUCKET_SIZE):
        bucket = order[start : start + PROMPT_BUCKET_SIZE]
        length = max(len(prompts[index]) for index in bucket)
        input_ids = torch.zeros((len(bucket), length), dtype=torch.long)
        attention_mask = torch.zeros((len(bucket), length), dtype=torch.long)
        for row, index in enumerate(bucket):
            input_ids[row, : len(prompts[index])] = torch.tensor(prompts[index])
            attention_mask[row, : len(prompts[index])] = 1
        hidden = target.get_decoder()(
            input_ids=input_ids.to(target.device), attention_mask=attention_mask.to(target.device)
        ).last_hidden_state
        for row, index in enumerate(bucket):
            states[index] = hidden[row, : len(prompts[index])]
    return states


def drafter_batch(completions: list[Completion], prompt_states: list[torch.Tensor], pad_token_id: int) -> DrafterBatch:
    """A right-padded DrafterBatch of whole sequences, from hidden states already computed: the
    prompt's from `prompt_hidden_states` up to position P-2, then the engine's for positions P-1
    on (the state that produced each response token). The last token's own state is never read
    (the feature it would feed predicts past the end), so it is left zero."""
    length = max(len(completion.prompt_ids) + len(completion.response_ids) for completion in completions)
    hidden_size = prompt_states[0].shape[-1]
    device, dtype = prompt_states[0].device, prompt_states[0].dtype
    sequences = torch.full((len(completions), length), pad_token_id, dtype=torch.long, device=device)
    hidden = torch.zeros((len(completions), length, hidden_size), dtype=dtype, device=device)
    response_mask = torch.zeros((len(completions), length), dtype=torch.bool, device=device)
    attention_mask = torch.zeros_like(response_mask)
    for row, (completion, prompt_state) in enumerate(zip(completions, prompt_states)):
        prompt_length, end = len(completion.prompt_ids), len(completion.prompt_ids) + len(completion.response_ids)
        sequences[row, :end] = torch.tensor(list(completion.prompt_ids) + completion.response_ids, device=device)
        hidden[row, : prompt_length - 1] = prompt_state[: prompt_length - 1]
        hidden[row, prompt_length - 1 : end - 1] = completion.target_hidden
        response_mask[row, prompt_length:end] = True
        attention_mask[row, :end] = True
    return DrafterBatch.from_sequences(sequences, hidden, response_mask, attention_mask)


def length_buckets(
    completions: list[Completion], prompt_states: list[torch.Tensor], bucket_size: int, pad_token_id: int
) -> list[DrafterBatch]:
    """DrafterBatches of `bucket_size` sequences of similar length (little padding)."""

    def sequence_length(index: int) -> int:
        return len(completions[index].prompt_ids) + len(completions[index].response_ids)

    order = sorted(range(len(completions)), key=sequence_length)
    return [
        drafter_batch([completions[index] for index in chunk], [prompt_states[index] for index in chunk], pad_token_id)
        for chunk in (order[start : start + bucket_size] for start in range(0, len(order), bucket_size))
    ]


@dataclass(frozen=True)
class HeldOutMetrics:
    """Token-weighted means over held-out buckets: accuracy (top-1 agreement with the target's argmax),
    acceptance (the chance a sampled draft token is accepted at the objective's temperature), loss (total), and
    acceptance_by_depth: the acceptance of the 1st, 2nd, ... draft token of a chain (the objective's depths)."""

    accuracy: float
    acceptance: float
    loss: float
    acceptance_by_depth: tuple[float, ...]

    @property
    def accept_length(self) -> float:
        """Tokens a verify pass keeps from a chain of len(acceptance_by_depth) drafts, taking each depth's
        acceptance as independent of the others: 1 + a1 + a1*a2 + ..."""
        return 1.0 + sum(
            math.prod(self.acceptance_by_depth[:depth]) for depth in range(1, len(self.acceptance_by_depth) + 1)
        )


def held_out_metrics(
    drafter: EagleDrafter, buckets: list[DrafterBatch], objective: DrafterObjective = EAGLE_OBJECTIVE
) -> HeldOutMetrics:
    """HeldOutMetrics of `drafter` over held-out buckets, against the target's whole-vocabulary distribution."""
    losses = [evaluate_drafter(drafter, bucket, None, objective) for bucket in buckets]

    def mean(name: str, depth: int = 0) -> float:
        at_depth = [loss.by_depth[depth] for loss in losses]
        tokens = max(sum(loss.token_count for loss in at_depth), 1)
        return sum(float(getattr(loss, name)) * loss.token_count for loss in at_depth) / tokens

    by_depth = tuple(mean("acceptance", depth) for depth in range(objective.depths))
    return HeldOutMetrics(mean("accuracy"), by_depth[0], mean("total"), by_depth)


def train_on_buckets(
    trainer: DrafterTrainer,
    buckets: list[DrafterBatch],
    steps: int,
    seed: int,
    progress: WarmupProgress | None = None,
    evaluate: Callable[[], float] | None = None,
    start_score: float | None = None,
) -> list[float]:
    """Up to `steps` train steps, each on a bucket drawn uniformly (seeded), the learning rate decaying on a
    cosine from the trainer's to a tenth of it; returns each step's total loss. With `evaluate` (a held-out
    score, higher is better), it is called every EVALUATE_EVERY steps: training stops once the score rose less
    than PLATEAU_GAIN over PLATEAU_EVALUATIONS evaluations, and the drafter is left at its best-scored weights;
    start_score: the starting weights' score (a drafter trained further), which they keep unless training beats it."""
    generator = torch.Generator().manual_seed(seed)
    choices = torch.randint(0, len(buckets), (steps,), generator=generator).tolist()
    base_lr = trainer.optimizer.param_groups[0]["lr"]
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(trainer.optimizer, T_max=max(steps, 1), eta_min=0.1 * base_lr)
    losses: list[float] = []
    scores: list[float] = []
    best: tuple[float, dict] | None = None
    if start_score is not None:
        best = (start_score, copy.deepcopy(trainer.drafter.state_dict()))
    for step, choice in enumerate(choices, start=1):
        losses.append(float(trainer.train_step(buckets[choice]).total))
        schedule.step()
        if progress is not None:
            progress("train", step, steps)
        if evaluate is None or (step % EVALUATE_EVERY != 0 and step != steps):
            continue
        scores.append(evaluate())
        if best is None or scores[-1] > best[0]:
            best = (scores[-1], copy.deepcopy(trainer.drafter.state_dict()))
        if len(scores) > PLATEAU_EVALUATIONS and max(scores[-PLATEAU_EVALUATIONS:]) < (
            scores[-PLATEAU_EVALUATIONS - 1] + PLATEAU_GAIN
        ):
            break
    if best is not None:
        trainer.drafter.load_state_dict(best[1])
    return losses


def counted_tokens(buckets: list[DrafterBatch]) -> int:
    return sum(int(bucket.loss_mask.sum()) for bucket in buckets)


@dataclass
class WarmupData:
    """What phases 1 and 2 produce: the target's sampled responses to the training prompts and its
    greedy answers to the held-out prompts, each with its hidden states (the engine's for the
    response, `prompt_hidden_states` for the prompt), and how long each phase took. Any number of
    drafters can be trained on the same data (BENCHMARKS.md compares vocabularies this way)."""

    train: list[Completion]
    held_out: list[Completion]
    train_prompt_states: list[torch.Tensor]
    held_out_prompt_states: list[torch.Tensor]
    generate_seconds: float
    prompt_seconds: float


def save_warmup_data(data: WarmupData, path: Path) -> None:
    """Write phases 1 and 2's data to `path` as plain tensors and numbers, atomically (temp file + rename), so a
    warm-up stopped in training resumes there (`load_warmup_data`)."""
    plain = {
        "format": WARMUP_DATA_FORMAT,
        "generate_seconds": data.generate_seconds,
        "prompt_seconds": data.prompt_seconds,
        "train_prompt_states": data.train_prompt_states,
        "held_out_prompt_states": data.held_out_prompt_states,
        **{
            part: [_plain_completion(completion) for completion in getattr(data, part)]
            for part in ("train", "held_out")
        },
    }
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(plain, temporary)
    os.replace(temporary, path)


def load_warmup_data(path: Path) -> WarmupData | None:
    """The data `save_warmup_data` wrote, or None when there is none or it does not read back whole."""
    if not path.is_file():
        return None
    try:
        plain = load_checkpoint_file(path)
        if plain.get("format") != WARMUP_DATA_FORMAT:
            return None
        parts = {part: [_completion(entry) for entry in plain[part]] for part in ("train", "held_out")}
        return WarmupData(
            parts["train"],
            parts["held_out"],
            plain["train_prompt_states"],
            plain["held_out_prompt_states"],
            plain["generate_seconds"],
            plain["prompt_seconds"],
        )
    except (CheckpointError, KeyError, TypeError, AttributeError):
        return None


def _plain_completion(completion: Completion) -> dict:
    return {
        "prompt_ids": torch.tensor(completion.prompt_ids),
        "response_ids": torch.tensor(completion.response_ids),
        "finished_by_eos": completion.finished_by_eos,
        "target_hidden": completion.target_hidden,
    }


def _completion(entry: dict) -> Completion:
    return Completion(
        request_id=0,
        prompt_ids=tuple(entry["prompt_ids"].tolist()),
        response_ids=entry["response_ids"].tolist(),
        finished_by_eos=entry["finished_by_eos"],
        start=0.0,
        end=0.0,
        target_hidden=entry["target_hidden"],
    )


def collect_warmup_data(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    train_prompts: int,
    held_out_prompts: int,
    sampling: SamplingParams,
    seed: int,
    progress: WarmupProgress | None = None,
    dtype: torch.dtype | None = None,
    first_prompt: int = 0,
) -> WarmupData:
    """Phases 1 and 2: sampled training responses (task prompts first_prompt.. on, train_prompts of them) and
    held-out responses sampled alike (the next held_out_prompts prompts, in the same batch), with their hidden
    states (float32). dtype: what the engine decodes in (None: the model's own), GENERATION_ROWS prompts at a time;
    first_prompt: where in the task's prompts to start (a warm-up that trains a held drafter further samples
    prompts it has not trained on)."""
    start = time.perf_counter()
    prompts = encode_prompts(tokenizer, task, range(first_prompt, first_prompt + train_prompts + held_out_prompts))
    report = (lambda done: progress("generate", done, len(prompts))) if progress is not None else None
    if report is not None:
        # the bar (and its clock) starts now, not when the first response ends
        report(0)
    # one batch for both (up to GENERATION_ROWS rows in flight): each batch ends with its own long tail of a few
    # rows decoding to max_new_tokens, so fewer batches is fewer tails
    completions = sample_completions(target, tokenizer, prompts, sampling, seed, True, report, dtype, GENERATION_ROWS)
    train, held_out = completions[:train_prompts], completions[train_prompts:]
    for completion in train + held_out:
        completion.target_hidden = completion.target_hidden.float()
    generate_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if progress is not None:
        progress("prompt states", 0, 1)
    train_states = prompt_hidden_states(target, [completion.prompt_ids for completion in train])
    held_out_states = prompt_hidden_states(target, [completion.prompt_ids for completion in held_out])
    if progress is not None:
        progress("prompt states", 1, 1)
    return WarmupData(train, held_out, train_states, held_out_states, generate_seconds, time.perf_counter() - start)


def train_warmup_drafter(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    data: WarmupData,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    weight_decay: float = 0.1,
    draft_vocab_size: int = 0,
    objective: DrafterObjective = EAGLE_OBJECTIVE,
    progress: WarmupProgress | None = None,
    start: EagleDrafter | None = None,
) -> tuple[EagleDrafter, WarmupReport]:
    """Phases 3 and 4 on collected data: a fresh drafter over the chosen vocabulary (or `start`, trained further
    over its own vocabulary, never left worse on the held-out responses than it came), trained `steps` steps with
    `objective` on length buckets of `batch_size` sequences, evaluated on the held-out responses."""
    pad_token_id = tokenizer.pad_token_id
    train_buckets = length_buckets(data.train, data.train_prompt_states, batch_size, pad_token_id)
    held_out_buckets = length_buckets(data.held_out, data.held_out_prompt_states, EVALUATION_BUCKET_SIZE, pad_token_id)
    drafter = start if start is not None else fresh_warmup_drafter(target, tokenizer, data, draft_vocab_size, seed)
    vocabulary = drafter.vocabulary
    drafter.train()
    trainer = DrafterTrainer(drafter, lr=lr, weight_decay=weight_decay, objective=objective)
    evaluate_start = time.perf_counter()
    before = held_out_metrics(drafter, held_out_buckets, objective)
    evaluate_seconds = time.perf_counter() - evaluate_start
    train_start = time.perf_counter()

    learning_curve: list[tuple[int, float, float]] = []

    def held_out_accept_length() -> float:
        metrics = held_out_metrics(drafter, held_out_buckets, objective)
        learning_curve.append((trainer.steps_taken + trainer.steps_skipped, metrics.acceptance, metrics.accept_length))
        return metrics.accept_length

    start_score = before.accept_length if start is not None else None
    step_losses = train_on_buckets(trainer, train_buckets, steps, seed, progress, held_out_accept_length, start_score)
    train_seconds = time.perf_counter() - train_start
    evaluate_start = time.perf_counter()
    if progress is not None:
        progress("evaluate", 0, 1)
    after = held_out_metrics(drafter, held_out_buckets, objective)
    if progress is not None:
        progress("evaluate", 1, 1)
    evaluate_seconds += time.perf_counter() - evaluate_start
    drafter.eval()
    last_losses = step_losses[-10:]
    return drafter, WarmupReport(
        steps=len(step_losses),
        steps_skipped=trainer.steps_skipped,
        train_sequences=len(data.train),
        train_tokens=counted_tokens(train_buckets),
        held_out_sequences=len(data.held_out),
        held_out_tokens=counted_tokens(held_out_buckets),
        held_out_accuracy_before=before.accuracy,
        held_out_accuracy=after.accuracy,
        held_out_acceptance_before=before.acceptance,
        held_out_acceptance=after.acceptance,
        held_out_acceptance_by_depth=list(after.acceptance_by_depth),
        held_out_accept_length=after.accept_length,
        held_out_loss=after.loss,
        final_train_loss=sum(last_losses) / max(len(last_losses), 1),
        draft_vocab_size=vocabulary.size,
        draft_vocab_coverage=token_coverage([completion.response_ids for completion in data.held_out], vocabulary),
        generate_seconds=data.generate_seconds,
        prompt_seconds=data.prompt_seconds,
        train_seconds=train_seconds,
        evaluate_seconds=evaluate_seconds,
        learning_curve=learning_curve,
    )


def fresh_warmup_drafter(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, data: WarmupData, draft_vocab_size: int, seed: int
) -> EagleDrafter:
    """A fresh drafter over the N tokens the target emitted most often in the training responses."""
    vocabulary = choose_vocabulary(
        [completion.response_ids for completion in data.train],
        draft_vocab_size,
        target.config.vocab_size,
        tokenizer.eos_token_id,
    )
    return EagleDrafter(target, seed=seed, vocabulary=vocabulary)


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
    draft_vocab_size: int = 0,
    objective: DrafterObjective = EAGLE_OBJECTIVE,
    progress: WarmupProgress | None = None,
) -> tuple[EagleDrafter, WarmupReport]:
    """Train a fresh drafter on the target's own sampled responses to `task` (temperature given).

    draft_vocab_size: N, the recipe's drafter.vocab_size (0: the default for the target's vocabulary, see
    tlt_cli/drafter/vocabulary.py; at least V: the full vocabulary).

    Example:
        drafter, report = warm_up_drafter(policy, tokenizer, ArithmeticTask(seed=0), steps=600,
                                          batch_size=16, lr=1e-3, seed=0)
    """
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    data = collect_warmup_data(target, tokenizer, task, train_prompts, held_out_prompts, sampling, seed, progress)
    return train_warmup_drafter(
        target, tokenizer, data, steps, batch_size, lr, seed, weight_decay, draft_vocab_size, objective, progress
    )
