"""Where a run's warmed-up drafter is cached: the key of everything that determines it.

With `drafter.init: warmup` the composition root (tlt_cli/training/setup.py, `prepare_drafter`)
trains a drafter on the target's own generations once (tlt_cli/drafter/warmup.py) and caches it in
`warmup_folder(recipe, cache)`, keyed by the recipe's model, task and warm-up settings, so the next run of the
recipe starts at once. A recipe's first warm-up trains the drafter tlt already holds for the model further when
there is one (tlt_cli/drafter/library.py: written by earlier runs or another recipe's warm-up), on task prompts of
its own (`first_warmup_prompt`), so what earlier runs taught it adds up instead of starting over.
`cached_warmup(folder)` says whether a cached warm-up can be used: a
damaged one (its config does not parse, its weights do not match it) is warned about and counts as absent, so
the warm-up runs again and replaces it (tlt made the folder; nothing the user saved is lost).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

from tlt_cli.config import Recipe
from tlt_cli.drafter.model import DrafterLoadError, read_drafter_metadata

LOGGER = logging.getLogger(__name__)

# 2: hidden states from the engine, a draft vocabulary (drafter.vocab_size); 3: prompts through the chat template;
# 4: sampled in bfloat16 where the machine has it, held-out responses sampled, trained until held-out acceptance
# stops rising; 5: trained over draft depths (drafter.train_depths), stopped when the held-out accept length stops
# rising; 6: trains the drafter tlt holds for the model further, on prompts of its own
WARMUP_FORMAT = 6
# prompt blocks a warm-up that trains a held drafter further chooses among (first_warmup_prompt)
FURTHER_BLOCKS = 100_000


def warmup_key(recipe: Recipe, cache: Path) -> str:
    """A short hash of what determines the recipe's warmed-up drafter (the model by its files, not only its path)."""
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
        "rollout_dtype": str(recipe.rollout.dtype),
        "drafter": {
            key: value
            for key, value in asdict(recipe.drafter).items()
            if key.startswith("warmup") or key in ("vocab_size", "loss", "train_depths")
        },
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=str).encode()).hexdigest()[:16]


def warmup_folder(recipe: Recipe, cache: Path) -> Path:
    """The folder the recipe's warmed-up drafter is cached in under the model cache `cache`."""
    return cache / "drafters" / f"warmup-{warmup_key(recipe, cache)}"


def first_warmup_prompt(start: Path | None, prompts: int) -> int:
    """Where in the task's prompts a warm-up samples from: 0 for a fresh drafter; for one trained further, a
    block of `prompts` prompts chosen by its weights, so it trains on prompts its earlier warm-up did not sample
    (a dataset of fewer prompts wraps around: other permutations of its epochs)."""
    if start is None:
        return 0
    return (1 + int(read_drafter_metadata(start)["weights_sha256"][:8], 16) % FURTHER_BLOCKS) * prompts


def cached_warmup(folder: Path) -> bool:
    """Whether `folder` holds a whole cached warm-up (module docstring); a damaged one is a warning and False."""
    if not folder.exists():
        return False
    try:
        read_drafter_metadata(folder)
    except DrafterLoadError:
        LOGGER.warning(
            "the cached drafter warm-up %s is damaged (its config or weights do not read back whole); warming up "
            "again.",
            folder,
        )
        return False
    return True
