"""The rollout's own log-probs (Completion.rollout_logprobs) against the learner's, on tiny seeded models.

With a float32 rollout they equal the learner's log-probs (the actor's chunked head over a transformers
forward of the whole sequence) within float32 rounding, whichever path produced the tokens: plain
decoding, chains, trees, n-gram and hybrid drafts, greedy and sampled; the K3 KL between them is ~0 and
the importance weights ~1. With a bfloat16 rollout the mismatch is measured: above zero, and small.
"""

import pytest
import torch
from test_ngram import grouped_requests
from test_speculative import TargetAsDrafter, tiny_target
from tiny_models import tiny_llama

from tlt_cli.engine import decode_model_for
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import Completion
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.logprobs import token_logprobs
from tlt_cli.training.policy_batch import build_policy_batch
from tlt_cli.training.rollout_correction import MismatchTotals

torch.set_num_threads(1)

NEVER_EMITTED = 64
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0)
SAMPLED = SamplingParams(max_new_tokens=20, temperature=0.8, top_k=20, top_p=0.9)
# plain, a chain, a tree, n-gram alone, and the drafter's chain with the n-gram branch in one pass
PATHS = {
    "plain": None,
    "chain": SpeculativeConfig(3),
    "tree": SpeculativeConfig(3, 2, 6),
    "ngram": SpeculativeConfig(steps=0, ngram_tokens=3),
    "hybrid": SpeculativeConfig(2, 1, 3, ngram_tokens=3),
}


def rollout(target, path: str, params: SamplingParams, decode_model=None, seed: int = 0) -> list[Completion]:
    config = PATHS[path]
    decoder = None
    if config is not None:
        drafter = TargetAsDrafter(target, logit_noise=0.8) if config.uses_drafter else None
        decoder = SpeculativeDecoder(drafter, config)
    engine = EmbeddedEngine(target, NEVER_EMITTED, 0, speculative=decoder, decode_model=decode_model)
    return engine.generate(
        grouped_requests(3, 3, seed=5), params, torch.Generator().manual_seed(seed), logprob_temperature=1.0
    )


def learner_and_rollout_logprobs(target, completions: list[Completion]) -> tuple[torch.Tensor, ...]:
    """(learner, rollout) log-probs of every response token, and the batch's response mask: the learner's as
    the actor computes them (tlt_cli/training/actor.py), over the batch build_policy_batch makes."""
    batch = build_policy_batch(completions, torch.zeros(len(completions)), pad_token_id=0)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        learner = token_logprobs(hidden, target.get_output_embeddings(), batch.input_ids, needed=batch.response_mask)
    return learner, batch.rollout_logprobs, batch.response_mask


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("path", list(PATHS))
def test_float32_rollout_logprobs_equal_the_learners_on_every_decoding_path(path, params):
    target = tiny_target()
    completions = rollout(target, path, params)
    assert all(c.rollout_logprobs.shape == (len(c.response_ids),) for c in completions)
    assert all(c.rollout_logprobs.dtype == torch.float32 for c in completions)
    if PATHS[path] is not None:
        assert sum(c.speculative.accepted_draft_tokens for c in completions) > 0
    learner, rollout_logprobs, mask = learner_and_rollout_logprobs(target, completions)
    on_response = mask.bool()
    assert (learner[on_response] - rollout_logprobs[on_response]).abs().max() < 1e-5
    totals = MismatchTotals("token", cap=2.0)
    totals.add(learner, rollout_logprobs, mask)
    metrics = totals.metrics()
    assert metrics["rollout_kl_k3"] < 1e-9
    assert metrics["rollout_weight_min"] > 1 - 1e-5 and metrics["rollout_weight_max"] < 1 + 1e-5
    assert metrics["rollout_weight_truncated"] == 0.0


def test_rollout_logprobs_at_a_temperature_are_the_scaled_distributions_and_cost_nothing_when_not_asked():
    target = tiny_llama(64, 2, 256, tie_word_embeddings=False)
    engine = EmbeddedEngine(target, NEVER_EMITTED, 0)
    requests = grouped_requests(2, 2, seed=9)
    completions = engine.generate(
        requests, SAMPLED, torch.Generator().manual_seed(3), return_hidden=True, logprob_temperature=0.8
    )
    for completion in completions:
        expected = torch.log_softmax(target.lm_head(completion.target_hidden) / 0.8, dim=-1)
        tokens = torch.tensor(completion.response_ids)
        assert torch.allclose(completion.rollout_logprobs, expected[torch.arange(len(tokens)), tokens], atol=1e-5)
    plain = engine.generate(requests, SAMPLED, torch.Generator().manual_seed(3))
    assert [c.response_ids for c in plain] == [c.response_ids for c in completions]
    assert all(c.rollout_logprobs is None for c in plain)


@pytest.mark.parametrize("path", ["plain", "tree"])
def test_a_bfloat16_rollout_has_a_small_measured_mismatch(path):
    target = tiny_target(initializer_range=0.2)
    completions = rollout(target, path, SAMPLED, decode_model=decode_model_for(target, dtype=torch.bfloat16))
    learner, rollout_logprobs, mask = learner_and_rollout_logprobs(target, completions)
    totals = MismatchTotals("token", cap=2.0)
    totals.add(learner, rollout_logprobs, mask)
    metrics = totals.metrics()
    # bfloat16 keeps 8 bits of mantissa: log-probs move by ~1e-2, so K3 ~ 1e-5..1e-3 as verl reports for dense models
    assert 1e-6 < metrics["rollout_kl_k3"] < 1e-2
    assert metrics["rollout_weight_min"] < 1.0 < metrics["rollout_weight_max"] < 2.0
    assert abs(metrics["rollout_weight_mean"] - 1.0) < 0.05
