"""Rollout throughput of the embedded engine: SD off vs chain vs tree, and vs transformers' assisted generation.

    python scripts/bench_rollout.py --out bench_rollout.json
    python scripts/bench_rollout.py --model ~/.cache/tlt/models/SmolLM2-135M-Instruct --drafter <folder> --out real.json

Target: `builtin:tiny-arith` (held-out arithmetic prompts), or with --model a Hugging Face folder: real chat
prompts (short math and word questions written below) through the model's chat template, batch sizes 1 and
4, plus a long-tailed batch of 16 requests (one-word answers to stories: rows end at very different steps,
where the engine's early exit of finished rows pays; transformers' `generate` keeps every row to the end).
With --task NAME (e.g. word_arithmetic, the task recipes/real-cpu.yaml warms its drafter on) the pool is that
task's held-out prompts instead, and a drafter or assistant trained here trains on that task's prompts;
--task-options JSON gives the task's options as a recipe's task.options does (real-cpu's:
'{"max_steps": 16, "max_number": 3, "tail_exponent": 2.5}').
Drafter: warmed up offline on the target's own sampled responses (tlt_cli/drafter/warmup.py), cached
under --cache-dir, or --drafter. For each batch size B the same prompt pool is split into batches of B and
generated greedily (or sampled at --temperature, as RL rollouts are); tokens/s is generated tokens over
wall-clock time, and tokens per CPU second is generated tokens over the process's CPU time (what the
ratios are read from: on a shared machine, wall-clock time also counts the time the benchmark waited for a
core). After one untimed pass per method, --repeats rounds run every method in turn (load hits all methods
alike) and each keeps its pass of least CPU time. Greedy outputs are checked
token-identical to SD off ("same": for SD, lossless decoding; for generate, the engine against transformers;
"tie": a response differs, but first where the target's top two logits tie within float32 rounding, see
TIE_TOLERANCE; the divergences are in the JSON).
The same prompts also go through transformers' `generate` (batched, left-padded), and at B=1 also with
`assistant_model=`: a one-layer copy of the target (its first layer, embedding, norm and head) fine-tuned on
the same sampled target responses and for the same number of steps as the drafter, also cached. Where the
time goes (target forwards, drafter or assistant forwards, the rest; CPU seconds) is measured with forward
hooks.
With --linear-forms on,off every engine method also runs as "<method>+forms": its linear layers in the forms
measured fastest on this machine for each pass's rows (tlt_cli/tuning/linear_forms.py; plan cached under
--cache-dir), checked token-identical to SD off like the rest.
With --dtypes float32,bfloat16 every engine method also runs decoding in bfloat16 (as "<method>@bfloat16": the
owned forward's weight copies and cache in bfloat16, tlt_cli/tuning/precision.py), checked token-identical to
"off@bfloat16" (SD is exact against the model in the precision that decodes; ties are judged on bfloat16
logits), and the ratios are reported per dtype (best SD vs plain in the same dtype, plain bfloat16 vs plain).
--configs also takes any SD configuration label (tlt_cli/speculative/rules.py parse_label): model-free
`ngram4` (n-gram proposals from the prompt and the sibling responses, no drafter pass), hybrid
`s2-k1-t3+ngram4` and one source per row `'s2-k1-t3|ngram4'` (quote the |). With --group-size G each
prompt is generated G times in one batch, as GRPO's group (use a batch size that is a multiple of G and
--temperature 0.7): requests with equal prompts in a batch are one group, so siblings exist, and each SD
method also reports its accept length by draft source (each source's own accepted drafts per verify pass)
and, for n-gram shapes, by the number of the row's siblings that had finished.
Prints a table per batch size, the ratios the goals are stated in (plain engine vs generate, best SD
vs plain, best SD vs assisted generation) and writes everything to --out as JSON."""

from __future__ import annotations

