"""Plans whose figures agree: each pass a decode plan uses is measured once per planning, until it is stable.

The dtype probe (tlt_cli/tuning/precision.py) and the pass-cost grid (tlt_cli/tuning/pass_costs.py) share the passes
both time (the plain steps of the tail, the 4 x 4 verify): the plan holds one figure for each, and both decisions
read it. Every figure is a median repeated until it stops moving (tlt_cli/tuning/timing.py `stable_medians`),
tested here with timers that return set sequences, never with sleeps or wall-clock time.
"""

import itertools

import pytest
import torch
from test_speculative import tiny_target

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.training.setup import decode_plan_for
from tlt_cli.tuning import pass_costs, timing
from tlt_cli.tuning.timing import stable_medians

torch.set_num_threads(1)


def sequence_timer(values):
    """A timer that returns `values` in turn, then the last one forever."""
    values = itertools.chain(values, itertools.repeat(values[-1]))
    return lambda: next(values)


def test_a_figure_is_timed_until_its_last_two_medians_agree():
    # medians: 10, 15, 10, 10 -> the third and fourth agree: four rounds
    medians, rounds = stable_medians({"step": sequence_timer([10.0, 20.0, 10.0, 10.0, 50.0])})
    assert (medians, rounds) == ({"step": 10.0}, {"step": 4})


def test_at_least_the_least_rounds_are_timed_even_when_the_first_agree():
    medians, rounds = stable_medians({"step": sequence_timer([10.0])}, least_rounds=3)
    assert (medians, rounds) == ({"step": 10.0}, {"step": 3})


def counted_timer(value, calls, key):
    """A timer that returns `value` and counts its calls in calls[key]."""

    def timer():
        calls[key] = calls.get(key, 0) + 1
        return value

    return timer


def test_a_settled_figure_is_timed_no_more_and_the_rounds_stop_at_their_cap():
    calls = {}
    # a figure that doubles every round never settles: the cap ends it; the steady one stops at the least rounds
    growing = sequence_timer([2.0**power for power in range(20)])
    medians, rounds = stable_medians({"steady": counted_timer(5.0, calls, "steady"), "growing": growing}, most_rounds=6)
    assert rounds == {"steady": 3, "growing": 6} and calls["steady"] == 3
    assert medians == {"steady": 5.0, "growing": (4.0 + 8.0) / 2}  # the median of 1, 2, 4, ..., 32


def test_figures_compared_with_each_other_are_timed_in_the_same_rounds_until_all_settle():
    calls = {}
    timers = {
        ("float32", "step"): counted_timer(5.0, calls, "float32 step"),
        ("bfloat16", "step"): sequence_timer([2.0**power for power in range(20)]),
        ("float32", "verify"): counted_timer(7.0, calls, "float32 verify"),
    }
    _, rounds = stable_medians(timers, most_rounds=6, compared=lambda key: key[1])
    # the steady step goes on beside its unsettled bfloat16 twin; the verify, compared with no unsettled one, stops
    assert rounds == {("float32", "step"): 6, ("bfloat16", "step"): 6, ("float32", "verify"): 3}
    assert calls == {"float32 step": 6, "float32 verify": 3}


def test_one_round_at_most_is_one_round():
    assert stable_medians({"step": sequence_timer([3.0, 9.0])}, most_rounds=1) == ({"step": 3.0}, {"step": 1})


def test_the_probe_and_the_grid_plan_with_one_figure_for_each_pass_they_share(tmp_path, monkeypatch):
    timed, prefills = [], []
    block_passes = pass_costs.block_passes

    def recorded_block_passes(model, prefix, rows, token_counts):
        prefills.append(rows)
        timed.extend((rows, tokens) for tokens in token_counts)
        return block_passes(model, prefix, rows, token_counts)

    monkeypatch.setattr(pass_costs, "block_passes", recorded_block_passes)
    policy = tiny_target()
    drafter = EagleDrafter(policy, seed=0)
    plan = decode_plan_for(policy, drafter, "auto", "off", tmp_path, rows=6, speculates=True, costs=True)
    record, costs = plan.precision, plan.pass_costs
    dtype = plan.dtype
    assert costs.dtype == dtype and costs.rows == (1, 2, 4)
    grid = {
        (rows, tokens): costs.target_ms[i][j]
        for i, rows in enumerate(costs.rows)
        for j, tokens in enumerate(costs.tokens)
    }
    # the 1-row step the dtype was chosen by is the grid's 1-row plain step, and so for the tail's rungs and the verify
    assert grid[1, 1] == record["step_ms"][dtype]
    assert grid[2, 1] == record["tail_step_ms"]["2"][dtype] and grid[4, 1] == record["tail_step_ms"]["4"][dtype]
    assert grid[4, 4] == record["verify_ms"][dtype]
    # the grid timed none of those passes again
    assert timed and not {(1, 1), (2, 1), (4, 1), (4, 4)} & set(timed)
    assert len(timed) == len(grid) - 4
    # one prefill for each row count, shared by its token counts
    assert sorted(prefills) == list(costs.rows)


def test_a_new_probe_is_a_new_grid(tmp_path):
    policy = tiny_target()
    first = pass_costs.measured_pass_costs(policy, None, torch.float32, None, tmp_path, 2, {(1, 1): 7.0})
    second = pass_costs.measured_pass_costs(policy, None, torch.float32, None, tmp_path, 2, {(1, 1): 9.0})
    assert (first.target_ms[0][0], second.target_ms[0][0]) == (7.0, 9.0)
    assert len(list((tmp_path / pass_costs.CACHE_FOLDER).glob("*.json"))) == 2


@pytest.mark.parametrize("most_rounds", [1, 2])
def test_the_grid_times_each_point_at_most_its_cap(most_rounds, monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "repeats_for", lambda run, device=timing.CPU: 1)

    def counted(run, repeats, device=timing.CPU):
        calls.append(run)
        return 1.0 + len(calls)  # never stable

    monkeypatch.setattr(timing, "milliseconds", counted)
    pass_costs.measure_pass_costs(tiny_target(), None, torch.float32, None, (1,), (1, 2), most_rounds=most_rounds)
    assert len(calls) == 2 * most_rounds
