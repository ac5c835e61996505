"""The words a recipe key may take (`RecipeChoice` enums, one per key that takes a few words) and `RecipeError`,
the refusal of a recipe: one sentence naming the key. tlt_cli/config/schema.py declares the keys that take them."""

from __future__ import annotations

from enum import Enum
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from tlt_cli.errors import UserError


class RecipeError(UserError):
    """A recipe (or an override) that cannot be run; the message names the key to fix."""


class RecipeChoice(str, Enum):
    """A key that takes one of a few words. Members are named by their recipe spelling (OmegaConf
    matches a recipe's value to a member's name), compare equal to it and print as it."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def choices(cls) -> str:
        """The recipe spellings, as an error message lists them: "off, fixed, adaptive"."""
        return ", ".join(member.value for member in cls)

    @classmethod
    def refusal(cls, key: str, value: Any) -> str:
        """The one sentence that refuses `value` for `key`, listing the choices."""
        return f"{key} must be one of {cls.choices()}, got {_flow_value(value)}."

    @classmethod
    def of(cls, value: Any, key: str) -> RecipeChoice:
        """`value` (a member or its recipe spelling) as a member, for values that do not come through a
        recipe (the TRL integration's Python arguments); RecipeError naming `key` otherwise."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            raise RecipeError(cls.refusal(key, value)) from None


class SpeculativeMode(RecipeChoice):
    """speculative.mode: how the rollout drafts."""

    off = "off"
    fixed = "fixed"
    adaptive = "adaptive"
    # per decode step from the pass costs measured on this machine and the run's own acceptance
    auto = "auto"


class Trainer(RecipeChoice):
    """train.trainer: whose GRPO loop trains the policy."""

    native = "native"
    # Hugging Face TRL's GRPOTrainer with tlt's rollout (tlt_cli/integrations/trl_run.py)
    trl = "trl"


class RolloutBackendName(RecipeChoice):
    """rollout.backend: what generates the rollout (tlt_cli/training/setup.py builds the backend it names)."""

    # the in-process engine on the actor's own weights (tlt_cli/rollout/embedded.py)
    embedded = "embedded"
    # SGLang servers each worker starts and owns (tlt_cli/sglang/rollout.py)
    sglang = "sglang"
    # TRL's own generation, no speculative decoding (train.trainer trl only)
    trl = "trl"


class LinearForms(RecipeChoice):
    """rollout.linear_forms: how the embedded engine computes its linear layers."""

    # the form measured fastest on this machine for the rows of each pass (tlt_cli/tuning/linear_forms.py)
    auto = "auto"
    # plain nn.Linear
    off = "off"


class RolloutDtype(RecipeChoice):
    """rollout.dtype: the precision the embedded engine decodes in."""

    # measured once per machine, model and batch (tlt_cli/tuning/precision.py)
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class Precision(RecipeChoice):
    """actor.precision: the precision of the actor's update (`auto` is resolved before the workers start,
    tlt_cli/training/update_precision.py)."""

    auto = "auto"
    fp32 = "fp32"
    # bfloat16 compute with float32 master weights and AdamW state
    bf16 = "bf16"


class Bfloat16Rounding(RecipeChoice):
    """actor.bfloat16_rounding: how bfloat16 copies of the float32 policy round (tlt_cli/engine/rounding.py)."""

    # unbiased, so a copy follows updates far below a bfloat16 ulp; the rollout's and learner's copies agree
    stochastic = "stochastic"
    # round-to-nearest: a small update flips every weight halfway between two bfloat16 values (for comparison)
    nearest = "nearest"


class RolloutCorrection(RecipeChoice):
    """actor.rollout_correction: the truncated importance sampling of the rollout/learner mismatch
    (tlt_cli/training/rollout_correction.py)."""

    # each token's loss weighted by min(pi_old/pi_rollout, cap)
    token = "token"
    # one weight per response: the product of its tokens' ratios, truncated
    sequence = "sequence"
    # no weight (the mismatch is still measured)
    off = "off"


class DrafterStart(RecipeChoice):
    """drafter.init's words; any other value is a folder tlt saved a drafter in (the key stays a string)."""

    # the newest drafter tlt holds for this model (written by an earlier run or warm-up), else as online
    auto = "auto"
    # a fresh drafter, no wait: trained online by the sidecar from step 0's rollouts
    online = "online"
    # trained offline on the target's generations, cached
    warmup = "warmup"
    random = "random"


class DrafterLossKind(RecipeChoice):
    """drafter.loss: the drafter's next-token objective (tlt_cli/drafter/loss.py)."""

    # soft cross-entropy and total variation at the rollout's temperature: what lossless sampling accepts
    acceptance = "acceptance"
    # EAGLE's: soft cross-entropy at temperature 1, weight 0.1
    eagle = "eagle"


class ServedDtype(RecipeChoice):
    """rollout.sglang.dtype: the weight and activation dtype of the served model (SGLang's --dtype)."""

    # the model's own dtype
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"


def _flow_value(value: Any) -> str:
    """A recipe value as one quoted word or one line of YAML, for an error message."""
    if isinstance(value, DictConfig | ListConfig):
        value = OmegaConf.to_container(value)
    if isinstance(value, dict | list):
        return yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return f"'{value}'"