import argparse
import copy
import json
import math
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tlt_cli.drafter.model import load_drafter, save_drafter
from tlt_cli.drafter.warmup import encode_prompts, generate_responses, warm_up_drafter
from tlt_cli.engine import decode_model_for
from tlt_cli.engine.linear_forms import describe_plan
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.loading import load_policy, model_fingerprint
from tlt_cli.models.tiny import BUILTIN_TINY_MODEL, IGNORED_LABEL, pad_supervised_batch
from tlt_cli.rollout.decode_plan import DECODE_DTYPES
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.rules import RuleTableError, parse_label
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.tasks.arithmetic import ArithmeticTask
from tlt_cli.tasks.prompts import encode_prompt
from tlt_cli.tasks.registry import TASKS, TaskOptionError, build_task, check_options
from tlt_cli.tuning.linear_forms import measured_linear_plan

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# a Hugging Face folder (--model): batch sizes, SD shapes and prompt pool unless given
REAL_BATCH_SIZES = (1, 4)
REAL_CONFIGS = ("chain-2", "chain-4", "tree-4x2-8", "tree-6x4-16")
REAL_PROMPTS = 8
# user turns of the real-model prompts (each through the model's chat template): short math word
# questions like the ones an instruct model is trained on in RL, and a few plain questions
CHAT_QUESTIONS = (
    "Ava has 12 books. She buys 7 more. How many books does Ava have now?",
    "If I have 5 apples and eat 2, how many are left?",
    "A train travels 60 km in one hour. How far does it go in 3 hours?",
    "Tom has 3 red balls and 4 blue balls. How many balls does he have?",
    "What is 9 times 8?",
    "If a pizza has 8 slices and you eat 3, how many slices remain?",
    "Sam had 20 stickers. He gave 6 to a friend. How many stickers does Sam have now?",
    "What is the capital of France?",
    "A box holds 6 eggs. How many eggs are in 4 boxes?",
    "Lena has 15 shells. She finds 9 more on the beach. How many shells does she have?",
    "What is 100 minus 37?",
    "Name three primary colors.",
    "There are 24 students and 4 tables with the same number at each. How many students sit at each table?",
    "Mia saves 5 dollars a week. How much has she saved after 6 weeks?",
    "Is 17 a prime number? Answer yes or no.",
    "A shop sold 14 cakes in the morning and 9 in the afternoon. How many cakes did it sell?",
)
# the long-tailed batch: answers from a few tokens to the max_new_tokens cap
LONG_TAIL_QUESTIONS = (
    "What is 12 + 7? Answer briefly.",
    "Name three primary colors.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "If I have 5 apples and eat 2, how many are left?",
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works.",
    "What is 9 times 8?",
    "Is 17 a prime number? Answer yes or no.",
    "Describe your ideal weekend in detail.",
    "Spell the word 'cat' backwards.",
    "List the planets of the solar system and one fact about each.",
    "What color is the sky on a clear day?",
    "Explain why the sum of two odd numbers is even.",
    "Translate 'good morning' into French.",
    "Write a poem about autumn leaves.",
)
LONG_TAIL = "16 long-tailed"
SD_CONFIGS = {
    "off": None,
    "chain-2": SpeculativeConfig(2),
    "chain-4": SpeculativeConfig(4),
    "chain-8": SpeculativeConfig(8),
    "tree-4x2-8": SpeculativeConfig(4, 2, 8),
    "tree-6x4-16": SpeculativeConfig(6, 4, 16),
    "tree-8x4-32": SpeculativeConfig(8, 4, 32),
    "tree-8x4-48": SpeculativeConfig(8, 4, 48),
}
# a greedy response that first differs from SD off's where the target's logits of both tokens lie within
# this of its top logit differs at a float32 tie: which token wins there depends on how many positions one
# forward computes (plain decoding computes 1, a verify pass several), not on speculative decoding being lossy
TIE_TOLERANCE = 1e-4
# held-out problems start here, far past the warm-up's training prompts
FIRST_BENCH_PROBLEM = 100_000


@dataclass
class RunResult:
    """One (batch size, method) measurement over the whole prompt pool."""

    batch_size: int
    cell: str  # the batch size, or LONG_TAIL for the long-tailed batch of 16
    method: str
    tokens: int
    seconds: float
    tokens_per_second: float
    cpu_seconds: float
    tokens_per_cpu_second: float
    accept_length: float
    # CPU seconds in target forwards (decoder and head), drafter or assistant forwards, and the rest
    target_seconds: float
    drafter_seconds: float
    other_seconds: float
    target_calls: int
    # greedy only (None when sampled: not comparable sample for sample): "yes" every response equals SD off's,
    # "tie" each that differs first differs at a float32 tie of the target's logits, "NO" otherwise
    same_as_off: str | None
    divergences: list[dict]  # per differing response: prompt, position, the two tokens, their logit gap
    # draft source -> its own accepted drafts per verify pass + 1; n-gram shapes: finished siblings -> accept length
    accept_length_by_source: dict[str, float] = field(default_factory=dict)
    accept_length_by_finished_siblings: dict[int, float] = field(default_factory=dict)


