"""The drafter unrolled over its own predictions (tlt_cli/drafter/unrolled.py) computes at each depth what
the drafter computes while it drafts a chain, and training over depths teaches the later depths."""

from __future__ import annotations

import pytest
import torch
from test_drafter import VOCAB_SIZE, random_inputs, tiny_llama_untied, tiny_target_qwen2
from transformers import DynamicCache

from tlt_cli.drafter.loss import acceptance_objective
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.trainer import DrafterBatch, DrafterTrainer, collect_drafter_batch, evaluate_drafter
from tlt_cli.drafter.unrolled import unrolled_loss_mask, unrolled_outputs

torch.set_num_threads(1)


def drafted_chain_hidden(drafter: EagleDrafter, input_ids, target_hidden, position_ids, root: int, depth: int):
    """The hidden state of the depth-`depth` entry of the chain rooted at `root`, computed as drafting does:
    the committed entries 0..root from the target's states, then one entry a step from the parent's prediction."""
    cache = DynamicCache()
    committed = slice(0, root + 1)
    hidden = drafter(input_ids[:, committed], target_hidden[:, committed], position_ids[:, committed], None, cache)
    hidden = hidden.hidden[:, -1:]
    for step in range(1, depth):
        position = slice(root + step, root + step + 1)
        hidden = drafter(input_ids[:, position], hidden, position_ids[:, position], None, cache).hidden
    return hidden[:, 0]


@pytest.mark.parametrize("build_target", [tiny_target_qwen2, tiny_llama_untied])
def test_each_depth_computes_what_the_drafted_chain_computes(build_target):
    drafter = EagleDrafter(build_target(), seed=3)
    input_ids, target_hidden, position_ids = random_inputs(length=9)
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].expand(2, 1, 9, 9)
    with torch.no_grad():
        outputs = unrolled_outputs(drafter, input_ids, target_hidden, position_ids, valid, causal, depths=4)
        for depth in range(1, 5):
            for root in range(0, 9 - depth + 1):
                chain = drafted_chain_hidden(drafter, input_ids, target_hidden, position_ids, root, depth)
                torch.testing.assert_close(outputs[depth - 1].hidden[:, root + depth - 1], chain, atol=1e-5, rtol=1e-5)


def test_a_later_depth_is_not_the_first_depth_again():
    """The probe: the depths differ (they read the drafter's predictions, not the target's states), so the
    comparison above can fail."""
    drafter = EagleDrafter(tiny_target_qwen2(), seed=3)
    input_ids, target_hidden, position_ids = random_inputs(length=9)
    valid = torch.ones_like(input_ids, dtype=torch.bool)
    causal = torch.tril(torch.ones(9, 9, dtype=torch.bool))[None, None].expand(2, 1, 9, 9)
    with torch.no_grad():
        first, second = unrolled_outputs(drafter, input_ids, target_hidden, position_ids, valid, causal, depths=2)
    assert (first.hidden[:, 1:] - second.hidden[:, 1:]).abs().max() > 1e-3


def test_a_depth_counts_where_its_chain_root_counts():
    loss_mask = torch.tensor([[False, True, True, True, True, False]])
    assert unrolled_loss_mask(loss_mask, 1).tolist() == loss_mask.tolist()
    assert unrolled_loss_mask(loss_mask, 2).tolist() == [[False, False, True, True, True, False]]
    assert unrolled_loss_mask(loss_mask, 3).tolist() == [[False, False, False, True, True, False]]


def later_depth_acceptance(drafter: EagleDrafter, batch: DrafterBatch, depths: int) -> list[float]:
    loss = evaluate_drafter(drafter, batch, None, acceptance_objective(0.7, depths))
    return [float(depth_loss.acceptance) for depth_loss in loss.by_depth]


def sampled_sequences(target, count: int, prompt_length: int, response_length: int, temperature: float):
    """Responses sampled from the target at `temperature` (seeded): sequences [N,L] and their response mask."""
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, VOCAB_SIZE, (count, prompt_length), generator=generator)
    with torch.no_grad():
        for _ in range(response_length):
            probabilities = torch.softmax(target(input_ids=sequences).logits[:, -1] / temperature, dim=-1)
            sequences = torch.cat((sequences, torch.multinomial(probabilities, 1, generator=generator)), dim=1)
    response_mask = torch.zeros_like(sequences, dtype=torch.bool)
    response_mask[:, prompt_length:] = True
    return sequences, response_mask


def test_training_over_depths_raises_the_later_depths_acceptance():
    """Trained on depth 1 only, the third draft token's acceptance falls behind the first's (0.93 against
    0.98 here); trained over three depths it keeps up (0.96 at every depth)."""
    target = tiny_target_qwen2(seed=0)
    batch = collect_drafter_batch(target, *sampled_sequences(target, 8, 4, 20, temperature=0.7))
    acceptance = {}
    for depths in (1, 3):
        drafter = EagleDrafter(target, seed=0)
        trainer = DrafterTrainer(drafter, lr=3e-3, objective=acceptance_objective(0.7, depths))
        for _ in range(100):
            trainer.train_step(batch)
        acceptance[depths] = later_depth_acceptance(drafter, batch, 3)
    assert len(acceptance[1]) == 3
    assert acceptance[3][2] > acceptance[1][2] + 0.01, acceptance
