"""Experiment (BENCHMARKS.md, "Draft depths"), run from the repository root:
    python benchmarks/drafter_depths/evaluate.py SAMPLES.pt DRAFTER_FOLDER [depths]
A saved drafter's held-out acceptance at each draft depth of a chain (T = real-cpu's rollout temperature) on a
warm-up's held-out responses, and the accept length those give a chain."""

import json
import sys
from pathlib import Path

from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.loss import acceptance_objective
from tlt_cli.drafter.warmup import EVALUATION_BUCKET_SIZE, held_out_metrics, length_buckets, load_warmup_data
from tlt_cli.training import setup
from tlt_cli.training.drafter_folder import load_named_drafter

samples, folder = Path(sys.argv[1]), Path(sys.argv[2])
depths = int(sys.argv[3]) if len(sys.argv) > 3 else 4
recipe = load_recipe("recipes/real-cpu.yaml", [])
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
data = load_warmup_data(samples)
buckets = length_buckets(data.held_out, data.held_out_prompt_states, EVALUATION_BUCKET_SIZE, tokenizer.pad_token_id)
drafter = load_named_drafter(folder, target).eval()
metrics = held_out_metrics(drafter, buckets, acceptance_objective(recipe.rollout.temperature, depths))
result = {
    "drafter": str(folder),
    "accuracy": metrics.accuracy,
    "acceptance_by_depth": metrics.acceptance_by_depth,
    "accept_length": metrics.accept_length,
}
print(json.dumps(result))
