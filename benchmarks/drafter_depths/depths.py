"""Experiment (BENCHMARKS.md, "Draft depths"), run from the repository root on a warm-up's samples:
    python benchmarks/drafter_depths/depths.py SAMPLES.pt OUT.json 1,2,3 [steps]
Trains real-cpu's warm-up drafter (tlt's own train_warmup_drafter, the recipe's settings) once per
drafter.train_depths value on the same sampled responses, and evaluates each on the held-out responses at
draft depths 1-4: the acceptance of each draft token of a chain at T=0.7 and the accept length it gives."""

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.loss import acceptance_objective
from tlt_cli.drafter.warmup import (
    EVALUATION_BUCKET_SIZE,
    held_out_metrics,
    length_buckets,
    load_warmup_data,
)
from tlt_cli.training import setup

EVALUATED_DEPTHS = 4

samples, out, depth_values = Path(sys.argv[1]), Path(sys.argv[2]), [int(d) for d in sys.argv[3].split(",")]
recipe = load_recipe("recipes/real-cpu.yaml", sys.argv[5:])
steps = int(sys.argv[4]) if len(sys.argv) > 4 else recipe.drafter.warmup_steps
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
data = load_warmup_data(samples)
assert data is not None, f"{samples} holds no warm-up data of this format"
temperature = recipe.rollout.temperature
held_buckets = length_buckets(
    data.held_out, data.held_out_prompt_states, EVALUATION_BUCKET_SIZE, tokenizer.pad_token_id
)
results = {"samples": str(samples), "train_sequences": len(data.train), "steps": steps, "runs": []}
for depths in depth_values:
    start = time.perf_counter()
    drafter, report = setup.train_recipe_drafter(
        recipe, target, tokenizer, data, steps, acceptance_objective(temperature, depths)
    )
    metrics = held_out_metrics(drafter, held_buckets, acceptance_objective(temperature, EVALUATED_DEPTHS))
    run = {
        "train_depths": depths,
        "seconds": time.perf_counter() - start,
        "report": asdict(report),
        "acceptance_by_depth": metrics.acceptance_by_depth,
        "accept_length_chain4": metrics.accept_length,
    }
    results["runs"].append(run)
    print(
        json.dumps(
            {key: run[key] for key in ("train_depths", "seconds", "acceptance_by_depth", "accept_length_chain4")}
        ),
        flush=True,
    )
    print("  steps", report.steps, "curve", report.learning_curve, flush=True)
    out.write_text(json.dumps(results, indent=1))
