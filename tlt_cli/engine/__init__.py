"""The decode-time model code of the rollout engine: one interface (`DecodeModel`, interface.py), the owned
forward of the Llama family (llama_family.py) and every other causal LM through transformers' public API
(transformers_path.py). `decode_model_for(policy)` picks the owned forward when it reproduces the model
exactly, else the transformers path; `describe()` says which, for the run log.
"""

from __future__ import annotations

import torch
from torch import nn

from tlt_cli.engine.interface import DecodeModel
from tlt_cli.engine.linear_forms import LinearFormPlan
from tlt_cli.engine.llama_family import LlamaFamilyModel, refusal
from tlt_cli.engine.transformers_path import TransformersModel


def decode_model_for(
    policy: nn.Module,
    dtype: torch.dtype | None = None,
    linear_plan: LinearFormPlan | None = None,
    stochastic_rounding: bool = True,
) -> DecodeModel:
    """The owned Llama-family forward of `policy` when it reproduces it, else the transformers path.

    dtype: of the owned path's weight copies and cache (None: the policy's; float32 is exact against `generate`);
    linear_plan: the measured product forms per weight shape and row count (None: F.linear everywhere), laid out
    in the owned path's weight copies or, on the transformers path, computed by a decode-time copy of the
    policy's modules (the policy's own dtype); stochastic_rounding: the owned path's bfloat16 copies of float32
    weights follow small updates (rounding.py), as the learner's do; False rounds them to nearest."""
    reason = refusal(policy)
    if reason is None:
        return LlamaFamilyModel(policy, dtype, linear_plan, stochastic_rounding)
    return TransformersModel(policy, reason, linear_plan)
