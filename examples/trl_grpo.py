"""GRPO with Hugging Face TRL's own GRPOTrainer and tlt doing the rollouts: a TRL script plus one argument.

Run it from the repository root with `pip install -e ".[trl]"` (CPU, minutes with the defaults on 2 cores; the
drafter starts fresh and trains online, as `tlt train`'s; `--drafter warmup` trains it first on the dataset's
prompts, 1 to 3 minutes once, then cached):

    python examples/trl_grpo.py                              # one process
    torchrun --nproc_per_node 2 examples/trl_grpo.py         # two data-parallel processes: the drafter
                                                             # trains while each waits for the other
    python examples/trl_grpo.py --trl-generation             # the same script, TRL generating, to compare

Everything except the `rollout_func=tlt_rollout(...)` argument is a plain TRL script: a model and
tokenizer from a Hugging Face folder (default: tlt's built-in tiny arithmetic model), a dataset with
a "prompt" column, a reward function, a GRPOConfig. TRL keeps its loss, advantages and optimizer
step; tlt generates (speculative decoding with a drafter trained online, the adaptive rule table) and
returns each token's log-probability. Each step prints TRL's mean reward and what tlt's rollout did
(seconds, accept length, drafter sidecar steps in the wait).
"""

from __future__ import annotations

import argparse
import os

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from tlt_cli.integrations.trl import tlt_rollout
from tlt_cli.models.loading import model_folder
from tlt_cli.tasks.arithmetic import ArithmeticTask

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL
TASK = ArithmeticTask(seed=0, max_terms=6)  # sums of up to 6 numbers: short responses, a quick demo


def correct_answer(completions: list[str], index: list[int], **_) -> list[float]:
    """1.0 for a completion whose final answer is right (the dataset's `index` column names the problem)."""
    return [TASK.reward(TASK.problem(number), completion) for completion, number in zip(completions, index)]


class PrintSteps(TrainerCallback):
    """Prints each logged step: TRL's mean reward, and what tlt's rollout did since the last log."""

    def __init__(self, rollout) -> None:
        self.rollout = rollout

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "reward" not in logs:
            return
        line = f"step {state.global_step}: mean reward {logs['reward']:.3f}"
        if self.rollout is not None:
            records = self.rollout.take_records()
            seconds = sum(record.seconds for record in records)
            accept = max((record.accept_length for record in records), default=0.0)
            drafter_steps = sum(record.sidecar.get("drafter_steps", 0.0) for record in records)
            line += (
                f"  process {records[0].process}: rollout {seconds:.2f} s  accept length {accept:.2f}  "
                f"drafter steps in the wait {drafter_steps:.0f}"
            )
        print(line, flush=True)


def main(arguments: argparse.Namespace) -> None:
    folder = model_folder(arguments.model)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = Dataset.from_dict(
        {"prompt": [TASK.problem(number).prompt for number in range(512)], "index": list(range(512))}
    )
    config = GRPOConfig(
        output_dir=arguments.output_dir,
        max_steps=arguments.steps,
        per_device_train_batch_size=arguments.batch_size,
        num_generations=arguments.num_generations,
        max_completion_length=arguments.max_completion_length,
        learning_rate=5e-5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        seed=arguments.seed,
    )
    rollout = (
        None
        if arguments.trl_generation
        else tlt_rollout(
            speculative={"mode": arguments.speculative},
            drafter=arguments.drafter,
            seed=arguments.seed,
            drafter_config={"warmup_prompts": 128, "warmup_steps": 200},  # with --drafter warmup: quick, then cached
        )
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=correct_answer,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )  # <- the one argument tlt adds to a TRL script
    trainer.add_callback(PrintSteps(rollout))
    trainer.train()
    if rollout is not None and rollout.drafter is not None:
        checksum = sum(float(parameter.detach().double().sum()) for parameter in rollout.drafter.parameters())
        print(f"process {trainer.accelerator.process_index}: drafter checksum {checksum:.6f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny-arith", help="a Hugging Face model folder")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="completions per process per step")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (GRPO group)")
    parser.add_argument("--max-completion-length", type=int, default=128, help="longest completion in tokens")
    parser.add_argument("--drafter", default="online", help="online, warmup, random, or a drafter folder")
    parser.add_argument("--speculative", default="adaptive", choices=["adaptive", "off"], help="speculative decoding")
    parser.add_argument("--trl-generation", action="store_true", help="leave out tlt: TRL generates")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/trl-grpo-example", help="TRL's output_dir")
    main(parser.parse_args())