class ForwardTimer:
    """Adds up the CPU time and calls of a module's forward via hooks."""

    def __init__(self, modules) -> None:
        self.seconds, self.calls, self._started = 0.0, 0, 0.0
        self.handles = []
        for module in modules:
            self.handles.append(module.register_forward_pre_hook(self._start))
            self.handles.append(module.register_forward_hook(self._stop))

    def _start(self, module, args) -> None:
        self._started = time.process_time()

    def _stop(self, module, args, output) -> None:
        self.seconds += time.process_time() - self._started
        self.calls += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_rollout.json", help="where the JSON results go")
    parser.add_argument(
        "--model", default="builtin:tiny-arith", help="target: the built-in tiny model or a local folder"
    )
    parser.add_argument(
        "--prompts",
        type=int,
        default=None,
        help=f"prompt pool size, a multiple of the largest batch (default 32, a folder {REAL_PROMPTS})",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy, every output checked token-identical to SD off; above 0: sampled as in RL "
        "rollouts (outputs differ from SD off sample for sample; tests check the distribution)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed runs per cell; the best counts (0: the untimed pass only, to check outputs quickly)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--batch-sizes",
        default=None,
        help=f"default {','.join(map(str, BATCH_SIZES))}; a folder: {','.join(map(str, REAL_BATCH_SIZES))}",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"SD configs to run, from: {','.join(SD_CONFIGS)} (a folder: {','.join(REAL_CONFIGS)})",
    )
    parser.add_argument(
        "--long-tail",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the long-tailed batch of 16 chat requests (default: on for a folder)",
    )
    parser.add_argument("--long-tail-max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--assisted",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="at B=1, also transformers' assisted generation (trains and caches its assistant)",
    )
    parser.add_argument(
        "--cache-dir",
        default=str(Path.home() / ".cache" / "tlt"),
        help="trained drafter and assistant are cached here, per target folder and settings",
    )
    parser.add_argument("--warmup-steps", type=int, default=2000, help="drafter (and assistant) training steps")
    parser.add_argument("--warmup-prompts", type=int, default=2048, help="target responses they train on")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="draft vocabulary of a drafter trained here (0: the default for the target's vocabulary)",
    )
    parser.add_argument(
        "--task",
        default=None,
        help="a task name (e.g. word_arithmetic): its held-out prompts are the pool, and a drafter or assistant "
        "trained here trains on its prompts (default: arithmetic, and for a folder the chat questions as the pool)",
    )
    parser.add_argument(
        "--task-options",
        default="{}",
        help="the --task's options as a JSON object, as a recipe's task.options (e.g. real-cpu's "
        '\'{"max_steps": 16, "max_number": 3, "tail_exponent": 2.5}\')',
    )
    parser.add_argument(
        "--warmup-batch-size", type=int, default=16, help="batch of the drafter (and assistant) training steps"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        help="samples of each prompt in one batch (GRPO's G; n-gram shapes draft from the siblings)",
    )
    parser.add_argument(
        "--linear-forms",
        default="off",
        help="off, on, or on,off: engine methods with the linear forms of rollout.linear_forms auto (as "
        "'<method>+forms'), without, or both (SD off without forms always runs: it is the reference)",
    )
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="float32, or float32,bfloat16: engine methods also decoding in bfloat16 (as '<method>@bfloat16')",
    )
    parser.add_argument(
        "--drafter",
        default=None,
        help="a drafter folder to use instead of training one (e.g. the one `tlt train` warmed up "
        "and cached under <cache>/drafters/)",
    )
    args = parser.parse_args()
    real = args.model != BUILTIN_TINY_MODEL
    if args.prompts is None:
        args.prompts = REAL_PROMPTS if real else 32
    if args.batch_sizes is None:
        args.batch_sizes = ",".join(map(str, REAL_BATCH_SIZES if real else BATCH_SIZES))
    if args.configs is None:
        args.configs = ",".join(REAL_CONFIGS if real else SD_CONFIGS)
    if args.long_tail is None:
        args.long_tail = real
    if args.long_tail and not real:
        parser.error("--long-tail needs a model folder with a chat template (--model); the built-in model has none.")
    if args.task is not None and args.task not in TASKS:
        parser.error(f"unknown task {args.task}; choose from {', '.join(sorted(TASKS))}.")
    try:
        options = task_options(args)
        if options and args.task is None:
            parser.error("--task-options needs --task: name the task they are options of.")
        check_options(args.task or ArithmeticTask.name, options)
    except (ValueError, TaskOptionError) as error:
        parser.error(f"--task-options {args.task_options}: {error}")
    for name in args.configs.split(","):
        try:
            register_label(name)
        except RuleTableError:
            parser.error(f"unknown SD config {name}; choose from {', '.join(SD_CONFIGS)} or give a label (ngram4).")
    if args.group_size < 1:
        parser.error(f"--group-size is {args.group_size}; give at least 1.")
    return args


