"""Experiment (BENCHMARKS.md, "What limits the drafter"), run from the repository root:
    python benchmarks/drafter_limit/collect.py TRAIN_PROMPTS SAMPLES.pt
Samples real-cpu's task as its warm-up does (tlt's own collect_warmup_data: the rollout's temperature and length,
the warm-up's dtype, 32 held-out prompts after the training prompts) and saves it for limit.py."""

import sys
import time
from pathlib import Path

from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.warmup import HELD_OUT_PROMPTS, collect_warmup_data, save_warmup_data
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.training import setup

train_prompts, out = int(sys.argv[1]), Path(sys.argv[2])
recipe = load_recipe("recipes/real-cpu.yaml", sys.argv[3:])
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
last = [0.0]


def progress(phase: str, done: int, total: int) -> None:
    if time.perf_counter() - last[0] > 30 or done == total:
        last[0] = time.perf_counter()
        print(f"{time.strftime('%H:%M:%S')} {phase} {done}/{total}", flush=True)


dtype = setup.warmup_dtype(recipe, target.device)
sampling = SamplingParams(max_new_tokens=recipe.rollout.max_new_tokens, temperature=recipe.rollout.temperature)
data = collect_warmup_data(
    target, tokenizer, setup.task(recipe), train_prompts, HELD_OUT_PROMPTS, sampling, recipe.run.seed, progress, dtype
)
save_warmup_data(data, out)
tokens = sum(len(completion.response_ids) for completion in data.train)
print(f"dtype {dtype}: {len(data.train)} training responses, {tokens} tokens, sampled in {data.generate_seconds:.0f} s")
