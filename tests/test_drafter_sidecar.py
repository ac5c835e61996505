"""The drafter sidecar plugin: data window, training in the update and in the idle tail, weighted averaging,
checkpoints."""

import copy
import os
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing
from tiny_models import tiny_qwen2

from tlt_cli.config import DrafterConfig
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.drafter.vocabulary import DraftVocabulary
from tlt_cli.plugins import PluginHost, StepContext
from tlt_cli.processes.distributed import free_port
from tlt_cli.rollout.types import Completion
from tlt_cli.training.policy_batch import build_policy_batch
from tlt_plugins.drafter_sidecar import DrafterSidecar

torch.set_num_threads(1)


def tiny_target():
    return tiny_qwen2(vocab_size=24)


def recipe(window_steps=2, batch_size=4, lr=1e-2, update_share=0.05, idle_duty=1.0):
    drafter = DrafterConfig(
        lr=lr, window_steps=window_steps, batch_size=batch_size, update_share=update_share, idle_duty=idle_duty
    )
    return SimpleNamespace(drafter=drafter, run=SimpleNamespace(seed=0), rollout=SimpleNamespace(temperature=1.0))


def context(step, target, drafter, world_size=1, worker=0):
    return StepContext(step=step, worker=worker, world_size=world_size, engine=None, policy=target, drafter=drafter)


def feed(sidecar, target, step, seed=0):
    """One actor micro-batch of 4 sequences and its hidden states, as the actor hands them over."""
    sidecar.on_hidden_states(context(step, target, sidecar.drafter), *_micro_batch(target, step, seed))


def _micro_batch(target, step, seed=0):
    """(policy batch of 4 sequences, their hidden states)."""
    generator = torch.Generator().manual_seed(seed + step)
    completions = [
        Completion(
            i,
            tuple(torch.randint(3, 24, (3,), generator=generator).tolist()),
            torch.randint(3, 24, (6 + i,), generator=generator).tolist(),
            True,
            0.0,
            1.0,
        )
        for i in range(4)
    ]
    batch = build_policy_batch(completions, torch.zeros(4), pad_token_id=0)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    return batch, hidden


def started_sidecar(target, **settings):
    sidecar = DrafterSidecar(recipe(**settings))
    drafter = EagleDrafter(target, seed=1)
    sidecar.on_rollout_start(context(0, target, drafter))
    return sidecar, drafter


def test_window_keeps_only_recent_steps():
    target = tiny_target()
    sidecar, _ = started_sidecar(target, window_steps=2)
    for step in range(4):
        feed(sidecar, target, step)
    assert [data.step for data in sidecar.window] == [2, 3]


def test_idle_training_runs_until_the_rollout_is_over_and_reduces_the_loss():
    target = tiny_target()
    sidecar, drafter = started_sidecar(target)
    feed(sidecar, target, 0)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    polls = iter([False] * 30 + [True])
    sidecar.on_worker_idle(context(1, target, drafter), lambda: next(polls))
    assert sidecar.steps_done == 30
    assert all(not torch.equal(before[name], value) for name, value in drafter.state_dict().items())
    # the target's shared modules are untouched
    assert drafter.shared.lm_head is target.lm_head


def test_nothing_to_train_on_returns_at_once():
    target = tiny_target()
    sidecar, drafter = started_sidecar(target)
    sidecar.on_worker_idle(context(0, target, drafter), lambda: False)
    assert sidecar.steps_done == 0


def test_a_non_finite_average_is_discarded_and_the_last_good_drafter_kept():
    target = tiny_target()
    sidecar, drafter = started_sidecar(target)
    good = {name: value.clone() for name, value in drafter.state_dict().items()}
    sidecar.steps_since_average = 1
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    step_context = context(0, target, drafter)
    sidecar.on_rollout_end(step_context)
    assert step_context.metrics["drafter_discarded_steps"] == 1.0
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, good[name]), name


def test_checkpoint_round_trip_restores_drafter_optimizer_and_window(tmp_path):
    target = tiny_target()
    sidecar, drafter = started_sidecar(target)
    feed(sidecar, target, 0)
    polls = iter([False] * 5 + [True])
    sidecar.on_worker_idle(context(1, target, drafter), lambda: next(polls))
    sidecar.on_checkpoint_save(tmp_path)
    assert (tmp_path / "drafter" / "drafter.safetensors").is_file()

    restored = DrafterSidecar(recipe())
    restored.on_checkpoint_load(tmp_path)
    fresh_drafter = EagleDrafter(target, seed=2)
    restored.on_rollout_start(context(1, target, fresh_drafter))
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, fresh_drafter.state_dict()[name]), name
    assert [data.step for data in restored.window] == [0]
    # the next training step is identical in both: same optimizer state, same data draw
    for each in (sidecar, restored):
        polls = iter([False, True])
        each.on_worker_idle(context(1, target, each.drafter), lambda polls=polls: next(polls))
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, fresh_drafter.state_dict()[name]), name


