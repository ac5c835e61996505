"""Speculative decoding in the embedded engine is lossless: same greedy tokens, same sampling law."""

import inspect

import pytest
import torch
from scipy.stats import chisquare
from tiny_models import tiny_llama, tiny_qwen2
from torch import nn
from transformers import DynamicCache, Qwen2ForCausalLM

from tlt_cli.drafter.model import DrafterOutput, EagleDrafter
from tlt_cli.drafter.vocabulary import DraftVocabulary, most_frequent_tokens
from tlt_cli.engine.sampling import SamplingParams, apply_sampling
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.rollout.types import RolloutRequest
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.proposer import Proposer
from tlt_cli.speculative.shapes import shape_problem, topk_fit_problem
from tlt_cli.speculative.types import DRAFT_SOURCES, SpeculativeConfig

torch.set_num_threads(1)

BOS = 1
CHAINS = [SpeculativeConfig(steps) for steps in (1, 2, 4, 8)]
TREES = [
    SpeculativeConfig(2, 2, 4),
    SpeculativeConfig(3, 2, 6),
    SpeculativeConfig(4, 4, 16),
    SpeculativeConfig(8, 4, 32),
]


def tiny_target(vocab_size: int = 64, initializer_range: float = 0.02) -> Qwen2ForCausalLM:
    return tiny_qwen2(vocab_size=vocab_size, max_position_embeddings=256, initializer_range=initializer_range)


class PrefixedCache:
    """The engine's drafter cache with the target's keys and values of BOS prepended."""

    def __init__(self, cache, prefix: DynamicCache):
        self.cache, self.prefix = cache, prefix

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None, **call_kwargs):
        keys, values = self.cache.update(key_states, value_states, layer_idx)
        layer = self.prefix.layers[layer_idx]
        batch_size = keys.shape[0]
        return (
            torch.cat([layer.keys.expand(batch_size, -1, -1, -1), keys], dim=2),
            torch.cat([layer.values.expand(batch_size, -1, -1, -1), values], dim=2),
        )


class TargetAsDrafter(nn.Module):
    """A drafter that predicts exactly what the target would (optionally with fixed logit noise
    keyed on the input token, which keeps drafts a function of each request's own context), over
    the target's whole vocabulary or only the tokens of `vocabulary`.

    Drafter entry t carries token t+1, so it runs the target on that token at position t+1 over
    the engine's drafter cache, with the target's entry for BOS (every prompt's token 0) in front.
    """

    def __init__(self, target, logit_noise: float = 0.0, vocabulary: DraftVocabulary | None = None):
        super().__init__()
        self.target = target
        self.config = target.config
        self.vocabulary = vocabulary or DraftVocabulary.full(target.config.vocab_size)
        with torch.no_grad():
            self.prefix = DynamicCache(config=target.config)
            target.get_decoder()(input_ids=torch.tensor([[BOS]]), past_key_values=self.prefix, use_cache=True)
        generator = torch.Generator().manual_seed(11)
        self.noise = logit_noise * torch.randn(target.config.vocab_size, target.config.vocab_size, generator=generator)

    def forward(self, input_ids, target_hidden, position_ids, attention_mask, past_key_values):
        batch_size, entries = input_ids.shape
        sees_bos = torch.ones(batch_size, 1, entries, 1, dtype=torch.bool)
        hidden = self.target.get_decoder()(
            input_ids=input_ids,
            position_ids=position_ids + 1,
            attention_mask=torch.cat([sees_bos, attention_mask], dim=3),
            past_key_values=PrefixedCache(past_key_values, self.prefix),
            use_cache=False,
        ).last_hidden_state
        logits = self.target.lm_head(hidden) + self.noise[input_ids]
        return DrafterOutput(hidden=hidden, logits=self.vocabulary.restrict(logits))

    def refresh_draft_head(self) -> None:
        """Nothing to re-read: the logits come from the target's lm_head at every call."""


