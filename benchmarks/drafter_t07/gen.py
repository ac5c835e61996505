"""Experiment (BENCHMARKS.md, "A drafter that pays at T=0.7"), run from the repository root:
    python benchmarks/drafter_t07/gen.py 192 0 bfloat16 96 benchmarks/drafter_t07/train.pt   # count first rows out
    python benchmarks/drafter_t07/gen.py 32 5000 bfloat16 32 benchmarks/drafter_t07/held.pt
Sample the target's responses at T=0.7 in bfloat16, time it, save completions + hidden."""

import sys
import time

import torch

from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.warmup import encode_prompts, prompt_hidden_states
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.training import setup

torch.set_num_threads(2)
count, start_index, dtype_name, rows, out = (
    int(sys.argv[1]),
    int(sys.argv[2]),
    sys.argv[3],
    int(sys.argv[4]),
    sys.argv[5],
)
recipe = load_recipe("recipes/real-cpu.yaml", [])
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
dtype = getattr(torch, dtype_name)
task = setup.task(recipe)
prompts = encode_prompts(tokenizer, task, range(start_index, start_index + count))
engine = EmbeddedEngine(target, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, dtype=dtype)
sampling = SamplingParams(max_new_tokens=recipe.rollout.max_new_tokens, temperature=0.7)
completions = []
t0 = time.perf_counter()
for chunk in range(0, count, rows):
    reqs = [RolloutRequest(request_id=i, prompt_ids=tuple(p)) for i, p in enumerate(prompts[chunk : chunk + rows])]
    g = torch.Generator().manual_seed(chunk)
    completions += engine.generate(reqs, sampling, g, return_hidden=True)
    tokens = sum(len(c.response_ids) for c in completions)
    seconds = time.perf_counter() - t0
    print(f"{len(completions)} done, {tokens} tokens, {seconds:.1f}s, {tokens / seconds:.1f} tok/s", flush=True)
gen = time.perf_counter() - t0
t0 = time.perf_counter()
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
    states = prompt_hidden_states(target, [c.prompt_ids for c in completions])
print(f"prompt states {time.perf_counter() - t0:.1f}s")
torch.save({"completions": completions, "states": [s.float() for s in states], "generate_seconds": gen}, out)
