"""The DeepSpeed actor on CPU (one rank): log-probs, a GRPO update, and an exact save/load."""

import copy
import math
from dataclasses import replace

import pytest
import torch
from test_logprobs import full_vocabulary_logprobs
from tiny_models import tiny_qwen2

from tlt_cli.config import ActorConfig
from tlt_cli.rollout.types import Completion
from tlt_cli.training import actor as actor_module
from tlt_cli.training import memory
from tlt_cli.training.actor import Actor
from tlt_cli.training.policy_batch import build_policy_batch

MEGABYTE = 1e6


def tiny_policy(seed=0):
    return tiny_qwen2(vocab_size=32, seed=seed)


def rollout_batch():
    completions = [
        Completion(
            request_id=i,
            prompt_ids=(1, 2, 3)[: 2 + i % 2],
            response_ids=[5 + i, 6, 7, 2][: 2 + i % 3],
            finished_by_eos=True,
            start=0.0,
            end=1.0,
        )
        for i in range(6)
    ]
    return build_policy_batch(completions, torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0]), pad_token_id=0)


def test_policy_batch_sorts_rows_by_length_and_masks_exactly_the_response_tokens():
    batch = rollout_batch()
    assert batch.input_ids.shape == (6, 7)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert lengths == sorted(lengths) == [4, 5, 5, 6, 6, 7]
    # the shortest row is request 0: prompt (1, 2), response [5, 6]; advantages travel with their rows
    assert batch.input_ids[0, :4].tolist() == [1, 2, 5, 6]
    assert batch.response_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert batch.advantages[0].item() == 1.0 and batch.advantages[-1].item() == -2.0
    assert batch.response_token_count == sum(2 + i % 3 for i in range(6))


def test_logprobs_match_a_plain_forward_and_update_changes_every_parameter(single_process_group):
    policy = tiny_policy()
    before = copy.deepcopy(policy.state_dict())
    actor = Actor(
        policy,
        ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0, zero_stage=2),
        sequences_per_update=6,
    )
    batch = actor.logprobs(rollout_batch())
    with torch.no_grad():
        expected = full_vocabulary_logprobs(
            policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits, batch.input_ids
        )
    mask = batch.response_mask.bool()
    assert torch.allclose(batch.old_logprobs[mask], expected[mask], atol=1e-5)
    metrics = actor.update(batch)
    assert metrics.ratio_mean == pytest.approx(1.0, abs=1e-4) and metrics.grad_norm > 0
    after = actor.policy.state_dict()
    unchanged = [name for name, value in before.items() if torch.equal(value, after[name])]
    assert unchanged == []
    assert actor.policy is policy  # the rollout engine shares these very weights


def test_save_then_load_restores_weights_and_optimizer_exactly(single_process_group, tmp_path):
    first = Actor(
        tiny_policy(),
        ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0),
        sequences_per_update=6,
    )
    first.update(first.logprobs(rollout_batch()))
    first.save(tmp_path)
    first.update(first.logprobs(rollout_batch()))
    continued = {name: value.clone() for name, value in first.policy.state_dict().items()}

    second = Actor(
        tiny_policy(seed=1),
        ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0),
        sequences_per_update=6,
    )
    second.load(tmp_path)
    second.update(second.logprobs(rollout_batch()))
    for name, value in second.policy.state_dict().items():
        assert torch.equal(value, continued[name]), name


def test_single_pass_update_equals_recomputing_old_logprobs_first(single_process_group):
    config = ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0)
    fused = Actor(tiny_policy(), config, sequences_per_update=6)
    seen = []
    fused.update(
        rollout_batch(), on_hidden_states=lambda micro_batch, hidden: seen.append((micro_batch.size, hidden.shape))
    )
    two_pass = Actor(tiny_policy(), config, sequences_per_update=6)
    two_pass.update(two_pass.logprobs(rollout_batch()))
    for (name, value), other in zip(fused.policy.state_dict().items(), two_pass.policy.state_dict().values()):
        assert torch.allclose(value, other, atol=1e-6), name
    # the sidecar hook sees every micro-batch's hidden states once: [b, t, hidden]
    assert [size for size, _ in seen] == [4, 2] and all(shape[-1] == 32 for _, shape in seen)