def requests_for(batch_size: int, seed: int, vocab_size: int = 64) -> list[RolloutRequest]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 10, (batch_size,), generator=generator).tolist()
    return [
        RolloutRequest(index, (BOS, *torch.randint(2, vocab_size, (length,), generator=generator).tolist()))
        for index, length in enumerate(lengths)
    ]


def generate(model, requests, params, eos_token_id, speculative=None, seed=0):
    engine = EmbeddedEngine(model, eos_token_id=eos_token_id, pad_token_id=0, speculative=speculative)
    return engine.generate(requests, params, torch.Generator().manual_seed(seed))


def frequent_token(completions) -> int:
    """A token the plain run emits inside several responses: used as EOS so requests end mid-draft."""
    counts = torch.bincount(torch.tensor([t for c in completions for t in c.response_ids[1:-1]]), minlength=64)
    return int(counts.argmax())


@pytest.mark.parametrize("drafter_kind", ["random", "target"])
def test_greedy_chain_is_token_identical_for_every_batch_size_and_depth(drafter_kind):
    target = tiny_target()
    drafter = EagleDrafter(target, seed=3) if drafter_kind == "random" else TargetAsDrafter(target)
    greedy = SamplingParams(max_new_tokens=19, temperature=0.0)
    for batch_size in range(1, 17):
        requests = requests_for(batch_size, seed=batch_size)
        eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
        plain = generate(target, requests, greedy, eos_token_id)
        config = CHAINS[batch_size % 4]
        speculative = generate(target, requests, greedy, eos_token_id, SpeculativeDecoder(drafter, config))
        assert [c.response_ids for c in speculative] == [c.response_ids for c in plain], (batch_size, config)
        assert [c.finished_by_eos for c in speculative] == [c.finished_by_eos for c in plain]


@pytest.mark.parametrize("config", CHAINS + TREES, ids=lambda config: config.label())
@pytest.mark.parametrize("drafter_kind", ["random", "noisy-target"])
def test_greedy_sd_is_token_identical_at_batch_16(config, drafter_kind):
    target = tiny_target()
    drafter = EagleDrafter(target, seed=4) if drafter_kind == "random" else TargetAsDrafter(target, logit_noise=0.5)
    greedy = SamplingParams(max_new_tokens=23, temperature=0.0)
    requests = requests_for(16, seed=20)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    speculative = generate(target, requests, greedy, eos_token_id, SpeculativeDecoder(drafter, config))
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain]
    assert any(c.finished_by_eos for c in plain) and any(not c.finished_by_eos for c in plain)


@pytest.mark.parametrize("config", [CHAINS[3], TREES[2]], ids=lambda config: config.label())
def test_untied_llama_target_and_hidden_states_under_sd(config):
    target = tiny_llama(64, 2, 256, num_key_value_heads=4, tie_word_embeddings=False)
    greedy = SamplingParams(max_new_tokens=17, temperature=0.0)
    requests = requests_for(5, seed=50)
    plain = generate(target, requests, greedy, 64)
    speculative_decoder = SpeculativeDecoder(TargetAsDrafter(target, logit_noise=0.5), config)
    engine = EmbeddedEngine(target, eos_token_id=64, pad_token_id=0, speculative=speculative_decoder)
    speculative = engine.generate(requests, greedy, torch.Generator(), return_hidden=True)
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain]
    for completion in speculative:
        # kept tree entries were moved into place: the stored hidden state produced each token
        assert target.lm_head(completion.target_hidden).argmax(dim=-1).tolist() == completion.response_ids
    assert sum(c.speculative.accepted_draft_tokens for c in speculative) > 0


