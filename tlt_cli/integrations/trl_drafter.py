"""The drafter a TRL run starts speculating with, built on the module TRL trains.

`starting_drafter(source, policy, trainer, settings, seed)` turns `tlt_rollout(drafter=...)` into an
`EagleDrafter` over `policy` (the drafter shares the policy's embedding, final norm and lm_head):
  - "warmup": the offline warm-up of tlt_cli/drafter/warmup.py on the trainer's own data: the
    first `settings.warmup_prompts` prompts of its train_dataset, tokenized as TRL tokenizes them,
    sampled by the embedded engine at the trainer's sampling settings; the draft vocabulary is
    chosen from those responses and the drafter takes `settings.warmup_steps` steps. The result is
    cached under $TLT_CACHE_DIR/drafters/, keyed by the policy's weights, the prompts and the
    settings, so the next run starts at once; with several processes, the main one warms up first
    and the others load its result;
  - "online" (tlt_rollout's default), "auto" (`tlt train` resolves it to the drafter tlt holds before a script
    sees it) or "random": a fresh drafter (seeded), no wait; the sidecar trains an
    online one between data-parallel processes;
  - a folder written by `save_drafter`: loaded (checked against the policy);
  - an `EagleDrafter` the user built: its weights and vocabulary, rebuilt over `policy`;
and, when resuming, the drafter of the checkpoint folder instead. Called by tlt_cli/integrations/trl.py.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tlt_cli.checkpoint import DRAFTER_DIRECTORY
from tlt_cli.config import DrafterConfig, DrafterStart
from tlt_cli.drafter.initial import cached_warmup
from tlt_cli.drafter.model import CONFIG_FILE, EagleDrafter, load_drafter, save_drafter
from tlt_cli.errors import UserError
from tlt_cli.integrations.trl_support import policy_in_eval_mode, prompt_token_ids, trl_sampling
from tlt_cli.models.tiny import default_cache_dir
from tlt_cli.training.drafter_folder import load_named_drafter

# bump when the TRL warm-up's data or recipe changes, so old cached drafters are not reused (2: the run's
# objective, over draft depths)
TRL_WARMUP_FORMAT = 2
# AdamW weight decay of the offline warm-up (as tlt_cli/drafter/warmup.py's default)
WARMUP_WEIGHT_DECAY = 0.1


def starting_drafter(
    source: str | Path | EagleDrafter,
    policy: nn.Module,
    trainer: Any,
    settings: DrafterConfig,
    seed: int,
    checkpoint: Path | None = None,
) -> EagleDrafter:
    """The drafter over `policy` that `source` names (see the module docstring)."""
    if checkpoint is not None and (checkpoint / DRAFTER_DIRECTORY / CONFIG_FILE).is_file():
        return _loaded(checkpoint / DRAFTER_DIRECTORY, policy)
    if isinstance(source, EagleDrafter):
        return _rebuilt(source, policy, seed)
    # online (and auto, which `tlt train` resolves to a held drafter's folder before a script sees it): the sidecar
    # trains it from the first rollout
    if source in (DrafterStart.auto, DrafterStart.online, DrafterStart.random):
        return EagleDrafter(policy, seed=seed)
    if source == DrafterStart.warmup:
        return _warmed_up(policy, trainer, settings, seed)
    return _loaded(Path(source), policy)


def _loaded(folder: Path, policy: nn.Module) -> EagleDrafter:
    if not folder.is_dir():
        raise UserError(
            f"drafter {str(folder)!r} is not a drafter folder; give 'online', 'warmup', 'random' or a folder written "
            "by save_drafter or `tlt export-drafter`."
        )
    return load_named_drafter(folder, policy)


def _rebuilt(given: EagleDrafter, policy: nn.Module, seed: int) -> EagleDrafter:
    drafter = EagleDrafter(policy, seed=seed, vocabulary=given.vocabulary)
    if drafter.target_fingerprint != given.target_fingerprint:
        raise UserError(
            "the drafter given to tlt_rollout was built for another model; build it on the model given to GRPOTrainer."
        )
    drafter.load_state_dict(given.state_dict())
    return drafter


def _warmed_up(policy: nn.Module, trainer: Any, settings: DrafterConfig, seed: int) -> EagleDrafter:
    """The cached warm-up for this policy, prompts and settings; the main process makes it if missing."""
    prompts = prompt_token_ids(trainer, _first_prompts(trainer, settings.warmup_prompts))
    folder = default_cache_dir() / "drafters" / f"trl-warmup-{_warmup_key(policy, trainer, prompts, settings, seed)}"
    with trainer.accelerator.main_process_first():
        if not cached_warmup(folder):
            folder.parent.mkdir(parents=True, exist_ok=True)
            save_drafter(_warm_up(policy, trainer, prompts, settings, seed), folder)
    return load_drafter(folder, policy)


def _first_prompts(trainer: Any, count: int) -> list:
    prompts = [example["prompt"] for example in itertools.islice(trainer.train_dataset, count)]
    if not prompts:
        raise UserError("drafter='warmup' needs prompts in the trainer's train_dataset; it has none.")
    return prompts


def _warmup_key(policy: nn.Module, trainer: Any, prompts: list[list[int]], settings: DrafterConfig, seed: int) -> str:
    """A short hash of everything that determines the warmed-up drafter (the policy by its weights)."""
    digest = hashlib.sha256()
    for name, parameter in policy.state_dict().items():
        digest.update(name.encode())
        digest.update(parameter.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    description = {
        "format": TRL_WARMUP_FORMAT,
        "weights": digest.hexdigest(),
        "prompts": prompts,
        "seed": seed,
        "sampling": asdict(trl_sampling(trainer)),
        "drafter": {
            key: value
            for key, value in asdict(settings).items()
            if key.startswith("warmup") or key in ("vocab_size", "loss", "train_depths")
        },
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:16]


def _warm_up(
    policy: nn.Module, trainer: Any, prompts: list[list[int]], settings: DrafterConfig, seed: int
) -> EagleDrafter:
    """tlt_cli/drafter/warmup.py's phases 1-3 on these prompts: sample, choose the vocabulary, train."""
    from tlt_cli.drafter.loss import objective_named
    from tlt_cli.drafter.trainer import DrafterTrainer
    from tlt_cli.drafter.vocabulary import choose_vocabulary
    from tlt_cli.drafter.warmup import length_buckets, prompt_hidden_states, sample_completions, train_on_buckets

    tokenizer = trainer._tokenizer
    completions = sample_completions(policy, tokenizer, prompts, trl_sampling(trainer), seed, return_hidden=True)
    with policy_in_eval_mode(policy):
        prompt_states = prompt_hidden_states(policy, [completion.prompt_ids for completion in completions])
    vocabulary = choose_vocabulary(
        [completion.response_ids for completion in completions],
        settings.vocab_size,
        policy.config.vocab_size,
        tokenizer.eos_token_id,
    )
    drafter = EagleDrafter(policy, seed=seed, vocabulary=vocabulary)
    buckets = length_buckets(completions, prompt_states, settings.warmup_batch_size, tokenizer.pad_token_id)
    train_on_buckets(
        DrafterTrainer(
            drafter,
            lr=settings.warmup_lr,
            weight_decay=WARMUP_WEIGHT_DECAY,
            objective=objective_named(settings.loss, trl_sampling(trainer).temperature, settings.train_depths),
        ),
        buckets,
        settings.warmup_steps,
        seed,
    )
    drafter.eval()
    return drafter
