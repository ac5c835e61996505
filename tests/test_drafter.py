"""CPU tests of the EAGLE drafter: shared frozen weights, KV-cached forward, save/load, loss."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_llama, tiny_qwen2
from transformers import DynamicCache, LlamaForCausalLM, Qwen2ForCausalLM

from tlt_cli.drafter.loss import drafter_loss
from tlt_cli.drafter.model import (
    CONFIG_FILE,
    DrafterLoadError,
    DrafterOutput,
    EagleDrafter,
    load_drafter,
    save_drafter,
)
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer, collect_drafter_batch, evaluate_drafter
from tlt_cli.drafter.warmup import warm_up_drafter
from tlt_cli.models.tiny import build_tiny_model, tiny_model_config, tiny_tokenizer
from tlt_cli.tasks.arithmetic import ArithmeticTask

torch.set_num_threads(1)

VOCAB_SIZE = 48
HIDDEN_SIZE = 32


def tiny_target_qwen2(seed: int = 0, hidden_size: int = HIDDEN_SIZE) -> Qwen2ForCausalLM:
    return tiny_qwen2(VOCAB_SIZE, seed, 128, hidden_size=hidden_size, tie_word_embeddings=True)


def tiny_llama_untied(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(VOCAB_SIZE, seed, 128, hidden_size=HIDDEN_SIZE, num_key_value_heads=4, tie_word_embeddings=False)


def confident_logits(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """Logits whose softmax is one-hot up to e^-100, so their entropy (the soft-CE floor) is ~0."""
    top_tokens = torch.randint(0, VOCAB_SIZE, shape, generator=generator)
    return torch.nn.functional.one_hot(top_tokens, VOCAB_SIZE).float() * 100.0


def random_inputs(batch_size: int = 2, length: int = 9, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB_SIZE, (batch_size, length), generator=generator)
    target_hidden = torch.randn(batch_size, length, HIDDEN_SIZE, generator=generator)
    position_ids = torch.arange(length).expand(batch_size, length)
    return input_ids, target_hidden, position_ids


@pytest.mark.parametrize("build_target", [tiny_target_qwen2, tiny_llama_untied])
def test_shared_target_weights_are_not_drafter_parameters(build_target):
    target = build_target()
    drafter = EagleDrafter(target)
    target_tensor_ids = {id(parameter) for parameter in target.parameters()}
    assert not any(id(parameter) in target_tensor_ids for parameter in drafter.parameters())
    assert not any(name.startswith(("shared", "embed", "lm_head")) for name in drafter.state_dict())
    assert "fc.weight" in drafter.state_dict()
    assert drafter.shared.lm_head is target.get_output_embeddings()
    assert drafter.shared.embed_tokens is target.get_input_embeddings()
    assert isinstance(drafter.decoder_layer.input_layernorm, torch.nn.Identity)
    assert drafter.architecture == type(target.get_decoder().layers[0]).__name__
    assert drafter.owned_layer  # the Llama family runs tlt's own layer code


@pytest.mark.parametrize("build_target", [tiny_target_qwen2, tiny_llama_untied])
def test_forward_shapes_and_logits_come_from_target_head(build_target):
    target = build_target()
    drafter = EagleDrafter(target)
    input_ids, target_hidden, position_ids = random_inputs()
    output = drafter(input_ids, target_hidden, position_ids, None, None)
    assert output.hidden.shape == (2, 9, HIDDEN_SIZE)
    assert output.logits.shape == (2, 9, VOCAB_SIZE)
    torch.testing.assert_close(output.logits, target.lm_head(output.hidden))


def test_gradient_reaches_drafter_but_not_target():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    input_ids, target_hidden, position_ids = random_inputs()
    target_hidden.requires_grad_(True)
    output = drafter(input_ids, target_hidden, position_ids, None, None)
    (output.logits.square().mean() + output.hidden.square().mean()).backward()
    assert all(parameter.grad is None for parameter in target.parameters())
    assert target_hidden.grad is None
    assert all(parameter.grad is not None and parameter.grad.abs().sum() > 0 for parameter in drafter.parameters())


def test_seed_fixes_initial_weights_without_touching_global_rng():
    target = tiny_target_qwen2()
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = EagleDrafter(target, seed=5)
    observed_next = torch.rand(3)
    second = EagleDrafter(target, seed=5)
    other = EagleDrafter(target, seed=6)
    torch.testing.assert_close(observed_next, expected_next)
    torch.testing.assert_close(first.fc.weight, second.fc.weight)
    assert not torch.equal(first.fc.weight, other.fc.weight)


@pytest.mark.parametrize("build_target", [tiny_target_qwen2, tiny_llama_untied])
def test_incremental_cached_forward_matches_full_forward(build_target):
    target = build_target()
    drafter = EagleDrafter(target)
    input_ids, target_hidden, position_ids = random_inputs(length=10)
    with torch.no_grad():
        full = drafter(input_ids, target_hidden, position_ids, None, None)
        cache = DynamicCache()
        chunks = [drafter(input_ids[:, :4], target_hidden[:, :4], position_ids[:, :4], None, cache)]
        for position in range(4, 10):
            step = slice(position, position + 1)
            chunks.append(drafter(input_ids[:, step], target_hidden[:, step], position_ids[:, step], None, cache))
    assert cache.get_seq_length() == 10
    torch.testing.assert_close(torch.cat([chunk.hidden for chunk in chunks], 1), full.hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([chunk.logits for chunk in chunks], 1), full.logits, atol=1e-5, rtol=1e-5)


def test_explicit_bool_mask_hides_keys():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    input_ids, target_hidden, position_ids = random_inputs(batch_size=1, length=6)
    with torch.no_grad():
        causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None]
        explicit = drafter(input_ids, target_hidden, position_ids, causal, None)
        default = drafter(input_ids, target_hidden, position_ids, None, None)
        # hiding key 0 from every later query changes those outputs, not query 0's
        hidden_first = causal.clone()
        hidden_first[..., 1:, 0] = False
        masked = drafter(input_ids, target_hidden, position_ids, hidden_first, None)
    torch.testing.assert_close(explicit.logits, default.logits)
    torch.testing.assert_close(masked.logits[:, 0], default.logits[:, 0])
    assert not torch.allclose(masked.logits[:, 1:], default.logits[:, 1:])


@pytest.mark.parametrize("build_target", [tiny_target_qwen2, tiny_llama_untied])
def test_save_load_round_trip_gives_identical_logits(tmp_path, build_target):
    target = build_target()
    drafter = EagleDrafter(target, seed=3)
    with torch.no_grad():
        drafter.fc.weight.mul_(1.5)
    save_drafter(drafter, tmp_path / "drafter")
    loaded = load_drafter(tmp_path / "drafter", target)
    input_ids, target_hidden, position_ids = random_inputs()
    with torch.no_grad():
        expected = drafter(input_ids, target_hidden, position_ids, None, None)
        observed = loaded(input_ids, target_hidden, position_ids, None, None)
    assert torch.equal(observed.logits, expected.logits)
    metadata = json.loads((tmp_path / "drafter" / CONFIG_FILE).read_text())
    assert metadata["architecture"] == drafter.architecture
    assert metadata["hidden_size"] == HIDDEN_SIZE
    assert not any(path.name.startswith(".") for path in (tmp_path / "drafter").iterdir())


def test_loading_against_a_different_target_is_a_clear_error(tmp_path):
    save_drafter(EagleDrafter(tiny_target_qwen2()), tmp_path / "drafter")
    with pytest.raises(DrafterLoadError, match="trained for a Qwen2DecoderLayer"):
        load_drafter(tmp_path / "drafter", tiny_target_qwen2(hidden_size=48))
    with pytest.raises(DrafterLoadError, match="LlamaDecoderLayer"):
        load_drafter(tmp_path / "drafter", tiny_llama_untied())
    with pytest.raises(DrafterLoadError, match="No saved drafter"):
        load_drafter(tmp_path / "missing", tiny_target_qwen2())


def test_loading_weights_that_do_not_match_the_config_is_a_clear_error(tmp_path):
    target = tiny_target_qwen2()
    save_drafter(EagleDrafter(target, seed=0), tmp_path / "first")
    save_drafter(EagleDrafter(target, seed=1), tmp_path / "second")
    (tmp_path / "first" / CONFIG_FILE).write_text((tmp_path / "second" / CONFIG_FILE).read_text())
    with pytest.raises(DrafterLoadError, match="do not match its config"):
        load_drafter(tmp_path / "first", target)


def test_loss_is_zero_when_prediction_equals_a_confident_target():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, HIDDEN_SIZE, generator=generator)
    logits = confident_logits((2, 5), generator)
    loss = drafter_loss(DrafterOutput(hidden=hidden, logits=logits), hidden, logits, torch.ones(2, 5, dtype=torch.bool))
    assert loss.hidden_loss.item() == 0.0
    assert loss.token_loss.item() < 1e-6
    assert loss.total.item() < 1e-6
    assert loss.accuracy.item() == 1.0
    assert loss.token_count == 10


def test_token_loss_is_soft_cross_entropy_and_floors_at_target_entropy():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, HIDDEN_SIZE, generator=generator)
    target_logits = torch.randn(1, 4, VOCAB_SIZE, generator=generator)
    target_probs = torch.softmax(target_logits, -1)
    entropy = -(target_probs * torch.log_softmax(target_logits, -1)).sum(-1).mean()
    mask = torch.ones(1, 4, dtype=torch.bool)
    at_target = drafter_loss(DrafterOutput(hidden, target_logits), hidden, target_logits, mask)
    elsewhere = drafter_loss(DrafterOutput(hidden + 1.0, -target_logits), hidden, target_logits, mask)
    torch.testing.assert_close(at_target.token_loss, entropy)
    assert elsewhere.token_loss > at_target.token_loss
    # smooth L1 of an offset of 1.0 is 0.5 per element
    torch.testing.assert_close(elsewhere.hidden_loss, torch.tensor(0.5))
    torch.testing.assert_close(elsewhere.total, elsewhere.hidden_loss + 0.1 * elsewhere.token_loss)


def test_loss_counts_only_masked_positions_and_ignores_non_finite_padding():
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, HIDDEN_SIZE, generator=generator)
    logits = confident_logits((1, 4), generator)
    predicted_hidden, predicted_logits = hidden.clone(), logits.clone()
    predicted_hidden[0, 2:] = float("nan")
    predicted_logits[0, 2:] = float("inf")
    mask = torch.tensor([[True, True, False, False]])
    loss = drafter_loss(DrafterOutput(predicted_hidden, predicted_logits), hidden, logits, mask)
    assert loss.is_finite
    assert loss.total.item() < 1e-6
    assert loss.token_count == 2


def arithmetic_like_sequences(target, count: int = 4, prompt_length: int = 5, response_length: int = 12, seed: int = 0):
    """Greedy continuations of random prompts: sequences [N,L] and their response mask [N,L]."""
    generator = torch.Generator().manual_seed(seed)
    sequences = torch.randint(0, VOCAB_SIZE, (count, prompt_length), generator=generator)
    with torch.no_grad():
        for _ in range(response_length):
            next_tokens = target(input_ids=sequences).logits[:, -1].argmax(-1, keepdim=True)
            sequences = torch.cat((sequences, next_tokens), dim=1)
    response_mask = torch.zeros_like(sequences, dtype=torch.bool)
    response_mask[:, prompt_length:] = True
    return sequences, response_mask


def test_batch_shift_pairs_token_t_plus_1_with_hidden_t():
    target = tiny_target_qwen2()
    sequences, response_mask = arithmetic_like_sequences(target, count=2, prompt_length=3, response_length=4)
    batch = collect_drafter_batch(target, sequences, response_mask)
    with torch.no_grad():
        hidden_states = target.get_decoder()(input_ids=sequences).last_hidden_state
    assert torch.equal(batch.input_ids, sequences[:, 1:])
    torch.testing.assert_close(batch.target_hidden, hidden_states[:, :-1])
    torch.testing.assert_close(batch.target_hidden_next, hidden_states[:, 1:])
    # L = 7, response at 3..6: feature t counts iff x[t+1] and x[t+2] are response tokens -> t = 2..4
    assert batch.loss_mask.tolist() == [[False, False, True, True, True, False]] * 2
    assert batch.position_ids.tolist() == [list(range(6))] * 2


def test_left_padding_gives_the_same_features_and_loss_as_no_padding():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    sequences, response_mask = arithmetic_like_sequences(target, count=1)
    padding = 3
    padded = torch.cat((torch.zeros(1, padding, dtype=torch.long), sequences), dim=1)
    padded_response = torch.cat((torch.zeros(1, padding, dtype=torch.bool), response_mask), dim=1)
    padded_valid = torch.arange(padded.shape[1])[None] >= padding
    plain_batch = collect_drafter_batch(target, sequences, response_mask)
    padded_batch = collect_drafter_batch(target, padded, padded_response, padded_valid)
    torch.testing.assert_close(padded_batch.target_hidden[:, padding:], plain_batch.target_hidden, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded_batch.position_ids[:, padding:], plain_batch.position_ids)
    plain_loss, padded_loss = evaluate_drafter(drafter, plain_batch), evaluate_drafter(drafter, padded_batch)
    torch.testing.assert_close(padded_loss.total, plain_loss.total, atol=1e-5, rtol=1e-5)
    assert padded_loss.token_count == plain_loss.token_count


def test_concatenate_right_pads_without_changing_each_rows_loss():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    short = collect_drafter_batch(target, *arithmetic_like_sequences(target, count=1, response_length=6, seed=1))
    long = collect_drafter_batch(target, *arithmetic_like_sequences(target, count=1, response_length=12, seed=2))
    both = DrafterBatch.concatenate([short, long])
    assert both.size == 2 and both.input_ids.shape[1] == long.input_ids.shape[1]
    first_row = both.rows(torch.tensor([0]))
    torch.testing.assert_close(evaluate_drafter(drafter, first_row).total, evaluate_drafter(drafter, short).total)
    assert evaluate_drafter(drafter, both).token_count == short.loss_mask.sum() + long.loss_mask.sum()


def test_train_steps_change_every_drafter_weight_and_no_target_weight():
    target = tiny_target_qwen2()
    target_before = {name: value.clone() for name, value in target.state_dict().items()}
    drafter = EagleDrafter(target)
    drafter_before = {name: value.clone() for name, value in drafter.state_dict().items()}
    trainer = DrafterTrainer(drafter, lr=1e-3, weight_decay=0.01)
    batch = collect_drafter_batch(target, *arithmetic_like_sequences(target))
    for _ in range(3):
        loss = trainer.train_step(batch)
        assert not loss.step_skipped
    assert trainer.steps_taken == 3
    for name, value in drafter.state_dict().items():
        assert not torch.equal(value, drafter_before[name]), name
    for name, value in target.state_dict().items():
        assert torch.equal(value, target_before[name]), name
    assert all(parameter.grad is None for parameter in target.parameters())


def test_training_on_a_fixed_batch_reduces_the_loss():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    trainer = DrafterTrainer(drafter, lr=3e-3)
    batch = collect_drafter_batch(target, *arithmetic_like_sequences(target))
    before = evaluate_drafter(drafter, batch)
    for _ in range(30):
        trainer.train_step(batch)
    after = evaluate_drafter(drafter, batch)
    assert after.total < 0.5 * before.total
    assert after.hidden_loss < before.hidden_loss and after.token_loss < before.token_loss


def test_non_finite_step_is_skipped_and_leaves_parameters_untouched():
    target = tiny_target_qwen2()
    drafter = EagleDrafter(target)
    trainer = DrafterTrainer(drafter, lr=1e-3)
    batch = collect_drafter_batch(target, *arithmetic_like_sequences(target))
    trainer.train_step(batch)
    drafter_before = {name: value.clone() for name, value in drafter.state_dict().items()}
    optimizer_step_before = trainer.optimizer.state_dict()["state"][0]["step"].clone()
    poisoned_hidden = batch.target_hidden_next.clone()
    poisoned_hidden[0, batch.loss_mask[0].nonzero()[0, 0]] = float("nan")
    poisoned = DrafterBatch(**{**batch.__dict__, "target_hidden_next": poisoned_hidden})
    loss = trainer.train_step(poisoned)
    assert loss.step_skipped and not loss.is_finite
    assert trainer.steps_skipped == 1 and trainer.steps_taken == 1
    assert torch.equal(trainer.optimizer.state_dict()["state"][0]["step"], optimizer_step_before)
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, drafter_before[name]), name
    assert all(parameter.grad is None for parameter in drafter.parameters())


def test_trainer_state_round_trip_continues_identically():
    target = tiny_target_qwen2()
    batch = collect_drafter_batch(target, *arithmetic_like_sequences(target))
    trainer = DrafterTrainer(EagleDrafter(target, seed=0), lr=1e-3)
    trainer.train_step(batch)
    resumed = DrafterTrainer(EagleDrafter(target, seed=9), lr=1e-3)
    resumed.load_state_dict(trainer.state_dict())
    trainer.train_step(batch)
    resumed.train_step(batch)
    assert resumed.steps_taken == 2
    for name, value in trainer.drafter.state_dict().items():
        torch.testing.assert_close(resumed.drafter.state_dict()[name], value)


def confident_tiny_target(tokenizer) -> Qwen2ForCausalLM:
    """A random tiny Qwen2 over the task's vocabulary, made confident (logits x8) so it has habits to learn."""
    target = build_tiny_model(0, tiny_model_config(tokenizer, hidden_size=64, num_layers=2, intermediate_size=128))
    with torch.no_grad():
        target.get_decoder().norm.weight.mul_(8.0)
    return target.eval()


