"""The transformers path (models outside the owned Llama family) against transformers' `generate`, side by side.

    python scripts/bench_transformers_path.py --out benchmarks/bench_transformers_path.json

For each family (--families: GPT-2, Phi, sliding-window Mistral), a random-weight model of GPT-2 small's shape
(hidden 768, 12 layers, 12 heads, inner 3072, vocabulary 50257: 124M parameters for GPT-2) is built from a
config, saved to a temporary folder and loaded back from it (no download), and decoded greedily at one row,
one thread, forced to --max-new-tokens tokens from random prompts, by:
  - `generate`: transformers' own greedy generate;
  - `engine`: tlt's embedded engine on the transformers path, plain F.linear;
  - `engine+forms`: the same with this machine's measured linear-form plan (`rollout.linear_forms: auto`, as a
    worker runs it; measured into --cache-dir once per machine and model).
The methods alternate prompt by prompt over --rounds rounds after an untimed one; CPU seconds
(time.process_time: the figure least moved by other processes). Tokens are compared with `generate` at one
row and with the engine decoding --batch-size prompts in one batch. With --profile, one decode of each method
is split by torch.profiler into CPU milliseconds per token of matrix products, attention and everything else
(where the time goes; CPU time, so other processes' load does not count). Prints a table and writes JSON with
the ratios, the CPU, its flags and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from profile_plain_step import MATRIX_PRODUCTS, interleaved_cpu_seconds
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig, PhiConfig

from tlt_cli.engine.linear_forms import describe_plan
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.tuning.cache import matrix_flags, processor_name
from tlt_cli.tuning.linear_forms import measured_linear_plan

NEVER_EMITTED = -1  # an end-of-sequence id no token has: every response runs to max_new_tokens
METHODS = ("generate", "engine", "engine+forms")


def family_config(family: str, hidden: int, layers: int, heads: int, vocab_size: int):
    """The config of a `family` model of the given shape (inner width 4 x hidden), not of the owned Llama family."""
    if family == "gpt2":
        return GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=vocab_size, n_positions=1024)
    shape = dict(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        vocab_size=vocab_size,
        max_position_embeddings=1024,
    )
    if family == "phi":
        return PhiConfig(**shape, partial_rotary_factor=0.5, tie_word_embeddings=True)
    if family == "mistral-sliding":
        return MistralConfig(**shape, num_key_value_heads=heads // 4, sliding_window=32, tie_word_embeddings=True)
    raise SystemExit(f"unknown family {family!r}; use gpt2, phi or mistral-sliding.")


def saved_and_loaded(config, folder: Path, seed: int) -> torch.nn.Module:
    """A random-weight model of `config`, saved to `folder` and loaded back from it (as a user's checkpoint is)."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder).eval()


def compare_family(family: str, args: argparse.Namespace, console: Console) -> dict:
    """Tokens per CPU second of each method at one row, and whether each decodes what `generate` does."""
    config = family_config(family, args.hidden_size, args.layers, args.heads, args.vocab_size)
    with tempfile.TemporaryDirectory() as folder:
        model = saved_and_loaded(config, Path(folder), args.seed)
    plan = measured_linear_plan("auto", [model], args.cache_dir)
    console.print(f"{family}: {describe_plan(plan)}")
    engines = {
        "engine": EmbeddedEngine(model, NEVER_EMITTED, 0),
        "engine+forms": EmbeddedEngine(model, NEVER_EMITTED, 0, linear_plan=plan),
    }
    generator = torch.Generator().manual_seed(args.seed)
    prompt_count = max(args.prompts, args.batch_size)
    prompts = [
        torch.randint(0, args.vocab_size, (args.prompt_length,), generator=generator).tolist()
        for _ in range(prompt_count)
    ]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)

    def run_generate(prompt: list[int]) -> list[int]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.max_new_tokens,
                min_new_tokens=args.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
        return output[0, ids.shape[1] :].tolist()

    def run_engine(name: str, prompt: list[int]) -> list[int]:
        request = [RolloutRequest(0, tuple(prompt))]
        return list(engines[name].generate(request, sampling, torch.Generator())[0].response_ids)

    methods = {
        "generate": run_generate,
        "engine": lambda prompt: run_engine("engine", prompt),
        "engine+forms": lambda prompt: run_engine("engine+forms", prompt),
    }
    seconds, outputs = interleaved_cpu_seconds(methods, prompts[: args.prompts], args.rounds)
    tokens = (args.rounds - 1) * args.prompts * args.max_new_tokens
    references = [run_generate(prompt) for prompt in prompts[: args.batch_size]]
    batch = [RolloutRequest(row, tuple(prompt)) for row, prompt in enumerate(prompts[: args.batch_size])]
    batched = {
        name: [list(completion.response_ids) for completion in engine.generate(batch, sampling, torch.Generator())]
        for name, engine in engines.items()
    }
    breakdown = None
    if args.profile:
        breakdown = {name: cpu_split(method, prompts[0], args.max_new_tokens) for name, method in methods.items()}
        for name, split in breakdown.items():
            console.print(
                f"{family} {name}: CPU ms per token " + ", ".join(f"{key} {value:.1f}" for key, value in split.items())
            )
    return {
        "decode_breakdown": breakdown,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "decode_path": engines["engine+forms"].decode_model.describe(),
        "linear_forms": describe_plan(plan),
        "tokens_per_cpu_second": {name: tokens / seconds[name] for name in METHODS},
        "ratio_vs_generate": {name: seconds["generate"] / seconds[name] for name in METHODS},
        "same_tokens_as_generate_batch_1": {name: outputs[name] == outputs["generate"] for name in METHODS},
        "batch_size": args.batch_size,
        "same_tokens_as_generate_batched": {name: batched[name] == references for name in engines},
    }


