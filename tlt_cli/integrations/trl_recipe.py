"""A recipe with `train.trainer: trl`, translated for TRL: its GRPOConfig, prompt dataset and reward function.

`grpo_config_arguments(recipe, processes, output_dir)` derives TRL's `GRPOConfig` fields from the
recipe's own keys, one recipe key per TRL field (the table `DERIVED`), so a tlt step is one
generation batch of train.prompts_per_step x train.group_size completions and ppo_epochs optimizer
steps on it:
    per_device_train_batch_size = actor.micro_batch_size, gradient_checkpointing = actor.gradient_checkpointing
    gradient_accumulation_steps = steps_per_generation = completions per process / micro_batch_size
    num_generations = train.group_size, num_iterations = actor.ppo_epochs,
    max_steps = train.steps x actor.ppo_epochs, learning_rate = actor.lr, beta = actor.kl_coef,
    epsilon = actor.clip_ratio, temperature/top_p/top_k/max_completion_length from rollout,
    vllm_importance_sampling_correction/_mode/_clip_max = actor.rollout_correction (token -> token_truncate,
    sequence -> sequence_truncate, off -> no correction) and actor.rollout_correction_cap
then adds the recipe's `trl:` section, passed through unchanged. A key of that section that
GRPOConfig does not have, or that the recipe sets through its own key, or that tlt's run needs
as it sets it (logging, saving, the output folder), is refused in one sentence naming `trl.<key>`:
`trl_recipe_problem` (which tlt_cli/preflight.py refuses the recipe with) checks the TRL version, the keys,
and that GRPOConfig accepts the values. `prompt_dataset` and `TaskReward` give TRL the task's problems
in tlt's data order (through the chat template when the model has one) and its exact reward.
Only the TRL processes import TRL and datasets (tlt_cli/integrations/trl_run.py); the preflight
check imports TRL.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tlt_cli.config import CPU_DEVICES, Precision, Recipe, RolloutCorrection
from tlt_cli.integrations.trl_support import check_trl_version
from tlt_cli.plugins import trl_reporting
from tlt_cli.tasks.base import Task
from tlt_cli.tasks.prompts import uses_chat_template

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedTokenizerBase
    from trl import GRPOConfig

# GRPOConfig fields the recipe sets through its own keys: field -> the recipe key to set instead
DERIVED = {
    "learning_rate": "actor.lr",
    "weight_decay": "actor.weight_decay",
    "max_grad_norm": "actor.grad_clip",
    "beta": "actor.kl_coef",
    "epsilon": "actor.clip_ratio",
    "num_iterations": "actor.ppo_epochs",
    "per_device_train_batch_size": "actor.micro_batch_size",
    "gradient_checkpointing": "actor.gradient_checkpointing",
    "gradient_accumulation_steps": "train.prompts_per_step and actor.micro_batch_size",
    "steps_per_generation": "train.prompts_per_step and actor.micro_batch_size",
    "generation_batch_size": "train.prompts_per_step and train.group_size",
    "num_generations": "train.group_size",
    "max_steps": "train.steps",
    "num_train_epochs": "train.steps",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "top_k": "rollout.top_k",
    "max_completion_length": "rollout.max_new_tokens",
    "use_vllm": "rollout.backend",
    "seed": "run.seed",
    "output_dir": "run.output_dir and run.name",
    "use_cpu": "actor.devices",
    "bf16": "actor.precision",
    "fp16": "actor.precision",
    "save_strategy": "checkpoint.every",
    "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep",
    "vllm_importance_sampling_correction": "actor.rollout_correction",
    "vllm_importance_sampling_mode": "actor.rollout_correction",
    "vllm_importance_sampling_clip_max": "actor.rollout_correction_cap",
}
# actor.rollout_correction -> TRL's vllm_importance_sampling_mode. TRL 1.16 applies it itself only when it generates
# with vLLM (use_vllm, which tlt's rollout_func replaces); tlt's trainer (tlt_cli/integrations/trl_trainer.py) reads
# these fields and applies the native loop's truncated weights to tlt's rollout
TRL_CORRECTION_MODES = {
    RolloutCorrection.token: "token_truncate",
    RolloutCorrection.sequence: "sequence_truncate",
    RolloutCorrection.off: "token_truncate",
}
# GRPOConfig fields tlt's run sets as it needs them (its trace, display and checkpoints)
RUN_OWNED = (
    "logging_steps",
    "logging_strategy",
    "report_to",
    "disable_tqdm",
    "resume_from_checkpoint",
    "log_completions",
    "logging_dir",
    "overwrite_output_dir",
)
# the constant learning rate of tlt's own actor
LR_SCHEDULE = "constant"
# the TRL run's own output folder inside the run directory (TRL writes nothing there with saving off)
TRL_OUTPUT = "trl"


def grpo_config_arguments(recipe: Recipe, processes: int, run_directory: Path) -> dict[str, Any]:
    """GRPOConfig keyword arguments: the recipe's keys translated (module docstring), then the trl section."""
    completions_per_process = recipe.train.prompts_per_step * recipe.train.group_size // processes
    accumulation = completions_per_process // recipe.actor.micro_batch_size
    rollout, actor = recipe.rollout, recipe.actor
    derived = {
        "learning_rate": actor.lr,
        "weight_decay": actor.weight_decay,
        "max_grad_norm": actor.grad_clip,
        "beta": actor.kl_coef,
        "epsilon": actor.clip_ratio,
        "num_iterations": actor.ppo_epochs,
        "per_device_train_batch_size": actor.micro_batch_size,
        # TRL's own default is on; the recipe's key decides, as for the native actor
        "gradient_checkpointing": actor.gradient_checkpointing,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": accumulation,
        "num_generations": recipe.train.group_size,
        "max_steps": recipe.train.steps * actor.ppo_epochs,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "max_completion_length": rollout.max_new_tokens,
        "seed": recipe.run.seed,
        "output_dir": str(run_directory / TRL_OUTPUT),
        "use_cpu": actor.devices == CPU_DEVICES,
        "bf16": actor.precision == Precision.bf16,
        "save_strategy": "no",
        "logging_steps": 1,
        # the recipe's logger plugins TRL has too log TRL's own numbers (its process sets their environment)
        "report_to": trl_reporting(recipe.plugins.enabled, dict(recipe.plugins.options), run_directory)[0] or "none",
        "disable_tqdm": True,
        "lr_scheduler_type": LR_SCHEDULE,
        "vllm_importance_sampling_correction": actor.rollout_correction != RolloutCorrection.off,
        "vllm_importance_sampling_mode": TRL_CORRECTION_MODES[actor.rollout_correction],
        "vllm_importance_sampling_clip_max": actor.rollout_correction_cap,
        "shuffle_dataset": False,
    }
    return {**derived, **dict(recipe.trl)}