def test_warm_up_teaches_the_drafter_to_agree_with_the_target():
    tokenizer = tiny_tokenizer()
    target = confident_tiny_target(tokenizer)
    target_before = {name: value.clone() for name, value in target.state_dict().items()}
    settings = dict(steps=60, batch_size=8, lr=3e-3, train_prompts=32, held_out_prompts=8, max_new_tokens=24)
    drafter, report = warm_up_drafter(target, tokenizer, ArithmeticTask(seed=0), seed=0, **settings)
    assert report.steps == 60 and report.steps_skipped == 0
    assert report.train_sequences == 32 and report.held_out_sequences == 8
    assert report.train_tokens > 0 and report.held_out_tokens > 0
    assert report.held_out_accuracy > report.held_out_accuracy_before + 0.3
    assert report.held_out_acceptance > report.held_out_acceptance_before + 0.3
    assert [step for step, _, _ in report.learning_curve] == [50, 60], "scored every 50 steps and at the last"
    best_scored = max(accept_length for _, _, accept_length in report.learning_curve)
    assert abs(report.held_out_accept_length - best_scored) < 1e-6, "the best scored drafter is kept"
    assert len(report.held_out_acceptance_by_depth) == 1, "warm_up_drafter's default objective is one depth"
    assert not drafter.training
    for name, value in target.state_dict().items():
        assert torch.equal(value, target_before[name]), name
    again, _ = warm_up_drafter(target, tokenizer, ArithmeticTask(seed=0), seed=0, **settings)
    for name, value in drafter.state_dict().items():
        assert torch.equal(again.state_dict()[name], value), name


def test_drafter_follows_the_target_dtype():
    target = tiny_target_qwen2().to(torch.bfloat16)
    drafter = EagleDrafter(target)
    input_ids, target_hidden, position_ids = random_inputs()
    with torch.no_grad():
        output = drafter(input_ids, target_hidden.to(torch.bfloat16), position_ids, None, None)
    assert all(parameter.dtype == torch.bfloat16 for parameter in drafter.parameters())
    assert output.logits.dtype == torch.bfloat16 and torch.isfinite(output.logits).all()
