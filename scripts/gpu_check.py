"""One command that checks tlt on a GPU (or the CPU): the engine against transformers' `generate`, and SD.

    python scripts/gpu_check.py --out gpu_check.json                  # about 5 minutes on one GPU
    python scripts/gpu_check.py --shape small --out gpu_check.json    # a small shape: a minute on a CPU

Needs only torch, transformers and tlt (nothing is downloaded). Two targets: a randomly initialised
(seeded) Qwen2 of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 key-value heads,
intermediate 4864, vocabulary 151936, tied embeddings; speed and identity do not depend on the
weights) or, with --shape small, a small Qwen2; and the built-in tiny model (builtin:tiny-arith).
Prompts are held-out problems of the built-in arithmetic task (for the random model, token ids of
the tiny tokenizer; its responses rarely end, so they run to --max-new-tokens). For each target:
  1. a drafter: the target's greedy answers to --train-prompts task prompts are collected and a
     drafter is trained on them for about --drafter-seconds (tlt_cli/drafter/warmup.py: the same
     collection, vocabulary, trainer and held-out agreement as a recipe's warm-up; the step count
     comes from timing a few steps of a throwaway drafter);
  2. for each batch size B of --batch-sizes: the pool of max(B, --prompts) prompts generated greedily
     in batches of B by transformers' `generate` (left-padded), the embedded engine with SD off, and
     the engine with each SD shape of --sd-configs; tokens per second (wall clock, the device
     synchronised), engine vs generate, SD vs plain, SD's accept length, and identity: "yes" when
     every response is token-identical to the engine's with SD off, "tie" when each that differs
     first differs where the target's top two logits tie within float32 rounding (as
     tlt_cli/bench/identity.py judges), else "NO".
The engine decodes the Qwen2 targets on its owned forward (tlt_cli/engine/llama_family.py): each target's
`decode_path` says so, and the untimed first pass of the plain engine runs with a pre-hook on every module of
the target that counts calls (`transformers_calls_in_owned_decode`, 0 when no transformers module ran).
Each method runs its first batch once untimed first (kernel selection, caches). Prints a table and
writes everything as JSON to --out (device, versions, shapes, the drafter's warm-up report, every
measurement, wall seconds). The device is cuda when available, else cpu (--device to choose).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import Qwen2Config, Qwen2ForCausalLM

from tlt_cli.bench.identity import TIE_TOLERANCE, first_divergences, same_verdict
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.trainer import DrafterTrainer
from tlt_cli.drafter.vocabulary import choose_vocabulary
from tlt_cli.drafter.warmup import (
    collect_warmup_data,
    encode_prompts,
    length_buckets,
    train_warmup_drafter,
)
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy
from tlt_cli.models.tiny import BUILTIN_TINY_MODEL, tiny_tokenizer
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.rules import parse_label
from tlt_cli.tasks.arithmetic import ArithmeticTask

# Qwen2 shapes of the random target: Qwen2.5-0.5B's, and a small one for a CPU check
SHAPES = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
    },
    "small": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1024,
    },
}
# held-out problems start here, far past the drafter's training prompts
FIRST_CHECK_PROBLEM = 100_000
# train steps timed on a throwaway drafter to size the real drafter's training to --drafter-seconds
PROBE_STEPS = 4
# drafter training: sequences per step, learning rate (the recipes' warm-up values)
DRAFTER_BATCH_SIZE = 8
DRAFTER_LR = 3e-3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b", help="the random target's shape")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch size at least (more when B is)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sd-configs", nargs="+", default=["s3-k1-t4", "s4-k2-t8"], help="SD shapes (labels)")
    parser.add_argument("--train-prompts", type=int, default=64, help="greedy answers the drafter trains on")
    parser.add_argument("--held-out-prompts", type=int, default=16, help="greedy answers its agreement is read on")
    parser.add_argument("--drafter-seconds", type=float, default=60.0, help="about how long each drafter trains")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    return parser.parse_args()


def random_target(shape: str, seed: int) -> Qwen2ForCausalLM:
    """A Qwen2 of `shape` with seeded random weights (tied embeddings, Qwen2.5's rope and norm)."""
    config = Qwen2Config(
        **SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def targets(args: argparse.Namespace) -> dict:
    """name -> (model on the device in eval mode, tokenizer): the random target and the built-in tiny model."""
    dtype = getattr(torch, args.dtype)
    tiny, tiny_tokens = load_policy(BUILTIN_TINY_MODEL)
    found = {
        f"random {args.shape}": (random_target(args.shape, args.seed), tiny_tokenizer()),
        "tiny": (tiny, tiny_tokens),
    }
    for model, tokenizer in found.values():
        model.to(device=args.device, dtype=dtype).eval()
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return found


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_drafter(target, tokenizer, task, args) -> tuple[EagleDrafter, dict]:
    """A drafter trained for about args.drafter_seconds on the target's greedy answers (the warm-up's code)."""
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    data = collect_warmup_data(target, tokenizer, task, args.train_prompts, args.held_out_prompts, greedy, args.seed)
    responses = [completion.response_ids for completion in data.train]
    vocabulary = choose_vocabulary(responses, 0, target.config.vocab_size, tokenizer.eos_token_id)
    buckets = length_buckets(data.train, data.train_prompt_states, DRAFTER_BATCH_SIZE, tokenizer.pad_token_id)
    probe = DrafterTrainer(EagleDrafter(target, seed=args.seed, vocabulary=vocabulary), lr=DRAFTER_LR)
    probe.train_step(buckets[0])  # the first step also selects kernels: not timed
    synchronize(args.device)
    start = time.perf_counter()
    for step in range(PROBE_STEPS):
        probe.train_step(buckets[step % len(buckets)])
    synchronize(args.device)
    steps = max(1, int(args.drafter_seconds / ((time.perf_counter() - start) / PROBE_STEPS)))
    drafter, report = train_warmup_drafter(target, tokenizer, data, steps, DRAFTER_BATCH_SIZE, DRAFTER_LR, args.seed)
    return drafter, asdict(report)


def engine_pass(engine: EmbeddedEngine, prompts: list[list[int]], batch_size: int, args) -> dict:
    """The engine's greedy responses to `prompts` in batches of `batch_size`, timed, with SD's accept length."""
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    responses, passes, emitted = [], 0, 0
    synchronize(args.device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        requests = [
            RolloutRequest(index, tuple(prompt)) for index, prompt in enumerate(prompts[first : first + batch_size])
        ]
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        for completion in engine.generate(requests, greedy, generator):
            responses.append(completion.response_ids)
            passes += completion.speculative.verify_passes
            emitted += completion.speculative.accepted_draft_tokens + completion.speculative.verify_passes
    synchronize(args.device)
    seconds = time.perf_counter() - start
    return {"responses": responses, "seconds": seconds, "accept_length": emitted / passes if passes else math.nan}


def generate_pass(target, tokenizer, prompts: list[list[int]], batch_size: int, args) -> dict:
    """transformers' greedy `generate` of `prompts` in left-padded batches of `batch_size`, timed; each
    response cut after its first EOS, as the engine's end."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = []
    synchronize(args.device)
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        longest = max(len(prompt) for prompt in chunk)
        input_ids = torch.tensor([[pad] * (longest - len(prompt)) + prompt for prompt in chunk], device=args.device)
        attention_mask = (
            torch.arange(longest, device=args.device)
            >= longest - torch.tensor([len(prompt) for prompt in chunk], device=args.device)[:, None]
        ).long()
        with torch.no_grad():
            output = target.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=args.max_new_tokens,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        responses += [row[: row.index(eos) + 1] if eos in row else row for row in output[:, longest:].tolist()]
    synchronize(args.device)
    return {"responses": responses, "seconds": time.perf_counter() - start, "accept_length": math.nan}


def identity(target, prompts, reference, responses) -> str:
    """'yes', 'tie' or 'NO' against the reference responses (tlt_cli/bench/identity.py's verdict; its check builds
    CPU inputs, so the target runs on them moved to its device)."""
    return same_verdict(first_divergences(lambda ids: target(ids.to(target.device)), prompts, reference, responses))


@contextlib.contextmanager
def counted_module_calls(model: torch.nn.Module) -> Iterator[list[int]]:
    """Within the block, [n]: how many times any module of `model` ran its forward."""
    calls = [0]

    def count(module, args) -> None:
        calls[0] += 1

    hooks = [module.register_forward_pre_hook(count) for module in model.modules()]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def check_batch_size(target, tokenizer, drafter, prompts, batch_size: int, args) -> dict:
    """Every method over the pool in batches of `batch_size`: tokens/s, ratios, accept length, identity."""
    methods = {"generate": lambda chunk, size: generate_pass(target, tokenizer, chunk, size, args)}
    for label in ["off", *args.sd_configs]:
        config = parse_label(label)
        speculative = SpeculativeDecoder(drafter, config) if config is not None else None
        engine = EmbeddedEngine(target, tokenizer.eos_token_id, tokenizer.pad_token_id, speculative=speculative)
        methods[label] = lambda chunk, size, engine=engine: engine_pass(engine, chunk, size, args)
    measured = {}
    module_calls = 0
    for name, run in methods.items():
        if name == "off":
            with counted_module_calls(target) as calls:
                run(prompts[:batch_size], batch_size)  # untimed: kernel selection, caches
            module_calls = calls[0]
        else:
            run(prompts[:batch_size], batch_size)  # untimed: kernel selection, caches
        measured[name] = run(prompts, batch_size)
    plain = measured["off"]
    rows = {}
    for name, result in measured.items():
        tokens = sum(len(response) for response in result["responses"])
        rows[name] = {
            "tokens": tokens,
            "seconds": result["seconds"],
            "tokens_per_second": tokens / result["seconds"],
            "accept_length": result["accept_length"],
            "same_as_plain": identity(target, prompts, plain["responses"], result["responses"]),
        }
    for row in rows.values():
        row["vs_plain"] = row["tokens_per_second"] / rows["off"]["tokens_per_second"]
    engine_vs_generate = rows["off"]["tokens_per_second"] / rows["generate"]["tokens_per_second"]
    return {
        "batch_size": batch_size,
        "prompts": len(prompts),
        "engine_vs_generate": engine_vs_generate,
        "transformers_calls_in_owned_decode": module_calls,
        "methods": rows,
    }


def check_target(name: str, target, tokenizer, args, console: Console) -> dict:
    task = ArithmeticTask(seed=args.seed)
    start = time.perf_counter()
    drafter, warmup = train_drafter(target, tokenizer, task, args)
    console.print(
        f"{name}: drafter trained {warmup['steps']} steps in {warmup['train_seconds']:.0f} s, held-out agreement "
        f"{warmup['held_out_accuracy']:.3f} (draft vocabulary {warmup['draft_vocab_size']})",
        highlight=False,
    )
    drafter.eval()
    batches = []
    for batch_size in args.batch_sizes:
        pool = max(batch_size, args.prompts)
        prompts = encode_prompts(tokenizer, task, range(FIRST_CHECK_PROBLEM, FIRST_CHECK_PROBLEM + pool))
        batches.append(check_batch_size(target, tokenizer, drafter, prompts, batch_size, args))
    parameters = sum(parameter.numel() for parameter in target.parameters())
    decode_path = EmbeddedEngine(target, tokenizer.eos_token_id, tokenizer.pad_token_id).decode_model.describe()
    console.print(f"{name}: {decode_path}", highlight=False)
    return {
        "config": target.config.to_diff_dict(),
        "decode_path": decode_path,
        "parameters": parameters,
        "drafter_warmup": warmup,
        "batches": batches,
        "seconds": time.perf_counter() - start,
    }


def render(console: Console, results: dict) -> None:
    table = Table(title=f"tlt on {results['device_name']} ({results['dtype']}, greedy)", title_justify="left")
    for column in ("target", "B", "method", "tokens/s", "vs plain engine", "accept", "same as plain"):
        table.add_column(column, justify="right")
    for name, target in results["targets"].items():
        for batch in target["batches"]:
            for method, row in batch["methods"].items():
                label = {"off": "engine", "generate": "generate"}.get(method, f"SD {method}")
                accept = "-" if math.isnan(row["accept_length"]) else f"{row['accept_length']:.2f}"
                table.add_row(
                    name,
                    str(batch["batch_size"]),
                    label,
                    f"{row['tokens_per_second']:.1f}",
                    f"{row['vs_plain']:.2f}x",
                    accept,
                    row["same_as_plain"],
                )
    console.print(table)


def main() -> None:
    args = parse_args()
    console = Console()
    start = time.perf_counter()
    results = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tie_tolerance": TIE_TOLERANCE,
        "arguments": {key: str(value) for key, value in vars(args).items()},
        "targets": {},
    }
    for name, (target, tokenizer) in targets(args).items():
        results["targets"][name] = check_target(name, target, tokenizer, args, console)
    if args.device.startswith("cuda"):
        results["peak_memory_bytes"] = torch.cuda.max_memory_allocated(args.device)
    results["seconds"] = time.perf_counter() - start
    render(console, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    console.print(f"wrote {args.out} ({results['seconds']:.0f} s)", highlight=False)


if __name__ == "__main__":
    main()
