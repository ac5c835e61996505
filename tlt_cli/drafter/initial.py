"""Where a run's drafter starts: offline warm-up (cached), a random init, or a saved drafter folder.

The driver calls `prepare_initial_drafter` once before spawning workers: with `drafter.init:
warmup` it trains a drafter on the target's own generations (tlt_cli/drafter/warmup.py) and
caches it under the model cache, keyed by everything that determines it, so the next run with
the same model and task starts at once. Each worker then calls `initial_drafter` to build its
copy on top of its own policy (the drafter shares the policy's embedding, norm and lm_head); the
decoder it drafts in comes from the recipe's `speculative` section (tlt_cli/rollout/adaptive.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from tlt_cli.config import Recipe
from tlt_cli.drafter.model import CONFIG_FILE, EagleDrafter, load_drafter, save_drafter
from tlt_cli.plugins import plugins_train_drafter

if TYPE_CHECKING:
    from tlt_cli.drafter.warmup import WarmupProgress

# 2: hidden states from the engine, a draft vocabulary (drafter.vocab_size); 3: prompts through the chat template
WARMUP_FORMAT = 3


def warmup_key(recipe: Recipe, cache: Path) -> str:
    """A short hash of what determines the warmed-up drafter (the model by its files, not only its path)."""
    from tlt_cli.models.loading import model_fingerprint

    description = {
        "format": WARMUP_FORMAT,
        "model": recipe.model.path,
        "model_files": model_fingerprint(recipe.model.path),
        "task": recipe.task.name,
        "task_options": dict(recipe.task.options),
        "seed": recipe.run.seed,
        "max_new_tokens": recipe.rollout.max_new_tokens,
        "temperature": recipe.rollout.temperature,
        "drafter": {
            key: value
            for key, value in asdict(recipe.drafter).items()
            if key.startswith("warmup") or key == "vocab_size"
        },
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


def prepare_initial_drafter(
    recipe: Recipe, cache: Path, progress: WarmupProgress | None = None
) -> tuple[Path | None, dict | None]:
    """(folder of the starting drafter or None for a random start, warm-up report if one ran now);
    a warm-up that runs reports its phases to `progress` (see tlt_cli/drafter/warmup.py)."""
    if not needs_drafter(recipe) or recipe.drafter.init == "random":
        return None, None
    if recipe.drafter.init != "warmup":
        return Path(recipe.drafter.init), None
    folder = cache / "drafters" / f"warmup-{warmup_key(recipe, cache)}"
    if (folder / CONFIG_FILE).is_file():
        return folder, None
    return folder, _warm_up_into(recipe, folder, progress)


def _warm_up_into(recipe: Recipe, folder: Path, progress: WarmupProgress | None) -> dict:
    from tlt_cli.drafter.warmup import warm_up_drafter
    from tlt_cli.models.loading import load_policy
    from tlt_cli.tasks.registry import build_task

    target, tokenizer = load_policy(recipe.model.path)
    task = build_task(recipe.task.name, recipe.run.seed, dict(recipe.task.options))
    drafter, report = warm_up_drafter(
        target,
        tokenizer,
        task,
        steps=recipe.drafter.warmup_steps,
        batch_size=recipe.drafter.warmup_batch_size,
        lr=recipe.drafter.warmup_lr,
        seed=recipe.run.seed,
        train_prompts=recipe.drafter.warmup_prompts,
        max_new_tokens=recipe.rollout.max_new_tokens,
        temperature=max(recipe.rollout.temperature, 1e-3),
        vocab_size=recipe.drafter.vocab_size,
        progress=progress,
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    save_drafter(drafter, folder)
    return asdict(report)


def needs_drafter(recipe: Recipe) -> bool:
    """A run needs a drafter when it speculates or when a plugin trains one."""
    return recipe.speculative.mode != "off" or plugins_train_drafter(recipe.plugins.enabled)


def initial_drafter(recipe: Recipe, folder: Path | None, policy: PreTrainedModel) -> EagleDrafter:
    """This worker's drafter over its own policy: loaded from `folder`, or freshly initialised."""
    if folder is None:
        return EagleDrafter(policy, seed=recipe.run.seed)
    return load_drafter(folder, policy)