def trl_recipe_problem(recipe: Recipe, trl_version: str | None = None) -> str | None:
    """Why TRL's GRPOConfig does not take the recipe's settings and trl section, in one sentence naming the key;
    None when it does. An UnsupportedTrlError first when TRL is missing or unsupported.

    trl_version: the version to check instead of the installed one (tests).
    """
    check_trl_version(trl_version)
    from trl import GRPOConfig

    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    for key in recipe.trl:
        problem = _key_problem(key, fields)
        if problem is not None:
            return problem
    try:
        build_grpo_config(recipe, recipe.workers.count, Path(recipe.run.output_dir) / recipe.run.name)
    except (ValueError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return f"trl: TRL's GRPOConfig refuses the recipe's settings: {reason}"
    return None


def _key_problem(key: str, fields: set[str]) -> str | None:
    if key in DERIVED:
        return f"trl.{key} is set from the recipe's {DERIVED[key]}; set that instead."
    if key in RUN_OWNED:
        return f"trl.{key} is set by tlt for its trace, display and checkpoints; remove it."
    if key not in fields:
        close = difflib.get_close_matches(key, sorted(fields), n=1)
        hint = f"did you mean trl.{close[0]}?" if close else "see the fields of trl.GRPOConfig."
        return f"trl.{key} is not a field of TRL's GRPOConfig; {hint}"
    return None


def build_grpo_config(recipe: Recipe, processes: int, run_directory: Path) -> GRPOConfig:
    """TRL's GRPOConfig for this recipe (creates no folder)."""
    from trl import GRPOConfig

    with warnings.catch_warnings():
        # transformers' notice that GRPOConfig's gradient_checkpointing field is deprecated: not the user's doing
        warnings.simplefilter("ignore", FutureWarning)
        return GRPOConfig(**grpo_config_arguments(recipe, processes, run_directory))


def prompt_dataset(task: Task, recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """The task's problems in tlt's data order (step s takes problems s*prompts_per_step onwards), one row each.

    With a chat template a prompt is one user message, which TRL renders with the generation prompt
    as tlt's own rollout does (tlt_cli/tasks/prompts.py); without one it is the plain text.
    """
    from datasets import Dataset

    indexes = list(range(recipe.train.steps * recipe.train.prompts_per_step))
    texts = [task.problem(index).prompt for index in indexes]
    prompts = [[{"role": "user", "content": text}] for text in texts] if uses_chat_template(tokenizer) else texts
    return Dataset.from_dict({"prompt": prompts, "problem_index": indexes})


class TaskReward:
    """The task's exact reward as a TRL reward function; keeps the rewards of its latest call (for the trace)."""

    def __init__(self, task: Task):
        self.task = task
        self.__name__ = f"{task.name}_reward"
        self.latest: list[float] = []

    def __call__(self, prompts: list, completions: list, problem_index: list[int], **_: Any) -> list[float]:
        self.latest = [
            self.task.reward(self.task.problem(index), _text(completion))
            for index, completion in zip(problem_index, completions, strict=True)
        ]
        return self.latest


def _text(completion: Any) -> str:
    """A completion as text: TRL hands a string, or for conversational prompts a list of messages."""
    return completion if isinstance(completion, str) else completion[-1]["content"]
