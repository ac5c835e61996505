"""Full vs reduced draft vocabulary on a real model: warm-up time and agreement, accept length, draft step time.

    python scripts/bench_drafter_vocab.py --model ~/.cache/tlt/models/SmolLM2-135M-Instruct --out vocab.json

One collection of the target's own responses (tlt_cli/drafter/warmup.py `collect_warmup_data`:
sampled answers to the training prompts, greedy answers to held-out prompts, through the model's
chat template), then, for each draft vocabulary size N in --vocab-sizes (the target's whole
vocabulary, and reduced ones), a fresh drafter trained on that same collection with the same
settings (`train_warmup_drafter`). Per N it reports:
  - warm-up minutes: the shared collection plus this drafter's training and evaluation, and the
    training seconds per optimizer step;
  - held-out top-1 agreement with the target's greedy answers, and the vocabulary's coverage of them;
  - greedy chain SD (depth --depth) at batch 1 on --sd-prompts further prompts, never trained on:
    accept length (tokens per verify pass), time per draft step (a one-token drafter forward,
    measured by forward hooks during SD) and that step as a share of a plain target decode step,
    SD tokens/s against plain decoding, and whether SD's output is token-identical to plain decoding.
The methods take turns within each repeat (the machine is shared) and each keeps its fastest repeat.
Prints a table and writes everything to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.warmup import (
    collect_warmup_data,
    encode_prompts,
    train_warmup_drafter,
)
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion, RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.tasks.registry import build_task


@dataclass
class DecodeResult:
    """Greedy decoding of the SD prompts one at a time, by one method (plain, or SD with one drafter)."""

    tokens: int
    seconds: float
    accept_length: float | None
    draft_step_ms: float | None
    identical_to_plain: bool | None


class DraftStepTimer:
    """Wall-clock time of the drafter's one-token forwards (its draft steps), by forward hooks."""

    def __init__(self, drafter: EagleDrafter) -> None:
        self.durations: list[float] = []
        self._started: float | None = None
        self._handles = [drafter.register_forward_pre_hook(self._start), drafter.register_forward_hook(self._stop)]

    def _start(self, module, args) -> None:
        # args[0]: input_ids [B, T]; a draft step feeds one token per row
        self._started = time.perf_counter() if args[0].shape[1] == 1 else None

    def _stop(self, module, args, output) -> None:
        if self._started is not None:
            self.durations.append(time.perf_counter() - self._started)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a local Hugging Face folder (e.g. made by make_real_model.py)")
    parser.add_argument("--out", default="bench_drafter_vocab.json", help="where the JSON results go")
    parser.add_argument("--task", default="word_arithmetic", help="task whose prompts the drafter learns on")
    parser.add_argument(
        "--vocab-sizes",
        default="0,4096,49152",
        help="draft vocabulary sizes N (0: tlt's default for the model; the model's vocabulary "
        "size or more: the full vocabulary)",
    )
    parser.add_argument("--train-prompts", type=int, default=256, help="warm-up: prompts sampled")
    parser.add_argument("--held-out-prompts", type=int, default=48, help="warm-up: held-out prompts (greedy)")
    parser.add_argument("--steps", type=int, default=200, help="warm-up: optimizer steps per drafter")
    parser.add_argument("--batch-size", type=int, default=8, help="warm-up: sequences per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="warm-up: learning rate")
    parser.add_argument("--temperature", type=float, default=0.7, help="warm-up: sampling temperature")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="response length (warm-up and SD)")
    parser.add_argument("--sd-prompts", type=int, default=8, help="prompts decoded greedily at batch 1 per method")
    parser.add_argument("--depth", type=int, default=4, help="chain SD: tokens drafted per verify pass")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds over all methods; the fastest counts")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def decode(
    target, tokenizer, prompts: list[list[int]], max_new_tokens: int, drafter: EagleDrafter | None, depth: int
) -> tuple[list[Completion], float, list[float]]:
    """Greedy completions of `prompts` one at a time; (completions, seconds, draft step durations)."""
    speculative = SpeculativeDecoder(drafter, SpeculativeConfig(depth)) if drafter is not None else None
    engine = EmbeddedEngine(target, tokenizer.eos_token_id, tokenizer.pad_token_id, speculative=speculative)
    timer = DraftStepTimer(drafter) if drafter is not None else None
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    completions = []
    start = time.perf_counter()
    for index, prompt in enumerate(prompts):
        request = RolloutRequest(request_id=index, prompt_ids=tuple(prompt))
        completions += engine.generate([request], greedy, torch.Generator().manual_seed(0))
    seconds = time.perf_counter() - start
    durations = timer.durations if timer is not None else []
    if timer is not None:
        timer.remove()
    return completions, seconds, durations


