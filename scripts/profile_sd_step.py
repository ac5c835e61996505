"""Where one SD decode step's CPU time goes: target passes, drafter passes, and everything else.

Runs the embedded engine (linear forms on, as a worker runs it) on real-cpu's task with each SD configuration
in turn, interleaved over --rounds rounds (the first untimed), and prints per decode step the CPU
milliseconds in the target's forwards (decoder and head), in the drafter's, and the rest ("other": draft
trees and masks, n-gram proposals, acceptance, commit), from forward hooks as scripts/bench_rollout.py
splits them. At temperature 0 the rows are different prompts and each configuration's output is checked
against plain decoding's; sampled, the rows are one prompt's group (GRPO's G samples, so the n-gram index
has siblings). --cprofile prints the top functions of the last round per configuration.

    python scripts/profile_sd_step.py --configs 'off,s2-k1-t3,s4-k2-t8,s2-k1-t3+ngram4,s2-k1-t3|ngram4' \
        --batch-size 4 --temperature 0.7 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from tlt_cli.drafter.model import load_drafter
from tlt_cli.drafter.warmup import encode_prompts
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.rules import parse_label
from tlt_cli.tasks.registry import build_task
from tlt_cli.tuning.linear_forms import measured_linear_plan

CACHE = Path.home() / ".cache" / "tlt"
REAL_CPU_TASK = {"max_steps": 16, "max_number": 3, "tail_exponent": 2.5}
FIRST_PROBLEM = 100_000  # held-out prompts, as bench_rollout.py's


class HookTimer:
    """CPU seconds spent inside the forwards of some modules."""

    def __init__(self, modules) -> None:
        self.seconds, self._started = 0.0, 0.0
        for module in modules:
            module.register_forward_pre_hook(self._start)
            module.register_forward_hook(self._stop)

    def _start(self, module, args) -> None:
        self._started = time.process_time()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.process_time() - self._started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(CACHE / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--drafter", default=str(CACHE / "drafters" / "warmup-d17d1a3341ac7fc1"))
    parser.add_argument("--configs", default="off,s2-k1-t3,s4-k2-t8,ngram4,s2-k1-t3+ngram4,s2-k1-t3|ngram4")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_policy(args.model)
    drafter = load_drafter(args.drafter, target).eval()
    plan = measured_linear_plan("auto", [target, drafter], CACHE)
    task = build_task("word_arithmetic", 0, REAL_CPU_TASK)
    prompts = encode_prompts(tokenizer, task, range(FIRST_PROBLEM, FIRST_PROBLEM + args.batch_size))
    greedy = args.temperature == 0
    requests = [
        RolloutRequest(row, tuple(prompts[row] if greedy else prompts[0]), group=row if greedy else 0)
        for row in range(args.batch_size)
    ]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    target_timer = HookTimer([target.get_decoder(), target.get_output_embeddings()])
    drafter_timer = HookTimer([drafter])
    best, outputs = {}, {}
    for round_index in range(args.rounds):
        for label in args.configs.split(","):
            config = parse_label(label)
            speculative = SpeculativeDecoder(drafter, config) if config is not None else None
            engine = EmbeddedEngine(
                target, tokenizer.eos_token_id, tokenizer.pad_token_id, speculative=speculative, linear_plan=plan
            )
            steps = []
            target_timer.seconds = drafter_timer.seconds = 0.0
            profiler = cProfile.Profile() if args.cprofile and round_index == args.rounds - 1 else None
            started = time.process_time()
            if profiler is not None:
                profiler.enable()
            completions = engine.generate(
                requests, sampling, torch.Generator().manual_seed(0), on_decode_step=steps.append
            )
            if profiler is not None:
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                print(f"===== {label}\n{text.getvalue()}")
            seconds = time.process_time() - started
            outputs[label] = [completion.response_ids for completion in completions]
            tokens = sum(len(response) for response in outputs[label])
            measured = (seconds, target_timer.seconds, drafter_timer.seconds, len(steps), tokens)
            if round_index > 0 and (label not in best or seconds < best[label][0]):
                best[label] = measured
    print(f"B={args.batch_size} T={args.temperature}: CPU ms per decode step (best of {args.rounds - 1} rounds)")
    for label, (seconds, target_seconds, drafter_seconds, steps, tokens) in best.items():
        other = seconds - target_seconds - drafter_seconds
        same = "" if not greedy else f"  same as off: {outputs[label] == outputs.get('off')}"
        print(
            f"{label:18s} steps {steps:4d} tokens {tokens:4d}  total {1e3 * seconds / steps:6.1f}  target "
            f"{1e3 * target_seconds / steps:6.1f}  drafter {1e3 * drafter_seconds / steps:5.1f}  other "
            f"{1e3 * other / steps:5.1f}  tokens/CPU-s {tokens / seconds:5.1f}{same}"
        )


if __name__ == "__main__":
    main()