def test_an_update_through_chunked_logprobs_moves_the_weights_as_full_vocabulary_logprobs_did(
    single_process_group, monkeypatch
):
    config = ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0, kl_coef=0.1)
    chunked = Actor(tiny_policy(), config, sequences_per_update=6, reference=tiny_policy(seed=1))
    chunked_metrics = chunked.update(rollout_batch())

    def full_vocabulary(model, hidden, batch):
        logprobs = full_vocabulary_logprobs(model.get_output_embeddings()(hidden), batch.input_ids)
        return logprobs * batch.response_mask

    monkeypatch.setattr(actor_module, "_response_logprobs", full_vocabulary)
    full = Actor(tiny_policy(), config, sequences_per_update=6, reference=tiny_policy(seed=1))
    full_metrics = full.update(rollout_batch())
    assert chunked_metrics.loss == pytest.approx(full_metrics.loss, rel=1e-5)
    assert chunked_metrics.kl == pytest.approx(full_metrics.kl, rel=1e-5) and chunked_metrics.kl > 0
    # the gradient's norm over every parameter (AdamW's first step, about lr * sign(g), would magnify
    # float32 rounding in near-zero gradients; test_logprobs.py compares each parameter's gradient)
    assert chunked_metrics.grad_norm == pytest.approx(full_metrics.grad_norm, rel=1e-5)


def test_the_actors_adamw_is_fused_and_moves_the_weights_as_torchs_per_tensor_adamw(single_process_group, monkeypatch):
    config = ActorConfig(precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0, zero_stage=2)
    fused = Actor(tiny_policy(), config, sequences_per_update=6)
    assert torch_optimizer(fused).defaults["fused"] is True
    per_tensor_adamw = torch.optim.AdamW

    def unfused(*arguments, fused, **settings):
        return per_tensor_adamw(*arguments, foreach=False, **settings)

    monkeypatch.setattr(torch.optim, "AdamW", unfused)
    reference = Actor(tiny_policy(), config, sequences_per_update=6)
    assert not torch_optimizer(reference).defaults["fused"]
    for _ in range(3):  # the first step is about lr * sign(g); later ones weigh the moments
        fused_metrics, reference_metrics = fused.update(rollout_batch()), reference.update(rollout_batch())
        assert fused_metrics.loss == pytest.approx(reference_metrics.loss, rel=1e-5)
        assert fused_metrics.grad_norm == pytest.approx(reference_metrics.grad_norm, rel=1e-5)
    for (name, value), other in zip(fused.policy.state_dict().items(), reference.policy.state_dict().values()):
        # a key bias adds the same q.b to every score of a query, which softmax ignores: its gradient is float32
        # rounding, which AdamW's lr * g / |g| magnifies to about lr either way
        if "k_proj.bias" not in name:
            assert torch.allclose(value, other, rtol=1e-5, atol=1e-6), name


def torch_optimizer(actor: Actor) -> torch.optim.Optimizer:
    """The torch AdamW inside DeepSpeed's engine (ZeRO 1-2 wrap it; ZeRO 0 in float32 does not)."""
    optimizer = actor.engine.optimizer
    return getattr(optimizer, "optimizer", optimizer)


def long_rollout_batch(sequences, prompt_tokens, response_tokens, vocab_size):
    """`sequences` completions of random tokens, every response `response_tokens` long."""
    generator = torch.Generator().manual_seed(0)
    completions = [
        Completion(
            request_id=index,
            prompt_ids=tuple(torch.randint(1, vocab_size, (prompt_tokens,), generator=generator).tolist()),
            response_ids=torch.randint(1, vocab_size, (response_tokens,), generator=generator).tolist(),
            finished_by_eos=False,
            start=0.0,
            end=1.0,
        )
        for index in range(sequences)
    ]
    return build_policy_batch(completions, torch.randn(sequences, generator=generator), pad_token_id=0)