def task_options(args) -> dict:
    """The --task-options JSON object (ValueError if it is not one)."""
    options = json.loads(args.task_options)
    if not isinstance(options, dict):
        raise ValueError("give a JSON object, e.g. '{\"max_steps\": 16}'")
    return options


def register_label(name: str) -> None:
    """Make an SD configuration label (ngram4, s2-k1-t3+ngram4, s2-k1-t3|ngram4, ...) a method of SD_CONFIGS.

    RuleTableError if it is none."""
    if name not in SD_CONFIGS:
        SD_CONFIGS[name] = parse_label(name)


def cached_dir(target, kind: str, args) -> Path:
    """Where the trained `kind` (drafter / assistant) for this target (its folder and files) and settings lives."""
    target_name = f"{Path(target.config._name_or_path).name}-{model_fingerprint(args.model)}"
    settings = f"{args.task or ArithmeticTask.name}-{args.warmup_prompts}p-{args.warmup_steps}s"
    settings += "".join(f"-{key}{value}" for key, value in sorted(task_options(args).items()))
    settings += f"-b{args.warmup_batch_size}-seed{args.seed}"
    if kind == "drafter" and args.vocab_size:
        settings += f"-v{args.vocab_size}"
    return Path(args.cache_dir) / f"bench-{kind}-{target_name}-{settings}"


def prepare_drafter(target, tokenizer, task, args) -> tuple:
    """The warmed-up drafter (cached), and the warm-up report when it was trained now."""
    if args.drafter is not None:
        return load_drafter(args.drafter, target).eval(), {"folder": args.drafter}
    directory = cached_dir(target, "drafter", args)
    report_path = directory / "warmup_report.json"
    if report_path.is_file():
        return load_drafter(directory, target).eval(), json.loads(report_path.read_text())
    drafter, report = warm_up_drafter(
        target,
        tokenizer,
        task,
        steps=args.warmup_steps,
        batch_size=args.warmup_batch_size,
        lr=3e-3,
        seed=args.seed,
        train_prompts=args.warmup_prompts,
        draft_vocab_size=args.vocab_size,
    )
    save_drafter(drafter, directory)
    report_path.write_text(json.dumps(asdict(report), indent=2) + "\n")
    return drafter.eval(), asdict(report)


def prepare_assistant(target, tokenizer, task, args):
    """A one-layer copy of the target, fine-tuned on the target's own sampled responses (cached)."""
    directory = cached_dir(target, "assistant", args)
    if (directory / "config.json").is_file():
        return type(target).from_pretrained(directory, local_files_only=True).eval()
    assistant = copy.deepcopy(target)
    assistant.model.layers = assistant.model.layers[:1]
    assistant.config.num_hidden_layers = 1
    if getattr(assistant.config, "layer_types", None) is not None:
        assistant.config.layer_types = assistant.config.layer_types[:1]
    prompts = encode_prompts(tokenizer, task, range(args.warmup_prompts))
    pairs = generate_responses(
        target, tokenizer, prompts, SamplingParams(args.max_new_tokens, temperature=1.0), args.seed
    )
    train_causal_lm(
        assistant,
        pairs,
        tokenizer.pad_token_id,
        steps=args.warmup_steps,
        seed=args.seed,
        batch_size=args.warmup_batch_size,
    )
    assistant.save_pretrained(directory)
    return assistant.eval()