class ManualClock:
    """A clock the test moves: the actor's forward takes what the test says, each drafter step one second."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def sidecar_in_update(target, clock, **settings):
    """A sidecar whose rollout just ended (its update phase began at clock 0), with each drafter step
    lasting one second of `clock` and the rows of each step recorded."""
    sidecar, drafter = started_sidecar(target, **settings)
    sidecar.clock = clock
    sidecar.on_rollout_end(context(0, target, drafter))
    trained_rows = []
    train_step = sidecar.trainer.train_step

    def timed_step(batch):
        trained_rows.append(batch.input_ids.clone())
        clock.now += 1.0
        return train_step(batch)

    sidecar.trainer.train_step = timed_step
    return sidecar, drafter, trained_rows


def test_the_update_trains_on_every_fresh_row_first_then_replays_within_its_share():
    target = tiny_target()
    clock = ManualClock()
    sidecar, drafter, trained_rows = sidecar_in_update(target, clock, batch_size=1, update_share=0.05)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    clock.now = 100.0  # the update's first forward took 100 s: 5% of it is 5 drafter steps of 1 s
    step_context = context(0, target, drafter)
    sidecar.on_hidden_states(step_context, *_micro_batch(target, step=0))
    fresh = sidecar.window[-1].batches[-1]
    assert len(trained_rows) == 5
    # one row each: the micro-batch's 4 rows in order, then one replayed from the window
    for row, rows in enumerate(trained_rows[:4]):
        assert torch.equal(rows, fresh.input_ids[row : row + 1])
    assert step_context.metrics["drafter_update_steps"] == 5.0
    assert step_context.metrics["drafter_update_seconds"] == 5.0
    assert all(not torch.equal(before[name], value) for name, value in drafter.state_dict().items())
    # the next average weighs them in
    assert sidecar.steps_since_average == 5


def test_the_update_share_bounds_the_drafter_seconds_over_many_micro_batches():
    target = tiny_target()
    clock = ManualClock()
    sidecar, drafter, _ = sidecar_in_update(target, clock, batch_size=2, update_share=0.1)
    step_context = context(0, target, drafter)
    for micro_batch in range(6):
        clock.now += 7.0  # each micro-batch's forward and backward
        sidecar.on_hidden_states(step_context, *_micro_batch(target, step=0, seed=micro_batch))
        drafter_seconds = step_context.metrics["drafter_update_seconds"]
        assert drafter_seconds <= 0.1 * (clock.now - drafter_seconds) + 1.0  # at most one step past the bound
    assert step_context.metrics["drafter_update_steps"] >= 4


def test_a_drafter_step_starts_in_the_update_only_when_its_predicted_seconds_keep_the_share():
    """The cap holds, not one step past it: the drafter's update seconds the trace records stay within update_share
    of the update's other seconds after every micro-batch, each step's cost predicted from the steps measured (here
    one idle step of the rollout before, each step one second of the test's clock)."""
    target = tiny_target()
    clock = ManualClock()
    sidecar, drafter = started_sidecar(target, batch_size=2, update_share=0.1)
    sidecar.clock = clock
    train_step = sidecar.trainer.train_step

    def one_second_step(batch):
        clock.now += 1.0
        return train_step(batch)

    sidecar.trainer.train_step = one_second_step
    feed(sidecar, target, 0)
    polls = iter([False, True])
    sidecar.on_worker_idle(context(0, target, drafter), lambda: next(polls))  # one step of the idle tail
    sidecar.on_rollout_end(context(0, target, drafter))
    update_started = clock.now
    step_context = context(1, target, drafter)
    for micro_batch in range(6):
        clock.now += 7.0  # each micro-batch's forward and backward
        sidecar.on_hidden_states(step_context, *_micro_batch(target, step=1, seed=micro_batch))
        drafter_seconds = step_context.metrics.get("drafter_update_seconds", 0.0)
        other_seconds = clock.now - update_started - drafter_seconds
        assert drafter_seconds <= 0.1 * other_seconds, (micro_batch, drafter_seconds, other_seconds)
    assert step_context.metrics["drafter_update_steps"] >= 3


@pytest.mark.parametrize("update_share", [0.0, 0.05])
def test_no_drafter_step_in_the_update_with_a_zero_share_or_outside_an_update(update_share):
    target = tiny_target()
    clock = ManualClock()
    sidecar, drafter, trained_rows = sidecar_in_update(target, clock, update_share=update_share)
    if update_share:  # a rollout started: hidden states handed over now (TRL's wait) are not the update's
        sidecar.on_rollout_start(context(1, target, drafter))
    clock.now = 100.0
    sidecar.on_hidden_states(context(1, target, drafter), *_micro_batch(target, step=1))
    assert trained_rows == [] and sidecar.steps_since_average == 0


def _average_worker(rank, port, steps_by_rank, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    target = tiny_target()
    sidecar = DrafterSidecar(recipe())
    drafter = EagleDrafter(target, seed=10 + rank)  # each worker's copy differs
    sidecar.on_rollout_start(context(0, target, drafter, world_size=2, worker=rank))
    sidecar.steps_since_average = steps_by_rank[rank]
    step_context = context(0, target, drafter, world_size=2, worker=rank)
    sidecar.on_rollout_end(step_context)
    results[rank] = ({name: value.clone() for name, value in drafter.state_dict().items()}, step_context.metrics)
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("steps_by_rank", [(3, 1), (0, 2)])
def test_averaging_across_two_processes_is_weighted_by_steps(steps_by_rank):
    manager = torch.multiprocessing.get_context("spawn").Manager()
    results = manager.dict()
    torch.multiprocessing.spawn(_average_worker, args=(free_port(), steps_by_rank, results), nprocs=2)
    target = tiny_target()
    copies = [EagleDrafter(target, seed=10 + rank).state_dict() for rank in range(2)]
    total = sum(steps_by_rank)
    for rank in range(2):
        state, metrics = results[rank]
        assert metrics["drafter_version"] == 1.0
        for name, value in state.items():
            expected = sum(copies[r][name] * steps_by_rank[r] for r in range(2)) / total
            assert torch.allclose(value, expected, atol=1e-6), (rank, name)


def test_a_reduced_vocabulary_follows_the_tokens_responses_emit_and_survives_a_checkpoint(tmp_path):
    target = tiny_target()
    sidecar = DrafterSidecar(recipe())
    drafter = EagleDrafter(target, seed=1, vocabulary=DraftVocabulary(torch.arange(8), 24))
    formed_copy = copy.copy(drafter)  # the engine's formed copy shares the vocabulary object
    step_context = context(0, target, drafter)
    sidecar.on_rollout_start(step_context)
    for response in ([20, 21, 20, 2], [21, 20, 3, 2]):
        sidecar.on_request_finished(step_context, Completion(0, (1,), response, True, 0.0, 1.0))
    sidecar.on_rollout_end(step_context)
    # emitted tokens 20, 21, 2, 3 take places; of the others, the kept tokens 0-7 win the ties over unseen ones
    assert drafter.vocabulary.target_ids.tolist() == [0, 1, 2, 3, 4, 5, 20, 21]
    assert formed_copy.vocabulary.target_ids.tolist() == [0, 1, 2, 3, 4, 5, 20, 21]
    assert torch.equal(drafter.draft_head_weight, target.lm_head.weight[drafter.vocabulary.target_ids])
    sidecar.on_checkpoint_save(tmp_path)
    restored = DrafterSidecar(recipe())
    restored.on_checkpoint_load(tmp_path)
    fresh = EagleDrafter(target, seed=2, vocabulary=DraftVocabulary(torch.arange(8), 24))
    restored.on_rollout_start(context(1, target, fresh))
    assert fresh.vocabulary.target_ids.tolist() == [0, 1, 2, 3, 4, 5, 20, 21]
    assert torch.equal(restored.emitted_total, sidecar.emitted_total)


def test_a_full_vocabulary_stays_full():
    target = tiny_target()
    sidecar, drafter = started_sidecar(target)
    step_context = context(0, target, drafter)
    sidecar.on_request_finished(step_context, Completion(0, (1,), [20, 21], True, 0.0, 1.0))
    sidecar.on_rollout_end(step_context)
    assert not drafter.vocabulary.is_reduced


def test_a_checkpoint_written_without_the_sidecar_starts_it_fresh(tmp_path, caplog):
    sidecar = DrafterSidecar(recipe())
    sidecar.on_checkpoint_load(tmp_path)  # a plain run's checkpoint, resumed with TLT on
    assert sidecar.pending_state is None
    assert "starts fresh" in caplog.text


def saved_sidecar(target, directory):
    """A sidecar that trained a few idle steps, its state checkpointed into `directory`; its state file."""
    sidecar, drafter = started_sidecar(target)
    feed(sidecar, target, 0)
    polls = iter([False] * 3 + [True])
    sidecar.on_worker_idle(context(1, target, drafter), lambda: next(polls))
    sidecar.on_checkpoint_save(directory)
    return directory / "drafter_sidecar" / "rank-0.pt"


def resumed_through_the_host(target, directory):
    """A new sidecar resumed from `directory` as a worker does (through PluginHost), at its first rollout; the
    sidecar, its drafter and the host."""
    sidecar = DrafterSidecar(recipe())
    sidecar.name = "drafter_sidecar"
    host = PluginHost([sidecar])
    host.call("on_checkpoint_load", directory)
    drafter = EagleDrafter(target, seed=2)
    host.call("on_rollout_start", context(1, target, drafter))
    return sidecar, drafter, host


def test_a_state_file_with_4_kb_zeroed_and_its_size_kept_is_damage_and_the_sidecar_starts_fresh(tmp_path, caplog):
    target = tiny_target()
    path = saved_sidecar(target, tmp_path)
    size = path.stat().st_size
    with path.open("r+b") as handle:
        handle.seek(size // 2)
        handle.write(bytes(4096))
    assert path.stat().st_size == size
    sidecar, drafter, host = resumed_through_the_host(target, tmp_path)
    assert host.failures == [] and not host.disabled
    assert f"checkpoint file {path} is damaged (record" in caplog.text
    assert "the drafter sidecar starts fresh" in caplog.text
    assert not sidecar.window and sidecar.trainer.steps_taken == 0
    fresh = EagleDrafter(target, seed=2)
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in drafter.state_dict().items())


@pytest.mark.parametrize(
    ("saved", "said"),
    [
        ({}, "it has no 'trainer', 'window', 'version', 'generator'"),
        ([1, 2], "it holds a list"),
        ({"trainer": None, "window": [], "version": 0, "generator": "seed"}, "'generator' is not a random"),
        ({"trainer": {}, "window": [], "version": 0, "generator": torch.Generator().get_state()}, "'trainer' lacks"),
    ],
)
def test_a_loadable_but_incomplete_state_is_one_warning_and_a_fresh_sidecar_never_a_disabled_one(
    tmp_path, caplog, saved, said
):
    target = tiny_target()
    (tmp_path / "drafter_sidecar").mkdir()
    torch.save(saved, tmp_path / "drafter_sidecar" / "rank-0.pt")
    sidecar, drafter, host = resumed_through_the_host(target, tmp_path)
    assert host.failures == [] and not host.disabled
    assert f"drafter sidecar state {tmp_path / 'drafter_sidecar' / 'rank-0.pt'} is damaged ({said}" in caplog.text
    assert "the sidecar starts fresh" in caplog.text
    feed(sidecar, target, 1)
    polls = iter([False, True])
    host.call("on_worker_idle", context(1, target, drafter), lambda: next(polls))
    assert sidecar.steps_done == 1 and host.failures == []


def test_another_drafters_state_is_a_warning_and_the_drafter_keeps_its_starting_weights(tmp_path, caplog):
    target = tiny_target()
    path = saved_sidecar(target, tmp_path)
    saved = torch.load(path, weights_only=False)
    saved["trainer"]["drafter"]["fc.weight"] = torch.zeros(3, 3)  # another drafter's shape
    torch.save(saved, path)
    sidecar, drafter, host = resumed_through_the_host(target, tmp_path)
    assert host.failures == [] and not host.disabled
    assert "drafter sidecar state does not fit this run's drafter (RuntimeError" in caplog.text
    fresh = EagleDrafter(target, seed=2)
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in drafter.state_dict().items())
    assert not sidecar.window and sidecar.version == 0


@pytest.mark.parametrize(("idle_duty", "steps"), [(1.0, 20), (0.25, 5), (0.0, 0)])
def test_idle_training_takes_its_duty_of_the_wait_and_pauses_for_the_rest(idle_duty, steps):
    target = tiny_target()
    clock = ManualClock()
    sidecar, drafter = started_sidecar(target, idle_duty=idle_duty)
    feed(sidecar, target, 0)
    sidecar.clock = clock
    sidecar.sleep = lambda seconds: setattr(clock, "now", clock.now + seconds)
    train_step = sidecar.trainer.train_step

    def one_second_step(batch):
        clock.now += 1.0
        return train_step(batch)

    sidecar.trainer.train_step = one_second_step
    sidecar.on_worker_idle(context(1, target, drafter), lambda: clock.now >= 20.0)  # a wait of 20 s
    assert sidecar.steps_done == steps
    assert clock.now == pytest.approx(20.0 if steps else 0.0)  # no step, and no pause, once the rollout is over
