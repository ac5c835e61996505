"""The drafter a run starts with and leaves behind: the per-model library, `drafter.init: auto`, the publish at
a run's end, and the loss matched to sampled acceptance."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from recipe_overrides import RECIPE
from tiny_models import tiny_qwen2

from tlt_cli.checkpoint import DRAFTER_DIRECTORY, prepare_staging
from tlt_cli.checkpoint import publish as publish_checkpoint
from tlt_cli.config.loading import load_recipe
from tlt_cli.drafter import library
from tlt_cli.drafter.loss import EAGLE_OBJECTIVE, DrafterObjective, acceptance_objective, drafter_loss
from tlt_cli.drafter.model import DrafterOutput, EagleDrafter, load_drafter, save_drafter
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer, evaluate_drafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.processes.drafter_publish import publish_run_drafter
from tlt_cli.training import setup

torch.set_num_threads(1)
VOCAB_SIZE = 48


@pytest.fixture
def model_folder(tmp_path):
    """A tiny Qwen2 saved as a Hugging Face folder (config, weights, a tokenizer file)."""
    folder = tmp_path / "model"
    tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True).save_pretrained(folder)
    (folder / "tokenizer.json").write_text("{}")
    return folder


def saved_drafter(folder, target, seed):
    return save_drafter(EagleDrafter(target, seed=seed), folder)


def weights_of(folder, target):
    return load_drafter(folder, target).state_dict()


# ---------------------------------------------------------------- the library


def test_the_newest_published_drafter_is_read_back_with_its_record(tmp_path, model_folder):
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    cache = tmp_path / "cache"
    assert library.newest(cache, model_folder) is None
    first = saved_drafter(tmp_path / "first", target, seed=1)
    second = saved_drafter(tmp_path / "second", target, seed=2)
    library.publish(cache, model_folder, first, library.DrafterRecord("run a, step 3", "m", accept_length=2.1))
    library.publish(cache, model_folder, second, library.DrafterRecord("run b, step 5", "m", 2.6, 0.71, 0.7))
    folder, record = library.newest(cache, model_folder)
    assert (record.source, record.accept_length, record.acceptance, record.temperature) == (
        "run b, step 5",
        2.6,
        0.71,
        0.7,
    )
    assert record.written > 0
    for name, tensor in weights_of(second, target).items():
        torch.testing.assert_close(weights_of(folder, target)[name], tensor)
    assert "accept length 2.60" in record.describe() and "T=0.7" in record.describe()


def test_old_versions_are_pruned_and_the_linked_one_is_kept(tmp_path, model_folder):
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    cache = tmp_path / "cache"
    drafter = saved_drafter(tmp_path / "drafter", target, seed=1)
    for step in range(4):
        linked = library.publish(cache, model_folder, drafter, library.DrafterRecord(f"run, step {step}", "m"))
    versions = sorted(library.model_entry(cache, model_folder).glob("v-*"))
    assert len(versions) == library.VERSIONS_KEPT and linked in versions
    assert not list(library.model_entry(cache, model_folder).glob(".*tmp*"))


def test_a_damaged_held_drafter_counts_as_absent_with_a_warning(tmp_path, model_folder, caplog):
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    cache = tmp_path / "cache"
    version = library.publish(
        cache, model_folder, saved_drafter(tmp_path / "d", target, 1), library.DrafterRecord("s", "m")
    )
    (version / "drafter.safetensors").write_bytes(b"\0" * 64)
    assert library.newest(cache, model_folder) is None
    assert any("damaged" in entry.getMessage() for entry in caplog.records)


def test_the_key_follows_the_model_files_not_the_folder_name(tmp_path, model_folder):
    key = library.library_key(model_folder)
    assert library.library_key(model_folder) == key
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for path in model_folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
        os.utime(copy / path.name, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    assert library.library_key(copy) == key, "the same files under another name are the same model"
    weights = model_folder / "model.safetensors"
    os.utime(weights, ns=(time.time_ns(), weights.stat().st_mtime_ns + 10**9))
    assert library.library_key(model_folder) != key, "new weights are another model"
    (copy / "tokenizer.json").write_text('{"changed": 1}')
    assert library.library_key(copy) != key, "another tokenizer maps other ids"


# ---------------------------------------------------------------- drafter.init auto


def recipe_for(model_folder, *overrides):
    return load_recipe(RECIPE, [f"model.path={model_folder}", *overrides])


def test_auto_starts_fresh_when_none_is_held_and_from_the_held_one_after(tmp_path, model_folder):
    recipe = recipe_for(model_folder)
    assert recipe.drafter.init == "auto"
    cache = tmp_path / "cache"
    assert setup.prepare_drafter(recipe, cache) == (None, None)
    assert "none held for this model yet" in setup.describe_drafter_start(recipe, None)
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    version = setup.publish_drafter(recipe, cache, saved_drafter(tmp_path / "d", target, 3), "run x, step 9", 2.4)
    folder, report = setup.prepare_drafter(recipe, cache)
    assert (folder, report) == (version, None)
    sentence = setup.describe_drafter_start(recipe, folder)
    assert sentence.startswith("drafter: the newest drafter tlt holds for this model, from run x, step 9")
    assert "accept length 2.40" in sentence
    assert setup.prepare_drafter(recipe_for(model_folder, "drafter.init=online"), cache) == (None, None)


def run_with_checkpoint(tmp_path, target, next_step, seed):
    """A run directory whose newest checkpoint holds a drafter (as the sidecar saves it)."""
    run_directory = tmp_path / "run"
    checkpoints = run_directory / "checkpoints"
    staging = prepare_staging(checkpoints, next_step)
    saved_drafter(staging / DRAFTER_DIRECTORY, target, seed)
    publish_checkpoint(checkpoints, next_step, {}, keep=2)
    return run_directory


def test_a_run_publishes_its_checkpointed_drafter_unless_the_held_one_drafts_better(tmp_path, model_folder):
    recipe = recipe_for(model_folder, "run.name=first")
    cache = tmp_path / "cache"
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    run_directory = run_with_checkpoint(tmp_path, target, next_step=4, seed=5)
    steps = [{"type": "step", "step": 2, "drafter_accept_length": 1.8}, {"type": "step", "step": 3}]
    sentence = publish_run_drafter(recipe, run_directory, cache, steps)
    assert sentence == "drafter: kept for the next run on this model (step 3, accept length 1.80)"
    folder, record = library.newest(cache, model_folder)
    assert (record.source, record.accept_length) == ("run first, step 3", 1.8)
    checkpointed = weights_of(run_directory / "checkpoints" / "step_000004" / DRAFTER_DIRECTORY, target)
    for name, tensor in weights_of(folder, target).items():
        torch.testing.assert_close(checkpointed[name], tensor)
    worse = [{"type": "step", "step": 3, "drafter_accept_length": 1.2}]
    assert publish_run_drafter(recipe, run_directory, cache, worse).startswith("drafter: kept the one tlt holds")
    assert library.newest(cache, model_folder)[1].accept_length == 1.8


def test_a_run_without_a_checkpointed_drafter_publishes_nothing(tmp_path, model_folder):
    recipe = recipe_for(model_folder)
    assert publish_run_drafter(recipe, tmp_path / "no-run", tmp_path / "cache", []) is None
    assert not (tmp_path / "cache").exists()


# ---------------------------------------------------------------- the loss matched to acceptance


def test_total_variation_is_one_minus_the_acceptance_of_lossless_sampling():
    generator = torch.Generator().manual_seed(0)
    target_logits, drafter_logits = torch.randn(1, 3, 6, generator=generator), torch.randn(1, 3, 6, generator=generator)
    objective = DrafterObjective(temperature=0.7, cross_entropy_weight=0.0, total_variation_weight=1.0)
    hidden, mask = torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool)
    loss = drafter_loss(DrafterOutput(hidden, drafter_logits), hidden, target_logits, mask, objective=objective)
    p, q = torch.softmax(target_logits / 0.7, -1), torch.softmax(drafter_logits / 0.7, -1)
    # lossless sampling: draw x ~ q, keep it with probability min(1, p(x)/q(x))
    draws = torch.multinomial(q[0], 200_000, replacement=True, generator=generator)
    kept = torch.rand(draws.shape, generator=generator) < (p[0].gather(1, draws) / q[0].gather(1, draws)).clamp(max=1)
    empirical = kept.float().mean()
    torch.testing.assert_close(loss.acceptance, empirical, atol=4e-3, rtol=0)
    torch.testing.assert_close(loss.total, 1 - torch.minimum(p, q).sum(-1).mean())
    same = drafter_loss(DrafterOutput(hidden, target_logits), hidden, target_logits, mask, objective=objective)
    torch.testing.assert_close(same.acceptance, torch.tensor(1.0))


def test_evaluation_scores_a_reduced_vocabulary_against_the_whole_distribution():
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    generator = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, VOCAB_SIZE, (2, 10), generator=generator)
    hidden = target.get_decoder()(input_ids=sequences).last_hidden_state.detach()
    batch = DrafterBatch.from_sequences(sequences, hidden, torch.ones_like(sequences, dtype=torch.bool))
    full = EagleDrafter(target, seed=0)
    reduced = EagleDrafter(target, seed=0, vocabulary=DraftVocabulary(torch.arange(8), VOCAB_SIZE))
    reduced.load_state_dict(
        {name: value for name, value in full.state_dict().items() if "head" not in name}, strict=False
    )
    objective = acceptance_objective(0.7)
    whole = evaluate_drafter(full, batch, None, objective).acceptance
    eight = evaluate_drafter(reduced, batch, None, objective).acceptance
    # the target's mass outside the 8 draft tokens can never be accepted: the reduced drafter scores no higher
    assert 0 < eight < 1 and eight <= whole + 1e-6
    renormalised = DrafterTrainer(reduced, lr=0.0, objective=objective)
    assert renormalised.train_step(batch).acceptance > eight, "training renormalises over the draft tokens"


def test_training_for_acceptance_raises_it_more_than_eagles_loss():
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    # a peaked target, as a trained model's is (a random one's distributions are near uniform and overlap anyway):
    # 60 steps take a drafter from 0.13 to 0.65 with EAGLE's loss, to 0.86 with the acceptance objective
    target.model.norm.weight.data.mul_(8.0)
    generator = torch.Generator().manual_seed(2)
    sequences = torch.randint(0, VOCAB_SIZE, (4, 24), generator=generator)
    hidden = target.get_decoder()(input_ids=sequences).last_hidden_state.detach()
    batch = DrafterBatch.from_sequences(sequences, hidden, torch.ones_like(sequences, dtype=torch.bool))
    objective = acceptance_objective(0.7)
    acceptances = {}
    for name, trained_with in (("eagle", EAGLE_OBJECTIVE), ("acceptance", objective)):
        drafter = EagleDrafter(target, seed=0)
        trainer = DrafterTrainer(drafter, lr=3e-3, objective=trained_with)
        for _ in range(60):
            trainer.train_step(batch)
        acceptances[name] = float(evaluate_drafter(drafter, batch, None, objective).acceptance)
    assert acceptances["acceptance"] > acceptances["eagle"] + 0.1, acceptances


def test_the_recipe_chooses_the_objective_at_the_rollout_temperature(model_folder):
    assert setup.drafter_objective(recipe_for(model_folder, "rollout.temperature=0.7")) == acceptance_objective(0.7, 3)
    eagle = setup.drafter_objective(recipe_for(model_folder, "drafter.loss=eagle", "drafter.train_depths=1"))
    assert eagle == EAGLE_OBJECTIVE
    assert acceptance_objective(0.0).temperature == 1.0, "greedy runs train at temperature 1 (the same argmax)"
    assert json.dumps(acceptance_objective(0.7).__dict__)


# ---------------------------------------------------------------- the warm-up: resumable, trained until it stops rising


def test_the_warm_up_data_reads_back_whole_and_a_damaged_file_counts_as_absent(tmp_path):
    from tlt_cli.drafter.warmup import WarmupData, load_warmup_data, save_warmup_data
    from tlt_cli.rollout.types import Completion

    def completion(length):
        return Completion(
            0, (1, 2, 3), list(range(4, 4 + length)), True, 0.0, 0.0, target_hidden=torch.randn(length, 8)
        )

    data = WarmupData(
        [completion(3), completion(5)], [completion(2)], [torch.randn(3, 8)] * 2, [torch.randn(3, 8)], 4.0, 1.0
    )
    path = tmp_path / "samples.pt"
    save_warmup_data(data, path)
    loaded = load_warmup_data(path)
    assert [c.response_ids for c in loaded.train] == [c.response_ids for c in data.train]
    assert loaded.held_out[0].prompt_ids == (1, 2, 3) and loaded.generate_seconds == 4.0
    torch.testing.assert_close(loaded.train[1].target_hidden, data.train[1].target_hidden)
    torch.testing.assert_close(loaded.held_out_prompt_states[0], data.held_out_prompt_states[0])
    assert not list(tmp_path.glob(".*tmp*"))
    path.write_bytes(path.read_bytes()[:100])
    assert load_warmup_data(path) is None
    assert load_warmup_data(tmp_path / "none.pt") is None


def drafter_and_batch() -> tuple[EagleDrafter, DrafterBatch]:
    """A fresh drafter over a tiny Qwen2 and one batch of two random 12-token sequences with the target's states."""
    target = tiny_qwen2(VOCAB_SIZE, 0, 64, hidden_size=32, tie_word_embeddings=True)
    sequences = torch.randint(0, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(3))
    hidden = target.get_decoder()(input_ids=sequences).last_hidden_state.detach()
    batch = DrafterBatch.from_sequences(sequences, hidden, torch.ones_like(sequences, dtype=torch.bool))
    return EagleDrafter(target, seed=0), batch