def cpu_split(method, prompt: list[int], tokens: int) -> dict[str, float]:
    """CPU milliseconds per token of one `method(prompt)` (prefill included), by torch.profiler's self times: matrix
    products (mm, addmm), attention (scaled dot-product) and everything else."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        method(prompt)
    split = {"matrix products": 0.0, "attention": 0.0, "rest": 0.0}
    for event in profiler.key_averages():
        part = (
            "matrix products" if event.key in MATRIX_PRODUCTS else "attention" if "attention" in event.key else "rest"
        )
        split[part] += event.self_cpu_time_total / 1e3 / tokens
    return split


def render(report: dict, console: Console) -> None:
    table = Table(
        title=f"greedy decoding at one row, {report['threads']} thread(s), {report['processor']} "
        f"({', '.join(report['cpu_flags']) or 'no matrix flags'}), load {report['load_before'][0]:.1f}: "
        "tokens per CPU second (ratio vs generate)"
    )
    table.add_column("family")
    table.add_column("parameters", justify="right")
    for name in METHODS:
        table.add_column(name, justify="right")
    table.add_column("same tokens as generate (batch 1 / batched)")
    for family, result in report["families"].items():
        same_batched = result["same_tokens_as_generate_batched"]
        cells = [
            f"{result['tokens_per_cpu_second'][name]:.1f} ({result['ratio_vs_generate'][name]:.2f}x)"
            for name in METHODS
        ]
        identical = " ".join(
            f"{name}: {result['same_tokens_as_generate_batch_1'][name]}/{same_batched[name]}" for name in same_batched
        )
        table.add_row(family, f"{result['parameters'] / 1e6:.0f}M", *cells, identical)
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="gpt2,phi", help="comma-separated: gpt2, phi, mistral-sliding")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--prompts", type=int, default=3, help="prompts timed, one row each")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=4, help="rows of the batched token comparison")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the timed comparison, the first untimed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also split one decode of each method by op")
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir(), help="where the plan is cached")
    parser.add_argument("--out", type=Path, default=Path("bench_transformers_path.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "processor": processor_name(torch.device("cpu")),
        "cpu_flags": list(matrix_flags()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "load_before": list(os.getloadavg()),
        "families": {family: compare_family(family, args, console) for family in args.families.split(",")},
        "load_after": list(os.getloadavg()),
    }
    render(report, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
