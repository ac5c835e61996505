"""Mode auto never below plain by the run's own figures (tlt_cli/speculative/plain_check.py in cost_schedule.py).

A configuration the run measured slower than plain decoding at a batch size is dropped there (and only there),
tried again after an interval that doubles with each loss at that size up to a cap, and the console hears of it
once; greedy output stays token-identical to plain decoding whatever the check drops.
"""

import pytest
import torch
from test_cost_schedule import grid_costs
from test_speculative import TargetAsDrafter, requests_for, tiny_target

from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.speculative.cost_schedule import CostSchedule, candidate_configs
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder
from tlt_cli.speculative.plain_check import JUDGED_STEPS, MOST_INTERVAL_FACTOR, PlainCheck
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig

torch.set_num_threads(1)

PLAIN_STEP_SECONDS = 0.010


def with_plain_steps(check: PlainCheck, rows=(1, 4), seconds: float = PLAIN_STEP_SECONDS, steps: int = 4) -> PlainCheck:
    """`check` after `steps` plain steps of the run at each of `rows`: `seconds` a step at one row, a millisecond more
    per row."""
    for size in rows:
        for _ in range(steps):
            check.observe("off", size, seconds + 0.001 * (size - 1), size, step=0)
    return check


def judge(check: PlainCheck, label: str, rows: int, seconds: float, tokens: int, step: int) -> list[str | None]:
    """JUDGED_STEPS steps of `label` at `rows` rows, each `seconds` for `tokens` tokens; the messages returned."""
    return [check.observe(label, rows, seconds, tokens, step + index) for index in range(JUDGED_STEPS)]


def test_a_configuration_slower_than_plain_at_some_rows_is_dropped_there_and_kept_elsewhere():
    check = with_plain_steps(PlainCheck(reprobe_steps=64))
    # at one row: 3 tokens in 40 ms against plain's 3 x 10 ms; at four rows: 12 tokens in 20 ms against 3 x 13 ms
    messages = judge(check, "ngram4", 1, 0.040, 3, step=10)
    judge(check, "ngram4", 4, 0.020, 12, step=10)
    assert not check.allows("ngram4", 1, step=14) and check.allows("ngram4", 4, step=14)
    assert check.allows("s2", 1, step=14) and check.allows("off", 1, step=14)
    assert messages[:-1] == [None] * (JUDGED_STEPS - 1)
    assert messages[-1].startswith("SD (ngram4) decoded 1.33x slower than plain decoding at 1 running row by")
    assert "tried again after 64 decode steps" in messages[-1] and check.drops == 1


def test_the_reprobe_interval_doubles_to_its_cap_and_a_win_resets_it():
    check = with_plain_steps(PlainCheck(reprobe_steps=8))
    step, intervals = 0, []
    for _ in range(8):
        judge(check, "ngram4", 1, 0.040, 3, step)
        step += JUDGED_STEPS - 1
        until, interval = check.dropped["ngram4", 1]
        assert (
            until == step + interval and not check.allows("ngram4", 1, until - 1) and check.allows("ngram4", 1, until)
        )
        intervals.append(interval)
        step = until
    assert intervals == [8, 16, 32, 64, 128, 128, 128, 128] and MOST_INTERVAL_FACTOR * 8 == 128
    judge(check, "ngram4", 1, 0.020, 3, step)  # it pays now: kept, and a later loss starts from the first interval
    assert ("ngram4", 1) not in check.dropped
    judge(check, "ngram4", 1, 0.040, 3, step + 10)
    assert check.dropped["ngram4", 1][1] == 8
    # another configuration losing at that size waits longer: the losses there count, not each configuration's
    judge(check, "s2", 1, 0.040, 3, step + 20)
    assert check.dropped["s2", 1][1] == 16
    judge(check, "s2", 4, 0.2, 8, step + 20)  # another size starts from the first interval
    assert check.dropped["s2", 4][1] == 8


def test_the_console_hears_of_the_first_drop_only_and_the_trace_counts_all():
    check = with_plain_steps(PlainCheck(reprobe_steps=64))
    first = judge(check, "ngram4", 1, 0.040, 3, step=0)
    later = judge(check, "s2", 1, 0.040, 3, step=0) + judge(check, "ngram2", 4, 0.2, 8, step=0)
    assert sum(message is not None for message in first + later) == 1 and check.drops == 3


def test_without_a_plain_step_nothing_is_dropped_and_the_state_survives_a_checkpoint():
    check = PlainCheck(reprobe_steps=64)
    assert judge(check, "ngram4", 1, 1.0, 2, step=0) == [None] * JUDGED_STEPS and not check.dropped
    with_plain_steps(check)
    judge(check, "ngram4", 1, 1.0, 2, step=5)
    restored = PlainCheck(reprobe_steps=64)
    restored.load_state_dict(check.state_dict())
    saved = ("plain", "dropped", "losses", "drops")
    assert [getattr(restored, name) for name in saved] == [getattr(check, name) for name in saved]