def test_gradient_checkpointing_gives_the_same_update_and_the_same_hidden_states(single_process_group):
    results = {}
    for recompute in (False, True):
        actor = Actor(
            tiny_policy(),
            ActorConfig(
                precision="fp32", lr=1e-2, micro_batch_size=4, micro_batch_tokens=0, gradient_checkpointing=recompute
            ),
            sequences_per_update=6,
        )
        hidden_states = []
        metrics = actor.update(
            rollout_batch(), on_hidden_states=lambda _, hidden, seen=hidden_states: seen.append(hidden)
        )
        results[recompute] = (metrics, hidden_states, actor.policy.state_dict())
    (plain, plain_hidden, plain_weights), (recomputed, recomputed_hidden, recomputed_weights) = (
        results[False],
        results[True],
    )
    assert recomputed.loss == pytest.approx(plain.loss, rel=1e-6)
    assert recomputed.grad_norm == pytest.approx(plain.grad_norm, rel=1e-6)
    # the drafter's hook still sees the actor's last hidden states, one [b, t, hidden] per micro-batch
    assert [hidden.shape for hidden in recomputed_hidden] == [hidden.shape for hidden in plain_hidden]
    for hidden, expected in zip(recomputed_hidden, plain_hidden):
        assert torch.allclose(hidden, expected, atol=1e-6)
    for name, value in recomputed_weights.items():
        assert torch.allclose(value, plain_weights[name], atol=1e-6), name


def test_gradient_checkpointing_lowers_the_updates_measured_peak(single_process_group):
    if not memory.reset_peak_resident():
        pytest.skip("this kernel does not let a process reset its resident high-water mark")
    # 8 layers of hidden 128 over 4 x 512 tokens: about 0.2 GB of saved activations without recomputation
    shape = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=8, max_position_embeddings=512)
    batch = long_rollout_batch(sequences=4, prompt_tokens=12, response_tokens=500, vocab_size=64)
    growth = {}
    # recomputation first: memory the first update frees but keeps resident could only shrink the second's
    # measured growth, so this order can only hide the difference, never make one up
    for recompute in (True, False):
        policy = tiny_qwen2(vocab_size=64, **shape)
        actor = Actor(
            policy,
            ActorConfig(precision="fp32", micro_batch_size=4, micro_batch_tokens=0, gradient_checkpointing=recompute),
            sequences_per_update=4,
        )
        before = memory.resident_bytes()
        memory.reset_peak_resident()
        actor.update(batch)
        growth[recompute] = memory.peak_resident_bytes() - before
    # measured here: 0.10 GB against 0.24 GB
    assert growth[False] - growth[True] > 80 * MEGABYTE, growth


def with_rollout_logprobs(batch, shift: float):
    """The batch as if the rollout's log-probs were the learner's minus `shift` on every response token."""
    rollout = (batch.old_logprobs - shift) * batch.response_mask
    return replace(batch, rollout_logprobs=rollout, old_logprobs=None)


@pytest.mark.parametrize(
    ("mode", "shift", "weight", "truncated"),
    [
        ("token", 0.0, 1.0, 0.0),
        ("token", 0.5, math.exp(0.5), 0.0),
        ("token", 1.0, 2.0, 1.0),
        ("sequence", 0.5, 2.0, 1.0),
    ],
)
def test_the_update_weights_its_loss_by_the_truncated_importance_weights_and_reports_the_mismatch(
    single_process_group, mode, shift, weight, truncated
):
    def loss_and_mismatch(correction):
        config = ActorConfig(
            lr=1e-2, micro_batch_size=4, micro_batch_tokens=0, precision="fp32", rollout_correction=correction
        )
        actor = Actor(tiny_policy(), config, sequences_per_update=6)
        metrics = actor.update(with_rollout_logprobs(actor.logprobs(rollout_batch()), shift))
        return metrics.loss, metrics.as_dict()

    uncorrected, measured = loss_and_mismatch("off")
    corrected, _ = loss_and_mismatch(mode)
    # at ratio pi/pi_old = 1 every token's surrogate is -A; a uniform weight scales the whole loss
    assert corrected == pytest.approx(weight * uncorrected, rel=1e-4) and uncorrected != 0.0
    # measured whatever the mode: K3 of log-ratio `shift` on every token, weights e^shift before truncation
    assert measured["rollout_kl_k3"] == pytest.approx(math.exp(shift) - shift - 1, abs=1e-6)
    assert measured["rollout_weight_max"] == pytest.approx(math.exp(shift), rel=1e-4)
    assert measured["rollout_weight_truncated"] == (truncated if mode == "token" else 0.0)