def summarize(
    completions: list[Completion], seconds: float, durations: list[float], plain: list[Completion] | None
) -> DecodeResult:
    passes = sum(completion.speculative.verify_passes for completion in completions)
    accepted = sum(completion.speculative.accepted_draft_tokens for completion in completions)
    identical = (
        None
        if plain is None
        else all(mine.response_ids == reference.response_ids for mine, reference in zip(completions, plain))
    )
    return DecodeResult(
        tokens=sum(len(completion.response_ids) for completion in completions),
        seconds=seconds,
        accept_length=(accepted + passes) / passes if passes else None,
        draft_step_ms=1000 * sum(durations) / len(durations) if durations else None,
        identical_to_plain=identical,
    )


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=200)
    target, tokenizer = load_policy(args.model)
    task = build_task(args.task, args.seed, {})
    vocab_sizes = [int(size) for size in args.vocab_sizes.split(",")]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    console.print(f"collecting {args.train_prompts} sampled + {args.held_out_prompts} greedy responses ...")
    data = collect_warmup_data(target, tokenizer, task, args.train_prompts, args.held_out_prompts, sampling, args.seed)
    drafters, warmups = {}, {}
    for size in vocab_sizes:
        console.print(f"training the drafter with draft vocabulary {size} ...")
        drafter, report = train_warmup_drafter(
            target, tokenizer, data, args.steps, args.batch_size, args.lr, args.seed, draft_vocab_size=size
        )
        name = f"N={report.draft_vocab_size}"
        drafters[name], warmups[name] = drafter, report
    first_sd_prompt = args.train_prompts + args.held_out_prompts
    prompts = encode_prompts(tokenizer, task, range(first_sd_prompt, first_sd_prompt + args.sd_prompts))
    decodes = run_decodes(target, tokenizer, prompts, drafters, args)
    results = {
        "settings": vars(args),
        "warmup": {name: asdict(report) for name, report in warmups.items()},
        "decode": {name: asdict(result) for name, result in decodes.items()},
        "summary": {name: summary_row(report, decodes[name], decodes["plain"]) for name, report in warmups.items()},
    }
    render(console, results["summary"], decodes["plain"])
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=2)
    console.print(f"wrote {args.out}")


def run_decodes(target, tokenizer, prompts, drafters: dict[str, EagleDrafter], args) -> dict[str, DecodeResult]:
    """Plain decoding and SD with each drafter, in turns, `repeats` times; each keeps its fastest round."""
    best: dict[str, DecodeResult] = {}
    plain_completions = None
    for _ in range(args.repeats):
        completions, seconds, _ = decode(target, tokenizer, prompts, args.max_new_tokens, None, args.depth)
        plain_completions = completions
        candidate = summarize(completions, seconds, [], None)
        if "plain" not in best or candidate.seconds < best["plain"].seconds:
            best["plain"] = candidate
        for name, drafter in drafters.items():
            completions, seconds, durations = decode(
                target, tokenizer, prompts, args.max_new_tokens, drafter, args.depth
            )
            candidate = summarize(completions, seconds, durations, plain_completions)
            if name not in best or candidate.seconds < best[name].seconds:
                best[name] = candidate
    return best


def summary_row(report, result: DecodeResult, plain: DecodeResult) -> dict:
    """The table's row for one drafter: warm-up cost and agreement, then SD against plain decoding."""
    plain_ms_per_token = 1000 * plain.seconds / max(plain.tokens, 1)
    return {
        "warmup_minutes": (
            report.generate_seconds + report.prompt_seconds + report.train_seconds + report.evaluate_seconds
        )
        / 60,
        "train_seconds_per_step": report.train_seconds / max(report.steps, 1),
        "held_out_agreement": report.held_out_accuracy,
        "coverage": report.draft_vocab_coverage,
        "accept_length": result.accept_length,
        "draft_step_ms": result.draft_step_ms,
        "draft_step_over_plain_token": result.draft_step_ms / plain_ms_per_token,
        "sd_over_plain_tokens_per_second": (result.tokens / result.seconds) / (plain.tokens / plain.seconds),
        "identical_to_plain": result.identical_to_plain,
    }


def render(console: Console, summary: dict[str, dict], plain: DecodeResult) -> None:
    table = Table(
        title=f"draft vocabulary: warm-up, then greedy chain SD at batch 1 (plain decoding: "
        f"{plain.tokens / plain.seconds:.1f} tokens/s, {1000 * plain.seconds / plain.tokens:.0f} ms "
        f"per token)"
    )
    for column in (
        "drafter",
        "warm-up min",
        "train s/step",
        "held-out agreement",
        "coverage",
        "accept length",
        "draft step ms",
        "draft step / plain token",
        "SD / plain tokens/s",
        "identical",
    ):
        table.add_column(column, justify="right")
    for name, row in summary.items():
        table.add_row(
            name,
            f"{row['warmup_minutes']:.1f}",
            f"{row['train_seconds_per_step']:.2f}",
            f"{row['held_out_agreement']:.3f}",
            f"{row['coverage']:.3f}",
            f"{row['accept_length']:.2f}",
            f"{row['draft_step_ms']:.1f}",
            f"{row['draft_step_over_plain_token']:.2f}",
            f"{row['sd_over_plain_tokens_per_second']:.2f}x",
            str(row["identical_to_plain"]),
        )
    console.print(table)


if __name__ == "__main__":
    main()
