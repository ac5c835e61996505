"""A worker's memory (tlt_cli/training/memory.py): the /proc readings, and `tlt train` refusing a run
whose estimated peak this machine cannot hold."""

import mmap
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from tlt_cli.cli import LOADING_LINE, app
from tlt_cli.config import RecipeError, load_recipe
from tlt_cli.preflight import check_memory
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.training import memory

runner = CliRunner()
MEGABYTE = 1e6


def test_the_peak_rises_with_an_allocation_and_a_reset_starts_it_again():
    if not memory.reset_peak_resident():
        pytest.skip("this kernel does not let a process reset its resident high-water mark")
    before = memory.resident_bytes()
    # 200 MB of fresh pages, each touched: a torch tensor could reuse memory a long test session freed but
    # the C allocator kept resident, and leave the peak where it was
    block = mmap.mmap(-1, int(200 * MEGABYTE))
    for offset in range(0, len(block), mmap.PAGESIZE):
        block[offset] = 1
    block.close()
    assert memory.peak_resident_bytes() >= before + 180 * MEGABYTE
    assert memory.reset_peak_resident()
    assert memory.peak_resident_bytes() < before + 100 * MEGABYTE
    assert memory.available_bytes() > 0


def test_the_estimate_grows_with_prompts_and_tokens_and_splits_adam_over_zero_workers():
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"))
    shape = memory.model_shape(recipe)
    assert shape.parameters > 1_000_000 and shape.layers > 0

    def estimate(*overrides):
        return memory.worker_peak_estimate(load_recipe(resolve_recipe_path("tiny-cpu"), list(overrides)), shape, 50)

    base = estimate()
    longer, more = estimate("rollout.max_new_tokens=1280"), estimate("train.prompts_per_step=64")
    assert longer.update > base.update and longer.rollout > base.rollout and more.rollout > base.rollout
    # ZeRO 2 over 2 workers: each holds half the AdamW moments and master copy, and half the gradients in
    # its own buffer besides the whole gradient of backward; ZeRO 0: the moments and the gradient, whole
    # recomputation keeps each layer's input and one layer's activations instead of every layer's
    recomputed = estimate("actor.gradient_checkpointing=true")
    assert recomputed.update < base.update and recomputed.training_state == base.training_state
    unsplit = estimate("actor.zero_stage=0")
    assert unsplit.training_state == shape.parameters * 4 * 3
    assert base.training_state == shape.parameters * 4 * 3 // 2 + shape.parameters * 4 + shape.parameters * 4 // 2


def test_a_run_fits_exactly_when_its_workers_estimate_is_at_most_what_is_available(monkeypatch):
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"))
    needed = memory.worker_peak_estimate(
        recipe, memory.model_shape(recipe), memory.longest_prompt_tokens(recipe)
    ).total_bytes
    monkeypatch.setattr(memory, "available_bytes", lambda: needed * recipe.workers.count)
    check_memory(recipe)
    monkeypatch.setattr(memory, "available_bytes", lambda: needed * recipe.workers.count - 1)
    with pytest.raises(RecipeError, match="workers.count, train.prompts_per_step or rollout.max_new_tokens"):
        check_memory(recipe)


def test_a_step_too_big_for_memory_is_refused_before_its_prompts_are_encoded(monkeypatch):
    """10^8 prompts a step: without any prompt the workers already cannot fit, so none of them is encoded (which
    took hours, in silence) and the refusal names the keys."""
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), ["train.prompts_per_step=100000000"])
    monkeypatch.setattr(memory, "longest_prompt_tokens", lambda recipe: pytest.fail("encoded the prompts"))
    with pytest.raises(RecipeError, match="lower workers.count, train.prompts_per_step or rollout.max_new_tokens"):
        check_memory(recipe)


def test_tlt_train_refuses_a_recipe_that_cannot_fit_in_one_sentence_with_exit_2(tmp_path):
    result = runner.invoke(
        app, ["train", "tiny-cpu", "rollout.max_new_tokens=2000000", f"run.output_dir={tmp_path}", "run.name=huge"]
    )
    assert result.exit_code == 2, result.output
    (line,) = [line for line in result.output.strip().splitlines() if line and line != LOADING_LINE]
    assert "2 workers would need about" in line and "GB available" in line
    assert "lower workers.count, train.prompts_per_step or rollout.max_new_tokens" in line
    assert not (tmp_path / "huge").exists()


def test_the_estimate_itemizes_the_drafter_the_sidecar_and_the_decode_copies_only_where_a_run_has_them():
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"))
    shape = memory.model_shape(recipe)

    def estimate(*overrides):
        return memory.worker_peak_estimate(load_recipe(resolve_recipe_path("tiny-cpu"), list(overrides)), shape, 50)

    full, plain = estimate(), estimate("speculative.mode=off", "plugins.enabled=[]")
    layer = memory.layer_linear_parameters(shape)
    drafter_parameters = layer + 2 * shape.hidden * shape.hidden
    # the sidecar trains it: weights, gradients and two AdamW moments, float32
    assert full.drafter == drafter_parameters * 4 * 4 and plain.drafter == 0
    sequence = 50 + recipe.rollout.max_new_tokens
    window = recipe.drafter.window_steps * recipe.samples_per_worker * sequence
    assert full.sidecar == window * (shape.hidden * 4 + 10) and plain.sidecar == 0
    assert full.decode_copies == plain.decode_copies == shape.layers * layer * 4  # float32: rollout.dtype auto's worst
    assert estimate("rollout.dtype=bfloat16").decode_copies == shape.layers * layer * 2
    assert full.total_bytes - plain.total_bytes == full.drafter + full.sidecar
    assert "decode copies" in full.describe() and "sidecar buffers" in full.describe()


def test_the_estimate_counts_padded_rows_where_the_model_cannot_pack():
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.micro_batch_tokens=4096", "actor.micro_batch_size=2"])
    shape = memory.model_shape(recipe)
    assert shape.packs
    padded = memory.micro_batch_extent(replace(recipe, actor=replace(recipe.actor, micro_batch_tokens=0)), 50)
    assert memory.micro_batch_extent(recipe, 50) != padded
    assert memory.micro_batch_extent(recipe, 50, packs=False) == padded
    unpacked = memory.worker_peak_estimate(recipe, replace(shape, packs=False), 50)
    assert (
        unpacked.update
        == memory.worker_peak_estimate(
            replace(recipe, actor=replace(recipe.actor, micro_batch_tokens=0)), shape, 50
        ).update
    )


def test_the_estimate_counts_the_dense_masks_only_where_the_decoder_does_not_attend_by_segments():
    recipe = load_recipe(resolve_recipe_path("tiny-cpu"), ["actor.micro_batch_tokens=4096"])
    shape = memory.model_shape(recipe)
    assert shape.by_segments  # sdpa: the packed layout builds no [L,L] mask (tests/test_packed_forward.py)
    by_segments = memory.worker_peak_estimate(recipe, shape, 50)
    dense = memory.worker_peak_estimate(recipe, replace(shape, by_segments=False), 50)
    tokens, pairs = memory.micro_batch_extent(recipe, 50)
    assert pairs < tokens**2 and memory.micro_batch_extent(recipe, 50, by_segments=False) == (tokens, tokens**2)
    assert dense.update - by_segments.update >= tokens**2 * memory.DENSE_MASK_PAIR_BYTES