def run_at(schedule: CostSchedule, rows: int, steps: int, sd_seconds: float, accepted: int, plain_seconds: float):
    """`steps` decode steps at `rows` rows where every SD step takes `sd_seconds` and every row accepts `accepted`
    drafted tokens (as deep as the configuration drafts), and every plain step takes `plain_seconds`. Whether
    each step speculated."""
    speculated = []
    for _ in range(steps):
        config = schedule(rows)
        if config is None:
            schedule.observe_step(DecodeStep(rows, rows, plain_seconds))
            speculated.append(False)
            continue
        emitted = 1 + min(accepted, max(config.steps, config.ngram_tokens))
        passes = {"drafter": rows * config.uses_drafter, "ngram": rows * config.uses_ngram}
        counts = StepCounts(
            passes, {source: (emitted - 1) * count for source, count in passes.items()}, (emitted - 1,) * rows
        )
        schedule.observe_step(DecodeStep(rows, emitted * rows, sd_seconds), counts)
        speculated.append(True)
    return speculated


def test_mode_auto_stops_speculating_where_the_runs_own_steps_say_plain_is_faster():
    costs = grid_costs(10.0, 0.5)
    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    # the run's plain steps at one row took 2 ms (the passes were measured at 10 ms, on a loaded machine)
    with_plain_steps(schedule.plain_check, rows=(1,), seconds=0.002)
    # every SD step at one row takes 12 ms for 2-3 tokens: the cost model, priced from the grid, keeps choosing it
    speculated = run_at(schedule, 1, 1000, sd_seconds=0.012, accepted=2, plain_seconds=0.002)
    assert all(speculated[:JUDGED_STEPS])
    # dropped configuration by configuration, then plain but for re-probes whose gaps grow
    assert sum(speculated[100:]) < 0.05 * 900
    starts = [index for index in range(100, 1000) if speculated[index] and not speculated[index - 1]]
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:])]
    assert len(gaps) >= 2 and gaps == sorted(gaps)
    warnings = schedule.take_warnings()
    assert sum("slower than plain decoding at 1 running row by" in warning for warning in warnings) == 1
    assert schedule.plain_check.drops >= len(schedule.candidates)
    assert sum(usage.plain_drops for usage in schedule.take_usage().values()) == schedule.plain_check.drops
    # at four rows nothing was measured against plain: the cost model still speculates there
    assert any(run_at(schedule, 4, 20, sd_seconds=0.012, accepted=2, plain_seconds=0.003))


def test_greedy_output_stays_token_identical_to_plain_when_the_check_drops_speculation():
    target = tiny_target()
    requests = requests_for(4, seed=4)
    sampling = SamplingParams(max_new_tokens=60, temperature=0.0)
    plain = EmbeddedEngine(target, 10_000, 0).generate(requests, sampling, torch.Generator().manual_seed(0))
    # verifying priced nearly free: the cost model speculates whatever the steps' overheads
    costs = grid_costs(10.0, 0.01, per_row_ms=0.1)
    # one candidate, so every SD step counts towards judging it (with all of auto's, which of them ran four steps at
    # one batch size depended on the steps' measured times: the test was flaky)
    schedule = CostSchedule((SpeculativeConfig(steps=2),), costs, seed=0)
    drafter = TargetAsDrafter(target, logit_noise=0.8)
    engine = EmbeddedEngine(target, 10_000, 0, speculative=AdaptiveSpeculativeDecoder(drafter, schedule))
    # plain steps measured nearly free at every batch size: every SD configuration loses once judged
    with_plain_steps(schedule.plain_check, rows=range(1, 5), seconds=1e-9, steps=100_000)
    auto = engine.generate(requests, sampling, torch.Generator().manual_seed(0))
    assert [completion.response_ids for completion in auto] == [completion.response_ids for completion in plain]
    assert schedule.plain_check.drops > 0
    assert sum(usage.decode_steps for label, usage in schedule.take_usage().items() if label != "off") > 0


@pytest.mark.parametrize("rows", [1, 3])
def test_a_dropped_configuration_is_not_reprobed_before_its_interval(rows):
    costs = grid_costs(10.0, 0.5)
    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, reprobe_steps=8, seed=0)
    with_plain_steps(schedule.plain_check, rows=(rows,), seconds=1e-6)
    run_at(schedule, rows, 200, sd_seconds=0.012, accepted=2, plain_seconds=1e-6)
    steps = schedule.steps
    for (label, size), (until, _) in schedule.plain_check.dropped.items():
        assert size == rows and schedule.plain_check.allows(label, size, until)
        assert until <= steps + MOST_INTERVAL_FACTOR * 8
