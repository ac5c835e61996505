"""A reduced draft vocabulary: choosing it, an exact shared head over it, its loss, saving it, warming up with it."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_qwen2
from transformers import Qwen2ForCausalLM

from tlt_cli.drafter.loss import drafter_loss
from tlt_cli.drafter.model import (
    CONFIG_FILE,
    DrafterOutput,
    EagleDrafter,
    load_drafter,
    read_drafter_metadata,
    save_drafter,
)
from tlt_cli.drafter.trainer import (
    DrafterTrainer,
    collect_drafter_batch,
    evaluate_drafter,
)
from tlt_cli.drafter.vocabulary import (
    FULL_VOCABULARY_LIMIT,
    REDUCED_VOCABULARY_SIZE,
    DraftVocabulary,
    choose_vocabulary,
    default_draft_vocab_size,
    most_frequent_tokens,
    resolve_draft_vocab_size,
    token_coverage,
)
from tlt_cli.drafter.warmup import (
    drafter_batch,
    prompt_hidden_states,
    sample_completions,
    warm_up_drafter,
)
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.models.tiny import build_tiny_model, tiny_model_config, tiny_tokenizer
from tlt_cli.sglang.drafter_format import save_token_map
from tlt_cli.tasks.arithmetic import ArithmeticTask

torch.set_num_threads(1)

TARGET_VOCAB_SIZE = 512
DRAFT_VOCAB_SIZE = 64


def tiny_target(seed: int = 0) -> Qwen2ForCausalLM:
    return tiny_qwen2(vocab_size=TARGET_VOCAB_SIZE, seed=seed, max_position_embeddings=128)


def every_eighth_token() -> DraftVocabulary:
    return DraftVocabulary(torch.arange(0, TARGET_VOCAB_SIZE, 8), TARGET_VOCAB_SIZE)


def random_inputs(batch_size: int = 2, length: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, TARGET_VOCAB_SIZE, (batch_size, length), generator=generator)
    target_hidden = torch.randn(batch_size, length, 32, generator=generator)
    return input_ids, target_hidden, torch.arange(length).expand(batch_size, -1)


def test_most_frequent_tokens_ranks_by_count_then_id_and_keeps_required_ids():
    sequences = [[5, 5, 5, 9, 9, 3], [9, 7, 7, 3]]
    vocabulary = most_frequent_tokens(sequences, target_size=16, size=4, required_ids=[2])
    # counts: 5 x3, 9 x3, 3 x2, 7 x2; EOS (2) is required, so 7 (tied with 3, higher id) drops
    assert vocabulary.target_ids.tolist() == [2, 3, 5, 9]
    assert most_frequent_tokens(sequences, target_size=16, size=16).target_ids is None
    # unseen tokens fill the remaining places in id order
    assert most_frequent_tokens([[4]], target_size=16, size=3).target_ids.tolist() == [0, 1, 4]
    assert token_coverage(sequences, vocabulary) == pytest.approx(8 / 10)


def test_default_size_keeps_small_vocabularies_whole():
    assert default_draft_vocab_size(FULL_VOCABULARY_LIMIT) == FULL_VOCABULARY_LIMIT
    assert default_draft_vocab_size(49152) == REDUCED_VOCABULARY_SIZE < 49152
    assert resolve_draft_vocab_size(0, 70) == 70
    assert resolve_draft_vocab_size(100_000, 49152) == 49152
    assert resolve_draft_vocab_size(1024, 49152) == 1024


def test_vocabulary_maps_ids_and_distributions_to_the_target():
    vocabulary = every_eighth_token()
    assert vocabulary.to_target_ids(torch.tensor([[0, 1, 63]])).tolist() == [[0, 8, 504]]
    draft_probs = torch.softmax(torch.randn(3, DRAFT_VOCAB_SIZE), dim=-1)
    target_probs = vocabulary.to_target_probs(draft_probs)
    assert target_probs.shape == (3, TARGET_VOCAB_SIZE)
    torch.testing.assert_close(target_probs[:, ::8], draft_probs)
    assert target_probs.sum() == pytest.approx(3.0) and (target_probs[:, 1::8] == 0).all()
    with pytest.raises(ValueError, match="below 512"):
        DraftVocabulary(torch.tensor([3, 512]), TARGET_VOCAB_SIZE)


def test_reduced_head_is_the_target_lm_head_restricted_to_the_kept_tokens():
    target = tiny_target()
    vocabulary = every_eighth_token()
    reduced = EagleDrafter(target, seed=1, vocabulary=vocabulary)
    full = EagleDrafter(target, seed=1)
    full.load_state_dict(reduced.state_dict())
    inputs = random_inputs()
    with torch.no_grad():
        reduced_output, full_output = reduced(*inputs), full(*inputs)
    assert reduced_output.logits.shape == (2, 5, DRAFT_VOCAB_SIZE)
    torch.testing.assert_close(reduced_output.hidden, full_output.hidden)
    torch.testing.assert_close(reduced_output.logits, full_output.logits[..., ::8])
    # the head is shared and frozen: nothing new to train or save
    assert sorted(reduced.state_dict()) == sorted(full.state_dict())


def test_refresh_reads_the_target_head_again_after_its_weights_change():
    target = tiny_target()
    drafter = EagleDrafter(target, vocabulary=every_eighth_token())
    inputs = random_inputs()
    with torch.no_grad():
        # DeepSpeed writes updated weights through .data, which no version counter sees
        target.lm_head.weight.data.copy_(torch.randn_like(target.lm_head.weight))
        drafter.refresh_draft_head()
        output = drafter(*inputs)
        torch.testing.assert_close(output.logits, target.lm_head(output.hidden)[..., ::8])


def test_save_and_load_keep_the_draft_vocabulary(tmp_path):
    target = tiny_target()
    drafter = EagleDrafter(target, seed=2, vocabulary=every_eighth_token())
    save_drafter(drafter, tmp_path)
    assert json.loads((tmp_path / CONFIG_FILE).read_text())["draft_vocab_size"] == DRAFT_VOCAB_SIZE
    loaded = load_drafter(tmp_path, target)
    assert torch.equal(loaded.vocabulary.target_ids, drafter.vocabulary.target_ids)
    inputs = random_inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, drafter(*inputs).logits)


def test_save_names_the_two_vocabulary_sizes_apart(tmp_path):
    save_drafter(EagleDrafter(tiny_target(), vocabulary=every_eighth_token()), tmp_path)
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert (saved["target_vocab_size"], saved["draft_vocab_size"]) == (TARGET_VOCAB_SIZE, DRAFT_VOCAB_SIZE)
    assert "vocab_size" not in saved


@pytest.mark.parametrize("reduced", [True, False])
def test_a_drafter_folder_saved_under_the_old_key_names_still_loads(tmp_path, reduced):
    """Folders saved before the sizes were named apart hold the target's vocabulary as vocab_size, and
    those saved before draft vocabularies have no draft_vocab_size (they draft over every token)."""
    target = tiny_target()
    drafter = EagleDrafter(target, seed=2, vocabulary=every_eighth_token() if reduced else None)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    config["vocab_size"] = config.pop("target_vocab_size")
    if not reduced:
        del config["draft_vocab_size"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    metadata = read_drafter_metadata(tmp_path)
    expected_draft_size = DRAFT_VOCAB_SIZE if reduced else TARGET_VOCAB_SIZE
    assert (metadata["target_vocab_size"], metadata["draft_vocab_size"]) == (TARGET_VOCAB_SIZE, expected_draft_size)
    loaded = load_drafter(tmp_path, target)
    assert loaded.vocabulary.size == expected_draft_size and loaded.target_vocab_size == TARGET_VOCAB_SIZE
    inputs = random_inputs()
    with torch.no_grad():
        torch.testing.assert_close(loaded(*inputs).logits, drafter(*inputs).logits)


def test_one_chooser_resolves_the_recipe_setting_and_keeps_eos():
    responses = [[5, 5, 5, 7, 7, 9], [5, 7, 11]]
    # 0: the default for a small target, its whole vocabulary
    assert choose_vocabulary(responses, 0, 16, eos_token_id=15).target_ids is None
    chosen = choose_vocabulary(responses, 3, 16, eos_token_id=15)
    assert chosen.target_ids.tolist() == [5, 7, 15] and chosen.target_size == 16


def test_token_map_is_what_sglang_loads(tmp_path):
    path = tmp_path / "token_map.pt"
    save_token_map(every_eighth_token(), path)
    loaded = torch.load(path, weights_only=True)
    assert loaded.dtype == torch.int64 and loaded.tolist() == list(range(0, TARGET_VOCAB_SIZE, 8))
    with pytest.raises(ValueError, match="no token map"):
        save_token_map(DraftVocabulary.full(TARGET_VOCAB_SIZE), path)


def test_loss_uses_the_renormalised_target_distribution_and_counts_outside_tokens_as_misses():
    vocabulary = DraftVocabulary(torch.tensor([1, 4, 6]), target_size=8)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 4, 16, generator=generator)
    target_logits = torch.randn(1, 4, 8, generator=generator)
    draft_logits = torch.randn(1, 4, 3, generator=generator)
    mask = torch.ones(1, 4, dtype=torch.bool)
    restricted = target_logits[..., [1, 4, 6]]
    target_tokens = torch.tensor([[1, 4, 0, 6]])  # token 0 is outside the draft vocabulary
    draft_logits[0, torch.arange(4), torch.tensor([0, 1, 0, 0])] = 10.0  # drafts 1, 4, 1, 1
    loss = drafter_loss(DrafterOutput(hidden, draft_logits), hidden, restricted, mask, vocabulary, target_tokens)
    expected = -(torch.softmax(restricted, -1) * torch.log_softmax(draft_logits, -1)).sum(-1).mean()
    torch.testing.assert_close(loss.token_loss, expected)
    assert float(loss.accuracy) == pytest.approx(0.5)


def test_engine_hidden_states_build_the_same_batch_as_a_full_forward():
    target = tiny_target()
    tokenizer = type("Ids", (), {"eos_token_id": 3, "pad_token_id": 0})()
    prompts = [[1, 7, 9], [1, 20, 21, 22, 23], [1, 5]]
    completions = sample_completions(
        target, tokenizer, prompts, SamplingParams(9, temperature=1.0), seed=0, return_hidden=True
    )
    prompt_states = prompt_hidden_states(target, [c.prompt_ids for c in completions])
    batch = drafter_batch(completions, prompt_states, pad_token_id=0)
    length = max(len(c.prompt_ids) + len(c.response_ids) for c in completions)
    sequences = torch.zeros(3, length, dtype=torch.long)
    response_mask = torch.zeros(3, length, dtype=torch.bool)
    for row, completion in enumerate(completions):
        sequence = list(completion.prompt_ids) + completion.response_ids
        sequences[row, : len(sequence)] = torch.tensor(sequence)
        response_mask[row, len(completion.prompt_ids) : len(sequence)] = True
    expected = collect_drafter_batch(target, sequences, response_mask, sequences != 0)
    assert torch.equal(batch.loss_mask, expected.loss_mask) and torch.equal(batch.input_ids, expected.input_ids)
    valid = expected.valid_mask
    torch.testing.assert_close(batch.target_hidden[valid], expected.target_hidden[valid], atol=1e-5, rtol=1e-4)
    counted = expected.loss_mask
    torch.testing.assert_close(
        batch.target_hidden_next[counted], expected.target_hidden_next[counted], atol=1e-5, rtol=1e-4
    )


def test_reduced_drafter_trains_and_evaluates_against_the_full_vocabulary():
    target = tiny_target()
    sequences = torch.randint(1, TARGET_VOCAB_SIZE, (4, 12), generator=torch.Generator().manual_seed(3))
    response_mask = torch.zeros_like(sequences, dtype=torch.bool)
    response_mask[:, 4:] = True
    batch = collect_drafter_batch(target, sequences, response_mask)
    drafter = EagleDrafter(target, vocabulary=every_eighth_token())
    trainer = DrafterTrainer(drafter, lr=1e-2)
    before = evaluate_drafter(drafter, batch)
    for _ in range(20):
        trainer.train_step(batch)
    after = evaluate_drafter(drafter, batch)
    assert float(after.total) < float(before.total)
    # agreement with the target's argmax over all 512 tokens: only kept argmaxes can be matched
    target_tokens = target.lm_head(batch.target_hidden_next).argmax(-1)
    in_vocabulary = (target_tokens % 8 == 0) & batch.loss_mask
    assert float(after.accuracy) <= float(in_vocabulary.sum() / batch.loss_mask.sum()) + 1e-6


def test_warm_up_with_a_reduced_vocabulary_reports_it_and_learns():
    tokenizer = tiny_tokenizer()
    # a random tiny model over the task's characters, made confident (logits x8) so it has habits to learn
    target = build_tiny_model(0, tiny_model_config(tokenizer, hidden_size=64, num_layers=2, intermediate_size=128))
    with torch.no_grad():
        target.get_decoder().norm.weight.mul_(8.0)
    target.eval()
    settings = {
        "steps": 60,
        "batch_size": 8,
        "lr": 3e-3,
        "train_prompts": 32,
        "held_out_prompts": 8,
        "max_new_tokens": 24,
    }
    reports = []
    drafter, report = warm_up_drafter(
        target,
        tokenizer,
        ArithmeticTask(seed=0),
        seed=0,
        draft_vocab_size=24,
        progress=lambda *call: reports.append(call),
        **settings,
    )
    # every phase's bar starts at 0 before its work and ends full, in order
    assert reports[0] == ("generate", 0, 40)
    phases = list(dict.fromkeys(phase for phase, _, _ in reports))
    assert phases == ["generate", "prompt states", "train", "evaluate"]
    assert all(
        [call for call in reports if call[0] == phase][-1][1:] == (total, total)
        for phase, total in zip(phases, (40, 1, 60, 1))
    )
    assert drafter.vocabulary.size == report.draft_vocab_size == 24 < target.config.vocab_size
    assert tokenizer.eos_token_id in drafter.vocabulary.target_ids.tolist()
    assert 0.5 < report.draft_vocab_coverage <= 1.0
    assert report.held_out_accuracy > report.held_out_accuracy_before + 0.3
