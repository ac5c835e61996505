"""What tlt reads from TRL: the supported releases, and a GRPOTrainer's prompts, sampling and weights.

tlt drives `GRPOTrainer` through its experimental `rollout_func` and reads a few of its attributes
and helpers; those change between minor releases, so only the range tested here is accepted.
`check_trl_version()` (no TRL import) is called by `tlt_rollout(...)` and by the checks of a TRL
recipe before anything starts. The rest reads one trainer, the way TRL itself does for its own
generation (trl/trainer/grpo_trainer.py, 1.16):
  - `prompt_token_ids`: TRL's own `_tokenize_prompts` (chat template with the generation prompt for
    conversational prompts, the tokenizer's defaults for text);
  - `trl_sampling`: temperature, top_p, top_k and max_completion_length, with `generation_kwargs`
    overrides; settings the engine cannot honour (min_p, repetition_penalty, tools, images, vLLM)
    are refused with one sentence;
  - `generation_policy`: the module TRL trains, unwrapped and, under DeepSpeed ZeRO-3, gathered by
    TRL's `unwrap_model_for_generation` (FSDP: its full parameters summoned), for one rollout;
    `policy_in_eval_mode` for tlt's own no-grad forwards on it (the drafter's prompt states).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.errors import UserError
from tlt_cli.versions import supported_ranges

if TYPE_CHECKING:
    from torch import nn

INSTALL_HINT = 'pip install -e ".[trl]"'
# generation_kwargs keys the engine honours (read below); any other key is refused
HONOURED_GENERATION_KEYS = frozenset({"do_sample", "temperature", "top_p", "top_k", "max_new_tokens"})


class UnsupportedTrlError(UserError):
    """TRL is missing or outside the supported range; the message names the range."""


class UnsupportedTrlSettingError(UserError):
    """A GRPOConfig setting tlt's rollout cannot honour; the message names it."""


def installed_trl_version() -> str | None:
    """The installed TRL's version string, or None when TRL is not installed."""
    try:
        return version("trl")
    except PackageNotFoundError:
        return None


def check_trl_version(found: str | None = None) -> str:
    """The installed (or given) TRL version; UnsupportedTrlError when it is missing or unsupported."""
    found = installed_trl_version() if found is None else found
    # the releases whose rollout_func contract tlt was written against and tested with: the trl extra's range
    supported = supported_ranges()["trl"]
    if found is None:
        raise UnsupportedTrlError(f"TRL is not installed; tlt's TRL rollout needs trl{supported} ({INSTALL_HINT}).")
    if not SpecifierSet(supported).contains(Version(found).public, prereleases=True):
        raise UnsupportedTrlError(
            f"TRL {found} is not supported; tlt's TRL rollout needs trl{supported} ({INSTALL_HINT})."
        )
    return found


def check_trainer_supported(trainer: Any) -> None:
    """Refuse, in one sentence, a trainer whose generation tlt's rollout cannot reproduce."""
    if trainer.use_vllm:
        raise UnsupportedTrlSettingError("use_vllm=True and tlt's rollout both generate; set use_vllm=False.")
    if trainer.tools or trainer.environment_factories is not None:
        raise UnsupportedTrlSettingError(
            "tlt's rollout does not run tool calls or environments; drop tools= and "
            "environment_factory= or leave out rollout_func."
        )
    if trainer._is_vlm:
        raise UnsupportedTrlSettingError(
            "tlt's rollout generates text only; use a text model's tokenizer as processing_class."
        )
    if trainer.min_p not in (None, 0.0):
        raise UnsupportedTrlSettingError(f"min_p={trainer.min_p} is not supported by tlt's rollout; leave min_p unset.")
    if trainer.repetition_penalty != 1.0:
        raise UnsupportedTrlSettingError(
            f"repetition_penalty={trainer.repetition_penalty} is not supported by tlt's rollout; leave it at 1.0."
        )
    if _zero_stage(trainer) == 3 and not trainer.args.ds3_gather_for_generation:
        raise UnsupportedTrlSettingError(
            "tlt's rollout under ZeRO-3 generates with gathered weights (processes "
            "decode different lengths); set ds3_gather_for_generation=True."
        )
    unknown = sorted(set(trainer.args.generation_kwargs or {}) - HONOURED_GENERATION_KEYS)
    if unknown:
        raise UnsupportedTrlSettingError(
            f"generation_kwargs {unknown} are not supported by tlt's rollout; use only "
            f"{sorted(HONOURED_GENERATION_KEYS)}."
        )


def _zero_stage(trainer: Any) -> int:
    """The DeepSpeed ZeRO stage the trainer runs under (0 without DeepSpeed)."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    return plugin.zero_stage if plugin is not None else 0


def trl_sampling(trainer: Any) -> SamplingParams:
    """The engine's sampling for this trainer: its settings, `generation_kwargs` overriding them as in TRL."""
    overrides = trainer.args.generation_kwargs or {}
    temperature = overrides.get("temperature", trainer.temperature)
    return SamplingParams(
        max_new_tokens=overrides.get("max_new_tokens", trainer.max_completion_length),
        temperature=0.0 if overrides.get("do_sample", True) is False else temperature,
        top_p=overrides.get("top_p", trainer.top_p) or 1.0,
        top_k=overrides.get("top_k", trainer.top_k) or 0,
    )


def prompt_token_ids(trainer: Any, prompts: list) -> list[list[int]]:
    """Token ids of each prompt, exactly as TRL tokenizes them for its own generation."""
    prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
    if images is not None:
        raise UnsupportedTrlSettingError("tlt's rollout generates text only; the prompts hold images.")
    return [list(ids) for ids in prompt_ids]


def eos_and_pad_ids(trainer: Any) -> tuple[list[int], int]:
    """(every id that ends a completion, tokenizer's eos first; the pad id TRL pads with)."""
    tokenizer = trainer._tokenizer
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return list(trainer.eos_token_ids), pad_token_id


@contextlib.contextmanager
def generation_policy(trainer: Any) -> Iterator[nn.Module]:
    """The module TRL trains, ready to generate with, for the block: as TRL's own generation gets it."""
    from trl.models.utils import unwrap_model_for_generation

    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            generation_kwargs=trainer.generation_kwargs,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as policy,
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        yield policy


@contextlib.contextmanager
def policy_in_eval_mode(policy: nn.Module) -> Iterator[None]:
    """The policy in eval mode (no dropout) for a no-grad forward of tlt's own, its mode back afterwards."""
    training = policy.training
    policy.eval()
    try:
        yield
    finally:
        policy.train(training)
