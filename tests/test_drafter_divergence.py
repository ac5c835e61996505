"""A drafter that diverges does not stop the run (issue 65): the decoder finishes the call without its drafts and with
the target's tokens, the ranks agree to reset it (or, diverging again soon, to turn it off), the drafter gets fresh
weights in place and the sidecar a fresh optimizer, and the step record names what was done."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing
from test_drafter_sidecar import context, feed, started_sidecar
from test_drafter_sidecar import tiny_target as sidecar_target
from test_speculative import TargetAsDrafter, generate, requests_for, tiny_target

from tlt_cli.config import DrafterConfig
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.engine.sampling import MIN_TEMPERATURE, SamplingParams
from tlt_cli.processes.distributed import free_port
from tlt_cli.processes.messages import WorkerStepReport
from tlt_cli.processes.step_records import step_records
from tlt_cli.speculative.decoder import SpeculativeDecoder
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.trace import request_record
from tlt_cli.training.drafter_divergence import (
    OFF_ACTION,
    REPEAT_WINDOW_STEPS,
    RESET_ACTION,
    DrafterWatch,
    reset_in_place,
)

torch.set_num_threads(1)
# sampling this cold draws the argmax of the tiny target (checked against greedy decoding in each test), and still
# samples the drafter's drafts, which is where a drafter's NaN logits are met
COLD = SamplingParams(max_new_tokens=16, temperature=MIN_TEMPERATURE)
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
SHAPES = [SpeculativeConfig(steps=3), SpeculativeConfig(steps=2, ngram_tokens=4)]


def diverging_after(drafter: TargetAsDrafter, calls: int) -> TargetAsDrafter:
    """`drafter`, whose logits turn NaN from its call number `calls` on (a drafter diverging mid-rollout)."""
    seen = []

    def count(module, arguments):
        seen.append(1)
        if len(seen) >= calls:
            module.noise.fill_(float("nan"))

    drafter.register_forward_pre_hook(count)
    return drafter


def _target():
    torch.manual_seed(0)
    return tiny_target(initializer_range=0.5)


@pytest.mark.parametrize("config", SHAPES, ids=lambda config: config.label())
def test_a_drafter_diverging_mid_call_leaves_the_targets_tokens_and_is_told(config):
    target = _target()
    requests = requests_for(4, seed=3)
    greedy = generate(target, requests, GREEDY, 1)
    assert [c.response_ids for c in generate(target, requests, COLD, 1)] == [c.response_ids for c in greedy]
    decoder = SpeculativeDecoder(diverging_after(TargetAsDrafter(target), calls=4), config)
    completions = generate(target, requests, COLD, 1, decoder)
    assert [c.response_ids for c in completions] == [c.response_ids for c in greedy]
    assert decoder.drafter_diverged
    # SD ran before the divergence: some drafts were verified
    assert sum(completion.speculative.verify_passes for completion in completions) > 0


def test_the_next_call_tries_the_drafter_again_and_a_drafter_turned_off_is_never_run():
    target = _target()
    requests = requests_for(3, seed=5)
    greedy = [c.response_ids for c in generate(target, requests, GREEDY, 1)]
    drafter = TargetAsDrafter(target)
    decoder = SpeculativeDecoder(drafter, SpeculativeConfig(steps=3))
    decoder.drafter_diverged = True  # what the last call left
    generate(target, requests, COLD, 1, decoder)
    assert not decoder.drafter_diverged  # a healthy drafter: nothing met this call
    calls = []
    drafter.register_forward_pre_hook(lambda module, arguments: calls.append(1))
    decoder.drafter_off = True
    completions = generate(target, requests, GREEDY, 1, decoder)
    assert calls == [] and [c.response_ids for c in completions] == greedy


def test_the_watch_resets_then_turns_off_a_drafter_that_diverges_again_soon():
    watch = DrafterWatch(DrafterConfig(lr=1e30))
    assert watch.after_rollout(0, diverged_here=False) is None
    first = watch.after_rollout(2, diverged_here=True)
    assert first.action == RESET_ACTION and not first.turned_off
    assert first.message.startswith(
        "step 2: the drafter's logits are not finite, so the drafter diverged, not the policy (most likely drafter.lr "
        "1e+30"
    )
    assert "fresh weights with a fresh optimizer" in first.message and "actor.lr" not in first.message
    later = 2 + REPEAT_WINDOW_STEPS + 1  # long after the reset: reset again
    assert watch.after_rollout(later, diverged_here=True).action == RESET_ACTION
    again = watch.after_rollout(later + 1, diverged_here=True)
    assert again.action == OFF_ACTION and again.turned_off
    assert "diverged again 1 steps after its reset, so the drafter is off for the rest of the run" in again.message
    assert watch.after_rollout(later + 2, diverged_here=True) is None  # off: nothing more to do, no collective


def _agreeing_worker(rank, port, diverged_by_step, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    watch = DrafterWatch(DrafterConfig())
    actions = []
    for step, diverged in enumerate(diverged_by_step[rank]):
        action = watch.after_rollout(step, diverged)
        actions.append(action.action if action is not None else None)
    results[rank] = actions
    torch.distributed.destroy_process_group()


def test_two_ranks_take_the_same_action_when_the_drafter_diverged_on_one():
    manager = torch.multiprocessing.get_context("spawn").Manager()
    results = manager.dict()
    diverged_by_step = {0: [False, True, False, False], 1: [False, False, False, True]}
    torch.multiprocessing.spawn(_agreeing_worker, args=(free_port(), diverged_by_step, results), nprocs=2)
    assert results[0] == results[1] == [None, RESET_ACTION, None, OFF_ACTION]


def test_reset_in_place_gives_the_drafter_the_fresh_ones_weights_and_vocabulary():
    target = sidecar_target()
    drafter = EagleDrafter(target, seed=1, vocabulary=DraftVocabulary(torch.arange(8), 24))
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.fill_(float("nan"))
    drafter.vocabulary.target_ids.copy_(torch.arange(16, 24))
    fresh = EagleDrafter(target, seed=2, vocabulary=DraftVocabulary(torch.arange(8), 24))
    held = dict(drafter.named_parameters())  # what the decoder and the sidecar hold
    reset_in_place(drafter, fresh)
    for name, parameter in fresh.named_parameters():
        assert held[name] is dict(drafter.named_parameters())[name] and torch.equal(held[name], parameter), name
    assert drafter.vocabulary.target_ids.tolist() == list(range(8))
    assert torch.equal(drafter.draft_head_weight, target.lm_head.weight[:8])


@pytest.mark.parametrize("turned_off", [False, True])
def test_the_sidecar_starts_a_fresh_optimizer_and_stops_training_a_drafter_turned_off(turned_off):
    target = sidecar_target()
    sidecar, drafter = started_sidecar(target)
    feed(sidecar, target, step=0)
    sidecar.on_worker_idle(context(0, target, drafter), rollout_over=_after(3))
    assert sidecar.trainer.optimizer.state and sidecar.steps_since_average > 0
    reset_in_place(drafter, EagleDrafter(target, seed=5))
    sidecar.on_drafter_reset(context(0, target, drafter), turned_off)
    assert not sidecar.trainer.optimizer.state and sidecar.steps_since_average == 0
    assert all(torch.equal(value, dict(drafter.named_parameters())[name]) for name, value in sidecar.last_good.items())
    sidecar.on_worker_idle(context(0, target, drafter), rollout_over=_after(3))
    assert (sidecar.steps_since_average > 0) is not turned_off


def _after(calls: int):
    """A rollout_over that says the rollout is over from its call number `calls` on."""
    asked = []

    def rollout_over() -> bool:
        asked.append(1)
        return len(asked) > calls

    return rollout_over


def _report(worker: int, action: str | None) -> WorkerStepReport:
    record = request_record(
        step=4,
        worker=worker,
        request_id=worker,
        start=0.0,
        end=1.0,
        prompt_tokens=3,
        tokens=5,
        reward=1.0,
        finished_by_eos=True,
        verify_passes=0,
        accepted_tokens=0,
        accepted_by_depth=[],
        proposed_by_depth=[],
    )
    return WorkerStepReport(4, worker, 0.0, 1.0, 1.5, 0.1, 0.2, [record], {}, drafter_divergence=action)


@pytest.mark.parametrize("action", [None, RESET_ACTION, OFF_ACTION])
def test_the_step_record_names_what_was_done_about_the_drafter(action):
    *_, step = step_records([_report(1, action), _report(0, action)])
    assert step["type"] == "step" and step["drafter_divergence"] == action
