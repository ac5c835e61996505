"""Experiment (BENCHMARKS.md, "What limits the drafter"), run from the repository root on collect.py's samples:
    python benchmarks/drafter_limit/limit.py SAMPLES.pt OUT.json VARIANT[,VARIANT...] STEPS [depths]
VARIANT is TRAIN_RESPONSES:START, START `fresh` (tlt's drafter as the warm-up builds it) or `last-layer` (its decoder
layer started from the target's last decoder layer, the fc's target-state half as identity). Each variant trains
real-cpu's warm-up drafter (tlt's own train_warmup_drafter, the recipe's settings, `depths` draft depths, default 1)
on the first TRAIN_RESPONSES sampled responses, then scores held-out acceptance at T=0.7 at depths 1-4 and the same
on the first 32 training responses, which every variant trained on: a gap between the two is a data limit, no gap
with both flat a limit of the drafter or its training."""

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

import tlt_cli.drafter.warmup as warmup
from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.loss import acceptance_objective
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.training import setup

EVALUATED_DEPTHS = 4
SEEN_RESPONSES = 32


class LastLayerDrafter(EagleDrafter):
    """tlt's drafter with its decoder layer copied from the target's last one (the drafter predicts that layer's
    output) and its fc passing the target's hidden state through."""

    def __init__(self, target, seed=0, vocabulary=None):
        super().__init__(target, seed=seed, vocabulary=vocabulary)
        state = target.get_decoder().layers[-1].state_dict()
        state.pop("input_layernorm.weight", None)
        self.decoder_layer.load_state_dict(state)
        hidden = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, hidden:] = torch.eye(hidden)


samples, out = Path(sys.argv[1]), Path(sys.argv[2])
variants = [(int(size), start) for size, start in (item.split(":") for item in sys.argv[3].split(","))]
steps = int(sys.argv[4])
depths = int(sys.argv[5]) if len(sys.argv) > 5 else 1
recipe = load_recipe("recipes/real-cpu.yaml", [])
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
data = warmup.load_warmup_data(samples)
assert data is not None, f"{samples} holds no warm-up data of this format"
temperature = recipe.rollout.temperature
pad = tokenizer.pad_token_id
scored = acceptance_objective(temperature, EVALUATED_DEPTHS)
held_buckets = warmup.length_buckets(data.held_out, data.held_out_prompt_states, warmup.EVALUATION_BUCKET_SIZE, pad)
seen_buckets = warmup.length_buckets(
    data.train[:SEEN_RESPONSES], data.train_prompt_states[:SEEN_RESPONSES], warmup.EVALUATION_BUCKET_SIZE, pad
)
results = {"samples": str(samples), "steps": steps, "train_depths": depths, "runs": []}
for size, start in variants:
    subset = replace(data, train=data.train[:size], train_prompt_states=data.train_prompt_states[:size])
    warmup.EagleDrafter = LastLayerDrafter if start == "last-layer" else EagleDrafter
    began = time.perf_counter()
    drafter, report = setup.train_recipe_drafter(
        recipe, target, tokenizer, subset, steps, acceptance_objective(temperature, depths)
    )
    held = warmup.held_out_metrics(drafter, held_buckets, scored)
    seen = warmup.held_out_metrics(drafter, seen_buckets, scored)
    run = {
        "train_responses": size,
        "start": start,
        "seconds": time.perf_counter() - began,
        "report": asdict(report),
        "held_out_acceptance_by_depth": held.acceptance_by_depth,
        "held_out_accuracy": held.accuracy,
        "held_out_accept_length_chain4": held.accept_length,
        "seen_acceptance_by_depth": seen.acceptance_by_depth,
        "seen_accept_length_chain4": seen.accept_length,
    }
    results["runs"].append(run)
    summary = {key: value for key, value in run.items() if key != "report"}
    print(json.dumps(summary), flush=True)
    print("  steps", report.steps, "train tokens", report.train_tokens, "curve", report.learning_curve, flush=True)
    out.write_text(json.dumps(results, indent=1))
