"""A target and its drafter loaded for measuring, with the decode plan they decode by, and the engine a
measurement times them on.

`tlt calibrate` and every `tlt bench` subcommand get their pair from the composition root's one loader
(tlt_cli/training/setup.py `model_pair`), so they decode as a run's worker does:

    pair, tokenizer = setup.model_pair(recipe, decode, drafter_folder)
    engine = shard_engine(pair, fixed_decoder(pair, config))   # `config` at every step (None: plain steps)
    engine.generate(requests, sampling, generator, on_decode_step=steps.append)
    pair.decode.pass_costs                                      # what mode auto's cost model chooses with
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tlt_cli.rollout.decode_plan import DecodePlan
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import SpeculativeConfig


@dataclass(frozen=True)
class ModelPair:
    """The target and its drafter on one device, the ids the engine needs, and the decode plan a worker's engine
    computes them by (its dtype, linear forms and, when measured, the pass costs)."""

    target: nn.Module
    drafter: nn.Module
    pad_token_id: int
    eos_token_id: int
    device: torch.device
    decode: DecodePlan = field(default_factory=DecodePlan)


def fixed_decoder(pair: ModelPair, config: SpeculativeConfig | None) -> SpeculativeDecoder:
    """A decoder with `config` at every step (None: plain decoding steps inside it, as the adaptive engine runs
    them; an n-gram index only where the configuration drafts with it)."""
    return SpeculativeDecoder(
        pair.drafter, lambda batch_size: config, uses_ngram=config is not None and config.uses_ngram
    )


def shard_engine(pair: ModelPair, decoder: SpeculativeDecoder) -> EmbeddedEngine:
    """The engine a shard is timed on: the pair's target with `decoder`, in the plan's dtype and linear forms."""
    return EmbeddedEngine(
        pair.target,
        eos_token_id=pair.eos_token_id,
        pad_token_id=pair.pad_token_id,
        speculative=decoder,
        linear_plan=pair.decode.linear_plan,
        dtype=pair.decode.torch_dtype,
    )