def test_training_stops_once_held_out_acceptance_stops_rising_and_keeps_the_best(monkeypatch):
    from tlt_cli.drafter import warmup

    drafter, batch = drafter_and_batch()
    trainer = DrafterTrainer(drafter, lr=1e-3)
    monkeypatch.setattr(warmup, "EVALUATE_EVERY", 2)
    scores = iter([0.1, 0.5, 0.502, 0.501, 0.503, 0.9])  # flat after the second evaluation
    saved = []

    def evaluate():
        saved.append({name: value.clone() for name, value in drafter.state_dict().items()})
        return next(scores)

    losses = warmup.train_on_buckets(trainer, [batch], steps=100, seed=0, evaluate=evaluate)
    assert len(losses) == 10, "stopped at the fifth evaluation: no gain of PLATEAU_GAIN over three"
    best = saved[4]  # 0.503, the highest score seen
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, best[name])


def test_the_warm_up_samples_in_bfloat16_where_the_machine_has_it(model_folder, monkeypatch):
    from tlt_cli.tuning import cache

    recipe = recipe_for(model_folder)
    monkeypatch.setattr(cache, "matrix_flags", lambda: ("avx512_bf16",))
    assert setup.warmup_dtype(recipe, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(cache, "matrix_flags", lambda: ())
    assert setup.warmup_dtype(recipe, torch.device("cpu")) == torch.float32
    assert setup.warmup_dtype(recipe_for(model_folder, "rollout.dtype=bfloat16"), torch.device("cpu")) == torch.bfloat16


def test_a_log_gets_a_progress_line_with_what_is_left():
    import io

    from rich.console import Console

    from tlt_cli.display import PhaseProgress

    log = io.StringIO()
    with PhaseProgress(Console(file=log), "drafter warm-up", interval=0.01) as progress:
        assert progress.line() is None
        progress("generate", 4, 16)
        for _ in range(500):
            if "generate 4/16" in log.getvalue():
                break
            time.sleep(0.01)
    assert "drafter warm-up: generate 4/16, " in log.getvalue()
    assert "s left" in progress.line()


def test_a_drafter_trained_further_keeps_its_start_unless_training_beats_it(monkeypatch):
    from tlt_cli.drafter import warmup

    drafter, batch = drafter_and_batch()
    start = {name: value.clone() for name, value in drafter.state_dict().items()}
    monkeypatch.setattr(warmup, "EVALUATE_EVERY", 2)
    trainer = DrafterTrainer(drafter, lr=1e-2)
    scores = iter([0.4, 0.45, 0.44, 0.43])  # every evaluation below the start's 0.5
    losses = warmup.train_on_buckets(trainer, [batch], 8, 0, evaluate=lambda: next(scores), start_score=0.5)
    assert len(losses) == 8
    for name, value in drafter.state_dict().items():
        torch.testing.assert_close(value, start[name])


def test_a_recipes_first_warm_up_trains_the_held_drafter_further_on_prompts_of_its_own(tmp_path, small_model):
    from tlt_cli.drafter.initial import first_warmup_prompt
    from tlt_cli.drafter.warmup import FRESH_START

    cache = tmp_path / "cache"
    settings = ["drafter.init=warmup", "drafter.warmup_prompts=8", "drafter.warmup_batch_size=4"]
    settings += ["rollout.max_new_tokens=16", "drafter.warmup_lr=3e-3"]
    first = recipe_for(small_model, *settings, "drafter.warmup_steps=60", "run.name=first")
    first_folder, first_report = setup.warmed_up_drafter(first, cache)
    assert first_report["started_from"] == FRESH_START
    held, record = library.newest(cache, small_model)
    assert record.source == "the warm-up of first"
    # another recipe on the model (another warm-up key): its warm-up starts from the held drafter, not afresh
    second = recipe_for(small_model, *settings, "drafter.warmup_steps=2", "run.name=second")
    second_folder, second_report = setup.warmed_up_drafter(second, cache)
    assert second_folder != first_folder
    assert second_report["started_from"].startswith("the drafter tlt held, from the warm-up of first")
    assert second_report["draft_vocab_size"] == first_report["draft_vocab_size"]
    assert second_report["held_out_acceptance_before"] > first_report["held_out_acceptance_before"] + 0.1, (
        "the second warm-up starts from the first's trained drafter, not from fresh weights"
    )
    assert second_report["held_out_accept_length"] >= 1 + second_report["held_out_acceptance_before"] - 1e-6, (
        "a drafter trained further is never left worse on the held-out responses than it came"
    )
    block = first_warmup_prompt(held, 8 + 32)
    assert block > 0 and block % 40 == 0, "it samples a block of prompts of its own, not the first warm-up's"
    # the second recipe's warm-up is cached now: the next call reads it back
    assert setup.warmed_up_drafter(second, cache) == (second_folder, None)