@pytest.mark.parametrize("params", [SamplingParams(13, temperature=0.0), SamplingParams(13, temperature=0.7, top_k=20)])
def test_a_drafter_equal_to_the_target_accepts_every_chain_token(params):
    target = tiny_target()
    config = CHAINS[2]
    completions = generate(
        target, requests_for(6, seed=30), params, 64, SpeculativeDecoder(TargetAsDrafter(target), config)
    )
    for completion in completions:
        stats = completion.speculative
        assert len(completion.response_ids) == 13  # max_new_tokens cut inside the last accepted run
        assert stats.accepted_by_depth == stats.proposed_by_depth == [stats.verify_passes] * config.steps
        # 1 token from the prefill, then steps + 1 per verify pass
        assert stats.verify_passes == -(-12 // (config.steps + 1))


def test_a_drafter_equal_to_the_target_always_has_the_greedy_token_in_its_tree():
    # a tree keeps the best-scoring nodes, so deep nodes of the greedy path may be cut; the
    # drafter's top child at the root is the target's argmax and is always kept and accepted
    target = tiny_target()
    greedy = SamplingParams(13, temperature=0.0)
    completions = generate(
        target, requests_for(6, seed=30), greedy, 64, SpeculativeDecoder(TargetAsDrafter(target), TREES[1])
    )
    for completion in completions:
        stats = completion.speculative
        assert stats.accepted_by_depth[0] == stats.proposed_by_depth[0] == stats.verify_passes
        assert stats.accept_length > 2.0


def test_a_schedule_can_turn_sd_off_and_on_between_steps():
    # the drafter catches up on what plain steps decoded, so a drafter equal to the target still
    # accepts every drafted token when SD comes back on
    target = tiny_target()
    batch_sizes_seen = []

    def every_other_step(batch_size: int) -> SpeculativeConfig | None:
        batch_sizes_seen.append(batch_size)
        return CHAINS[2] if len(batch_sizes_seen) % 2 == 0 else TREES[1] if len(batch_sizes_seen) % 3 == 0 else None

    greedy = SamplingParams(max_new_tokens=25, temperature=0.0)
    requests = requests_for(6, seed=60)
    eos_token_id = frequent_token(generate(target, requests, greedy, eos_token_id=64))
    plain = generate(target, requests, greedy, eos_token_id)
    switched = generate(
        target, requests, greedy, eos_token_id, SpeculativeDecoder(TargetAsDrafter(target), every_other_step)
    )
    assert [c.response_ids for c in switched] == [c.response_ids for c in plain]
    for completion in switched:
        stats = completion.speculative
        assert stats.accepted_by_depth[0] == stats.proposed_by_depth[0] == stats.verify_passes > 0
    assert max(batch_sizes_seen) == len(requests) and min(batch_sizes_seen) < len(requests)


@pytest.mark.parametrize("config", [CHAINS[2], TREES[2]], ids=lambda config: config.label())
def test_acceptance_is_per_request_not_the_batch_minimum(config):
    target = tiny_target()
    drafter = TargetAsDrafter(target, logit_noise=0.8)
    greedy = SamplingParams(max_new_tokens=20, temperature=0.0)
    requests = requests_for(8, seed=40)
    batched = generate(target, requests, greedy, 64, SpeculativeDecoder(drafter, config))
    alone = [generate(target, [request], greedy, 64, SpeculativeDecoder(drafter, config))[0] for request in requests]
    assert [c.speculative for c in batched] == [c.speculative for c in alone]
    assert len({c.speculative.accepted_draft_tokens for c in batched}) > 1


def exact_three_token_law(target, prompt: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """P(t1, t2, t3) under the processed target distribution, by enumeration: [V, V, V]."""
    vocab_size = target.config.vocab_size
    first, second = torch.meshgrid(torch.arange(vocab_size), torch.arange(vocab_size), indexing="ij")
    sequences = torch.cat(
        [torch.tensor(prompt).expand(vocab_size**2, -1), first.reshape(-1, 1), second.reshape(-1, 1)], dim=1
    )
    with torch.no_grad():
        logits = target(sequences).logits[:, len(prompt) - 1 :]
    probs = apply_sampling(logits.reshape(-1, vocab_size), params).view(vocab_size, vocab_size, 3, vocab_size)
    p_first = probs[0, 0, 0]
    p_second = probs[:, 0, 1]  # [t1, t2]
    p_third = probs[:, :, 2]  # [t1, t2, t3]
    return p_first[:, None, None] * p_second[:, :, None] * p_third


SAMPLING = [SamplingParams(3, temperature=1.0), SamplingParams(3, temperature=0.8, top_k=5, top_p=0.9)]


SAMPLED_SHAPES = [SpeculativeConfig(3), SpeculativeConfig(2, 2, 5), SpeculativeConfig(2, 3, 6)]


@pytest.mark.parametrize("config", SAMPLED_SHAPES, ids=lambda config: config.label())
@pytest.mark.parametrize("params", SAMPLING, ids=["plain", "top-k-top-p"])
def test_sampled_sd_matches_the_target_distribution(config, params):
    target = tiny_target(vocab_size=8, initializer_range=0.4)
    assert_sd_has_the_target_law(target, EagleDrafter(target, seed=5), config, params)


def assert_sd_has_the_target_law(
    target,
    drafter,
    config: SpeculativeConfig,
    params: SamplingParams,
    prompt: tuple[int, ...] = (BOS, 3, 5),
    group_size: int = 1,
) -> list:
    """Chi-square test of 6000 SD samples of three tokens against the exact law of the target (in
    groups of `group_size` samples for n-gram proposals from siblings); returns the completions."""
    samples = 6000
    requests = [RolloutRequest(index, prompt, group=index // group_size) for index in range(samples)]
    completions = generate(
        target, requests, params, eos_token_id=8, speculative=SpeculativeDecoder(drafter, config), seed=1
    )
    accepted = sum(c.speculative.accepted_draft_tokens for c in completions)
    deepest = max(config.steps, config.ngram_tokens)
    assert 0 < accepted < sum(c.speculative.verify_passes for c in completions) * deepest
    triples = torch.tensor([c.response_ids for c in completions])
    observed = torch.bincount(triples[:, 0] * 64 + triples[:, 1] * 8 + triples[:, 2], minlength=512).double()
    expected = exact_three_token_law(target, prompt, params).reshape(-1).double() * samples
    # outcomes the filters rule out (top-k, top-p) never occur
    assert observed[expected == 0].sum() == 0
    # chi-square needs expected counts >= 5: pool the rare outcomes into one bin
    rare, common = (expected > 0) & (expected < 5), expected >= 5
    if rare.any():
        observed = torch.cat([observed[common], observed[rare].sum()[None]])
        expected = torch.cat([expected[common], expected[rare].sum()[None]])
    else:
        observed, expected = observed[common], expected[common]
    assert chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue > 0.01
    return completions


# 3 of the 8 tokens: q is zero on the other 5, which the target still samples (through the residual)
SAMPLED_DRAFT_VOCABULARY = DraftVocabulary(torch.tensor([1, 4, 6]), target_size=8)


@pytest.mark.parametrize("config", [SAMPLED_SHAPES[0], SAMPLED_SHAPES[2]], ids=lambda config: config.label())
@pytest.mark.parametrize("params", SAMPLING, ids=["plain", "top-k-top-p"])
@pytest.mark.parametrize("drafter_kind", ["random", "target"])
def test_sampled_sd_with_a_reduced_draft_vocabulary_keeps_the_target_distribution(config, params, drafter_kind):
    target = tiny_target(vocab_size=8, initializer_range=0.4)
    if drafter_kind == "random":
        drafter = EagleDrafter(target, seed=5, vocabulary=SAMPLED_DRAFT_VOCABULARY)
    else:
        drafter = TargetAsDrafter(target, vocabulary=SAMPLED_DRAFT_VOCABULARY)
    assert_sd_has_the_target_law(target, drafter, config, params)


@pytest.mark.parametrize("config", [CHAINS[2], CHAINS[3], TREES[1], TREES[2]], ids=lambda config: config.label())
@pytest.mark.parametrize("drafter_kind", ["random", "noisy-target"])
def test_greedy_sd_with_a_reduced_draft_vocabulary_is_token_identical(config, drafter_kind):
    target = tiny_target(vocab_size=512)
    greedy = SamplingParams(max_new_tokens=23, temperature=0.0)
    # the 64 tokens the target emits most often on other prompts: these requests also need others
    seen = generate(target, requests_for(16, seed=21, vocab_size=512), greedy, eos_token_id=512)
    vocabulary = most_frequent_tokens([c.response_ids for c in seen], target_size=512, size=64)
    if drafter_kind == "random":
        drafter = EagleDrafter(target, seed=4, vocabulary=vocabulary)
    else:
        drafter = TargetAsDrafter(target, logit_noise=0.5, vocabulary=vocabulary)
    requests = requests_for(16, seed=20, vocab_size=512)
    plain = generate(target, requests, greedy, eos_token_id=512)
    speculative = generate(target, requests, greedy, 512, SpeculativeDecoder(drafter, config))
    assert [c.response_ids for c in speculative] == [c.response_ids for c in plain]
    kept = set(vocabulary.target_ids.tolist())
    assert any(token not in kept for c in plain for token in c.response_ids)
    if drafter_kind == "noisy-target":
        assert sum(c.speculative.accepted_draft_tokens for c in speculative) > 0


def test_bad_configs_name_the_field_to_fix():
    assert shape_problem(SpeculativeConfig(2, 2, 4)) is None
    assert "draft_tokens" in shape_problem(SpeculativeConfig(2, 2, 9))
    assert "steps" in shape_problem(SpeculativeConfig(0))
    assert "draft_tokens" in shape_problem(SpeculativeConfig(3, 1, 7))
    assert "topk is 0" in shape_problem(SpeculativeConfig(2, 0, 3))
    # the decoder refuses a shape it is handed with the same sentence
    with pytest.raises(ValueError, match="^a chain .topk 1. of 3 steps verifies 4 tokens"):
        SpeculativeDecoder(EagleDrafter(tiny_target(vocab_size=8)), SpeculativeConfig(3, 1, 7))
    with pytest.raises(ValueError, match="topk"):
        SpeculativeDecoder(EagleDrafter(tiny_target(vocab_size=8)), SpeculativeConfig(2, 9, 4))


def test_topk_is_checked_against_the_draft_vocabulary_not_the_targets():
    target = tiny_target(vocab_size=8)
    drafter = EagleDrafter(target, vocabulary=DraftVocabulary(torch.tensor([0, 2, 4, 6]), 8))
    assert topk_fit_problem(SpeculativeConfig(2, 4, 6), drafter.vocabulary.size) is None
    # topk 5 fits the target's 8 tokens but not the drafter's 4
    with pytest.raises(ValueError, match="topk is 5; set it between 1 and the draft vocabulary size 4"):
        SpeculativeDecoder(drafter, SpeculativeConfig(2, 5, 6))
    # a model-free shape drafts with no drafter, so no draft vocabulary bounds it
    assert topk_fit_problem(SpeculativeConfig(0, ngram_tokens=4), 1) is None


def test_a_decoder_keeps_one_proposer_per_draft_source_behind_the_proposer_hooks():
    target = tiny_target()
    drafter = EagleDrafter(target, seed=3)
    shapes = {
        ("drafter",): (drafter, SpeculativeConfig(4)),
        ("ngram",): (None, SpeculativeConfig(0, ngram_tokens=4)),
        # every source, in DRAFT_SOURCES order
        DRAFT_SOURCES: (drafter, SpeculativeConfig(2, ngram_tokens=4, picks_source=True)),
    }
    for sources, (shape_drafter, config) in shapes.items():
        decoder = SpeculativeDecoder(shape_drafter, config)
        assert tuple(proposer.source for proposer in decoder.proposers) == sources
        for proposer in decoder.proposers:
            for hook in ("begin", "propose", "after_commit", "keep_rows"):
                expected = inspect.signature(getattr(Proposer, hook)).parameters
                assert inspect.signature(getattr(type(proposer), hook)).parameters.keys() == expected.keys(), hook