def train_causal_lm(model, pairs, pad_token_id: int, steps: int, seed: int, batch_size: int) -> None:
    """Cross-entropy on the response tokens of (prompt, response) pairs, AdamW lr 3e-3, clip 1.0."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    model.train()
    examples = [(prompt + response, [IGNORED_LABEL] * len(prompt) + response) for prompt, response in pairs]
    for _ in range(steps):
        chosen = torch.randint(0, len(pairs), (batch_size,), generator=generator).tolist()
        input_ids, attention_mask, labels = pad_supervised_batch([examples[index] for index in chosen], pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    model.eval()


@dataclass
class Measured:
    """One timed pass of a method over the prompt pool."""

    responses: list[list[int]]
    seconds: float
    cpu_seconds: float
    accept_length: float
    target_seconds: float
    target_calls: int
    drafter_seconds: float
    # draft source -> [verify passes, accepted drafts]; finished siblings -> [verify passes, accepted drafts]
    by_source: dict[str, list[int]] = field(default_factory=dict)
    by_finished_siblings: dict[int, list[int]] = field(default_factory=dict)


def engine_runner(target, drafter, tokenizer, prompt_pool, batch_size, config, sampling, linear_plan=None, dtype=None):
    """A callable that generates the whole pool in batches of batch_size with the embedded engine (decoding in
    `dtype`, None: the target's own)."""
    speculative = SpeculativeDecoder(drafter, config) if config is not None else None
    engine = EmbeddedEngine(
        target,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        speculative=speculative,
        linear_plan=linear_plan,
        dtype=dtype,
    )

    def run() -> Measured:
        decoder_timer, head_timer = ForwardTimer([target.get_decoder()]), ForwardTimer([target.get_output_embeddings()])
        drafter_timer = ForwardTimer([drafter] if drafter is not None else [])
        responses, passes, emitted = [], 0, 0
        by_source: dict[str, list[int]] = {}
        by_finished_siblings: dict[int, list[int]] = {}
        start, cpu_start = time.perf_counter(), time.process_time()
        for first in range(0, len(prompt_pool), batch_size):
            chunk = prompt_pool[first : first + batch_size]
            # equal prompts in a batch are one group (--group-size): their n-gram drafts come from each other
            groups: dict[tuple[int, ...], int] = {}
            requests = [
                RolloutRequest(index, tuple(prompt), group=groups.setdefault(tuple(prompt), len(groups)))
                for index, prompt in enumerate(chunk)
            ]
            for completion in engine.generate(requests, sampling, torch.Generator().manual_seed(0)):
                responses.append(completion.response_ids)
                passes += completion.speculative.verify_passes
                emitted += completion.speculative.accepted_draft_tokens + completion.speculative.verify_passes
                add_counts(
                    by_source, completion.speculative.passes_by_source, completion.speculative.accepted_by_source
                )
            if speculative is not None:
                for finished, (finished_passes, accepted) in speculative.by_finished_siblings.items():
                    add_counts(by_finished_siblings, {finished: finished_passes}, {finished: accepted})
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        for timer in (decoder_timer, head_timer, drafter_timer):
            timer.remove()
        accept_length = emitted / passes if passes else math.nan
        return Measured(
            responses,
            seconds,
            cpu_seconds,
            accept_length,
            decoder_timer.seconds + head_timer.seconds,
            decoder_timer.calls,
            drafter_timer.seconds,
            {source: counts for source, counts in by_source.items() if counts[0]},
            by_finished_siblings,
        )

    return run


def add_counts(totals: dict, passes: dict, accepted: dict) -> None:
    """totals[key] += [passes[key], accepted[key]] for every key of passes."""
    for key, count in passes.items():
        sums = totals.setdefault(key, [0, 0])
        sums[0] += count
        sums[1] += accepted.get(key, 0)


def accept_lengths(counts: dict) -> dict:
    """key -> (verify passes + accepted drafts) / verify passes, from [passes, accepted] pairs."""
    return {key: (passes + accepted) / passes for key, (passes, accepted) in sorted(counts.items()) if passes}


def transformers_runner(target, assistant, tokenizer, prompt_pool, batch_size, sampling):
    """A callable that generates the pool in batches of batch_size (left-padded) with transformers' generate,
    greedy or sampled; with an assistant (batch size 1 only), as assisted generation."""
    eos_token_id, pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

    def run() -> Measured:
        target_timer = ForwardTimer([target])
        assistant_timer = ForwardTimer([assistant] if assistant is not None else [])
        responses = []
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.manual_seed(0)
        for first in range(0, len(prompt_pool), batch_size):
            chunk = prompt_pool[first : first + batch_size]
            longest = max(len(prompt) for prompt in chunk)
            input_ids = torch.tensor([[pad_token_id] * (longest - len(prompt)) + prompt for prompt in chunk])
            attention_mask = torch.tensor([[0] * (longest - len(prompt)) + [1] * len(prompt) for prompt in chunk])
            output = target.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=sampling.max_new_tokens,
                do_sample=not sampling.greedy,
                temperature=sampling.temperature if not sampling.greedy else None,
                top_p=None,
                top_k=None,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                assistant_model=assistant,
            )[:, longest:].tolist()
            responses += [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in output]
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        target_timer.remove()
        assistant_timer.remove()
        return Measured(
            responses, seconds, cpu_seconds, math.nan, target_timer.seconds, target_timer.calls, assistant_timer.seconds
        )

    return run


