"""Experiment (BENCHMARKS.md, "A drafter that pays at T=0.7"), run from the repository root after gen.py:
    python benchmarks/drafter_t07/curve.py ce07tv 900 3e-3    # objective, steps, lr
Learning curves of held-out sampled acceptance at T=0.7 for several token objectives."""

import json
import sys
import time

import torch

from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter.loss import DrafterObjective
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.trainer import DrafterTrainer, evaluate_drafter
from tlt_cli.drafter.vocabulary import choose_vocabulary
from tlt_cli.drafter.warmup import length_buckets
from tlt_cli.training import setup

torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
name, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
objectives = {
    "eagle": DrafterObjective(1.0, 0.1, 0.0),
    "ce07": DrafterObjective(0.7, 1.0, 0.0),
    "ce07tv": DrafterObjective(0.7, 1.0, 1.0),
    "tv07": DrafterObjective(0.7, 0.0, 1.0),
    "ce07tv_x": DrafterObjective(0.7, 0.3, 3.0),
}
objective = objectives[name]
evaluation = DrafterObjective(0.7, 0.1, 0.0)
recipe = load_recipe("recipes/real-cpu.yaml", [])
target, tokenizer = setup.policy_and_tokenizer(recipe)
target.eval()
train, held = (
    torch.load("benchmarks/drafter_t07/train.pt", weights_only=False),
    torch.load("benchmarks/drafter_t07/held.pt", weights_only=False),
)
for data in (train, held):
    for c in data["completions"]:
        c.target_hidden = c.target_hidden.float()
vocabulary = choose_vocabulary(
    [c.response_ids for c in train["completions"]], 1024, target.config.vocab_size, tokenizer.eos_token_id
)
pad = tokenizer.pad_token_id
train_buckets = length_buckets(train["completions"], train["states"], 4, pad)
held_buckets = length_buckets(held["completions"], held["states"], 8, pad)
drafter = EagleDrafter(target, seed=0, vocabulary=vocabulary)
trainer = DrafterTrainer(drafter, lr=lr, weight_decay=0.1, objective=objective)


def held_out():
    losses = [evaluate_drafter(drafter, b, None, evaluation) for b in held_buckets]
    tokens = sum(loss.token_count for loss in losses)
    return {
        name: sum(float(getattr(loss, name)) * loss.token_count for loss in losses) / tokens
        for name in ("acceptance", "accuracy")
    }


generator = torch.Generator().manual_seed(0)
choices = torch.randint(0, len(train_buckets), (steps,), generator=generator).tolist()
schedule = torch.optim.lr_scheduler.CosineAnnealingLR(trainer.optimizer, T_max=steps, eta_min=0.1 * lr)
curve = [{"step": 0, **held_out(), "seconds": 0.0}]
print(curve[-1], flush=True)
t0 = time.perf_counter()
tokens = 0
for step, choice in enumerate(choices, 1):
    loss = trainer.train_step(train_buckets[choice])
    tokens += loss.token_count
    schedule.step()
    if step % max(steps // 6, 1) == 0 or step == steps:
        curve.append({"step": step, "tokens": tokens, **held_out(), "seconds": time.perf_counter() - t0})
        print(curve[-1], flush=True)
json.dump({"objective": name, "lr": lr, "curve": curve}, open(f"benchmarks/drafter_t07/curve-{name}-{steps}.json", "w"))