def measure_batch_size(
    runners: dict, batch_size: int, cell: str, repeats: int, sampling_is_greedy: bool, target, prompt_pool
) -> list[RunResult]:
    """One untimed pass per method, then `repeats` rounds over all methods in turn (so load on a
    shared machine hits every method alike); each method keeps its pass of least CPU time (with
    repeats 0, its untimed pass: outputs checked, times not comparable)."""
    untimed = {method: run() for method, run in runners.items()}
    best: dict[str, Measured] = untimed if repeats == 0 else {}
    for _ in range(repeats):
        for method, run in runners.items():
            measured = run()
            if method not in best or measured.cpu_seconds < best[method].cpu_seconds:
                best[method] = measured
    results = []
    for method, measured in best.items():
        tokens = sum(len(response) for response in measured.responses)
        other = measured.cpu_seconds - measured.target_seconds - measured.drafter_seconds
        # sampled outputs differ from SD off sample for sample (RNG draws differ); only greedy is compared, each
        # method against plain decoding in its own dtype
        dtype = dtype_of(method)
        reference = best[f"off{dtype_suffix(dtype)}"].responses if sampling_is_greedy else None
        divergences = (
            [] if reference is None else first_divergences(target, prompt_pool, reference, measured.responses, dtype)
        )
        results.append(
            RunResult(
                batch_size,
                cell,
                method,
                tokens,
                measured.seconds,
                tokens / measured.seconds,
                measured.cpu_seconds,
                tokens / measured.cpu_seconds,
                measured.accept_length,
                measured.target_seconds,
                measured.drafter_seconds,
                other,
                measured.target_calls,
                None if reference is None else same_verdict(divergences),
                divergences,
                accept_lengths(measured.by_source),
                accept_lengths(measured.by_finished_siblings),
            )
        )
    return results


def dtype_suffix(dtype: str) -> str:
    """'' for float32 (the methods' plain names), '@bfloat16' for bfloat16."""
    return "" if dtype == "float32" else f"@{dtype}"


def dtype_of(method: str) -> str:
    return method.partition("@")[2] or "float32"


def sequence_logits(target, ids: list[int], dtype: str) -> torch.Tensor:
    """The last position's logits [V] of `ids` in `dtype`: transformers' forward in float32, the owned forward in
    bfloat16 (the one the engine decodes with)."""
    if dtype == "float32":
        return target(torch.tensor([ids])).logits[0, -1]
    decode_model = decode_model_for(target, dtype=DECODE_DTYPES[dtype])
    length = len(ids)
    positions = torch.arange(length)[None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    hidden = decode_model.forward_block(
        decode_model.new_cache(1, length), torch.tensor([ids]), positions, positions, length, causal
    )
    return decode_model.logits(hidden[0, -1])


def first_divergences(target, prompt_pool, reference, responses, dtype: str = "float32") -> list[dict]:
    """Where each response first differs from SD off's, with the target's logits (in `dtype`) of both tokens
    there (one full forward over the prompt and the common prefix)."""
    found = []
    for index, (prompt, expected, got) in enumerate(zip(prompt_pool, reference, responses, strict=True)):
        if got == expected:
            continue
        position = next((at for at, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
        divergence = {"prompt": index, "position": position, "off_token": None, "token": None, "logit_gap": None}
        if position < min(len(expected), len(got)):  # not one response ending where the other goes on
            with torch.no_grad():
                logits = sequence_logits(target, list(prompt) + expected[:position], dtype)
            top = float(logits.max())
            gap = max(top - float(logits[expected[position]]), top - float(logits[got[position]]))
            divergence.update(off_token=expected[position], token=got[position], logit_gap=gap)
        found.append(divergence)
    return found


def same_verdict(divergences: list[dict]) -> str:
    """'yes' with no divergence; 'tie' when every one is at a float32 tie of the target (both tokens within
    TIE_TOLERANCE of the top logit); else 'NO'."""
    if not divergences:
        return "yes"
    ties = [item["logit_gap"] is not None and item["logit_gap"] <= TIE_TOLERANCE for item in divergences]
    return "tie" if all(ties) else "NO"


def render(console: Console, results: list[RunResult], cell: str, sampling: SamplingParams) -> None:
    rows = [result for result in results if result.cell == cell]
    off = next(result for result in rows if result.method == "off")
    decoding = "greedy" if sampling.greedy else f"sampled at T={sampling.temperature}"
    title = f"B={cell}: {decoding}, {off.tokens} tokens (SD off), best of the timed passes"
    table = Table(title=title)
    columns = (
        "method",
        "tok/s",
        "tok/CPU-s",
        "vs off",
        "accept",
        "target s",
        "drafter s",
        "other s",
        "target calls",
        "same",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for result in rows:
        table.add_row(
            result.method,
            f"{result.tokens_per_second:.1f}",
            f"{result.tokens_per_cpu_second:.1f}",
            f"{result.tokens_per_cpu_second / off.tokens_per_cpu_second:.2f}x",
            "-" if math.isnan(result.accept_length) else f"{result.accept_length:.2f}",
            f"{result.target_seconds:.2f}",
            f"{result.drafter_seconds:.2f}",
            f"{result.other_seconds:.2f}",
            str(result.target_calls),
            result.same_as_off or "n/a",
        )
    console.print(table)
    for line in goal_ratios(rows):
        console.print(f"  {line}")
    for result in rows:
        if result.accept_length_by_source:
            sources = ", ".join(f"{source} {length:.2f}" for source, length in result.accept_length_by_source.items())
            line = f"  {result.method}: accept length by draft source {sources}"
            if result.accept_length_by_finished_siblings:
                siblings = ", ".join(
                    f"{finished}: {length:.2f}"
                    for finished, length in result.accept_length_by_finished_siblings.items()
                )
                line += f"; by finished siblings {siblings}"
            console.print(line, highlight=False)


def goal_ratios(rows: list[RunResult]) -> list[str]:
    """The ratios the goals are stated in, for one cell, in tokens per CPU second: plain engine vs
    generate, best SD vs plain, best SD vs assisted generation (each only where both sides ran)."""
    speed = {result.method: result.tokens_per_cpu_second for result in rows}
    lines = []
    if "hf-generate" in speed:
        lines.append(f"plain engine vs transformers generate: {speed['off'] / speed['hf-generate']:.2f}x")
    for dtype in sorted({dtype_of(method) for method in speed}):
        suffix = dtype_suffix(dtype)
        off = f"off{suffix}"
        if off not in speed:
            continue
        if suffix:
            lines.append(f"plain engine {dtype} vs float32: {speed[off] / speed['off']:.2f}x")
        shapes = [f"{name}{suffix}" for name in SD_CONFIGS if name != "off" and f"{name}{suffix}" in speed]
        if shapes:
            best = max(shapes, key=speed.get)
            lines.append(f"best SD ({best}) vs plain engine {dtype}: {speed[best] / speed[off]:.2f}x")
            if suffix:
                lines.append(f"best SD ({best}) vs plain engine float32: {speed[best] / speed['off']:.2f}x")
            if "hf-assisted" in speed:
                assisted = speed[best] / speed["hf-assisted"]
                lines.append(f"best SD ({best}) vs transformers assisted generation: {assisted:.2f}x")
    return lines


def chat_prompts(tokenizer, questions) -> list[list[int]]:
    """Token ids of each question as the rollout encodes it: one user turn through the chat template."""
    return [encode_prompt(tokenizer, question) for question in questions]


def benchmark_cells(tokenizer, task, args) -> list[tuple[str, int, list[list[int]], SamplingParams]]:
    """(cell, batch size, prompt pool, sampling) of every measured cell: each batch size over the pool
    (held-out prompts of the task for the built-in model or with --task, chat questions for a folder
    otherwise), then the long-tailed batch of 16 if asked."""
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.model == BUILTIN_TINY_MODEL or args.task is not None:
        pool = encode_prompts(tokenizer, task, range(FIRST_BENCH_PROBLEM, FIRST_BENCH_PROBLEM + args.prompts))
    else:
        questions = [CHAT_QUESTIONS[index % len(CHAT_QUESTIONS)] for index in range(args.prompts)]
        pool = chat_prompts(tokenizer, questions)
    # GRPO's group: each prompt args.group_size times in a row
    pool = [prompt for prompt in pool for _ in range(args.group_size)]
    cells = [(str(size), int(size), pool, sampling) for size in args.batch_sizes.split(",")]
    if args.long_tail:
        long_tail_sampling = SamplingParams(args.long_tail_max_new_tokens, temperature=args.temperature)
        cells.append(
            (LONG_TAIL, len(LONG_TAIL_QUESTIONS), chat_prompts(tokenizer, LONG_TAIL_QUESTIONS), long_tail_sampling)
        )
    return cells


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=120)
    target, tokenizer = load_policy(args.model)
    task = build_task(args.task or ArithmeticTask.name, args.seed, task_options(args))
    shapes = [name for name in args.configs.split(",") if name != "off"]
    # only drafter shapes need a drafter (and get the assisted-generation baseline); off and ngram<k> need none
    drafting = any(SD_CONFIGS[name].uses_drafter for name in shapes)
    drafter, warmup_report = prepare_drafter(target, tokenizer, task, args) if drafting else (None, None)
    assistant = prepare_assistant(target, tokenizer, task, args) if drafting and args.assisted else None
    forms_modes = args.linear_forms.split(",")
    forms = measured_linear_plan("auto", [target, drafter], Path(args.cache_dir)) if "on" in forms_modes else None
    if forms is not None:
        console.print(describe_plan(forms))
    results: list[RunResult] = []
    for cell, batch_size, pool, sampling in benchmark_cells(tokenizer, task, args):
        runners = {
            method: engine_runner(target, drafter, tokenizer, pool, batch_size, SD_CONFIGS[method], sampling)
            for method in ["off", *shapes]
            if method == "off" or "off" in forms_modes
        }
        for method in ["off", *shapes] if forms is not None else []:
            runners[f"{method}+forms"] = engine_runner(
                target, drafter, tokenizer, pool, batch_size, SD_CONFIGS[method], sampling, forms
            )
        for dtype in [name for name in args.dtypes.split(",") if name != "float32"]:
            for method in ["off", *shapes]:
                runners[f"{method}@{dtype}"] = engine_runner(
                    target,
                    drafter,
                    tokenizer,
                    pool,
                    batch_size,
                    SD_CONFIGS[method],
                    sampling,
                    forms,
                    DECODE_DTYPES[dtype],
                )
        runners["hf-generate"] = transformers_runner(target, None, tokenizer, pool, batch_size, sampling)
        if batch_size == 1 and assistant is not None:
            runners["hf-assisted"] = transformers_runner(target, assistant, tokenizer, pool, 1, sampling)
        results += measure_batch_size(runners, batch_size, cell, args.repeats, sampling.greedy, target, pool)
        render(console, results, cell, sampling)
    output = {
        "command": "python scripts/bench_rollout.py "
        + " ".join(f"--{key.replace('_', '-')} {shlex.quote(str(value))}" for key, value in vars(args).items()),
        "threads": args.threads,
        "drafter_warmup": warmup_report,
        "results": [asdict(result) for result in results],
    }
    Path(args.out).write_text(json.dumps(output, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
