"""The adaptive schedule: rule-table validation, per-step choice, bandit, collapse auto-off, lossless switching."""

import pytest
import torch
from test_speculative import TargetAsDrafter, requests_for, tiny_target

from tlt_cli.config import DEFAULT_RULES, RecipeError, SpeculativeMode, SpeculativeSection
from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.recipe_checks import checked_speculative_plan
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder
from tlt_cli.speculative.plan import SpeculationMode
from tlt_cli.speculative.rule_schedule import COLLAPSE_MIN_STEPS, AdaptiveSchedule
from tlt_cli.speculative.rules import RuleTableError, build_rules, parse_label
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.setup import speculative_plan

TABLE = [
    {"batch": [9, None], "use": "off"},
    {"batch": [1, 8], "accept": [0.0, 2.0], "use": "off"},
    {"batch": [3, 8], "accept": [2.0, None], "use": "s2-k1"},
    {"batch": [1, 2], "accept": [2.0, None], "use": "s3-k2-t6"},
]


def test_labels_parse_both_ways():
    assert parse_label("off") is None
    assert parse_label("s4-k1-t5") == SpeculativeConfig(4, 1, 5)
    assert parse_label("s8-k4-t16").label() == "s8-k4-t16"
    with pytest.raises(RuleTableError, match="not an SD configuration"):
        parse_label("fast")


@pytest.mark.parametrize(
    "table, message",
    [
        ([{"batch": [1, 4], "use": "s2"}], "no rule covers batch size 5"),
        ([{"batch": [1, None], "use": "off"}, {"batch": [4, 8], "use": "s2"}], "rule 2 overlaps"),
        ([{"batch": [1, None], "accept": [0.0, 2.0], "use": "off"}], "accept length >= 2.0"),
        ([{"batch": [1, None], "accept": [1.0, None], "use": "off"}], "gap before rule 1"),
        ([{"batch": [5, 2], "use": "off"}], "rule 1: batch range"),
        ([{"batch": [1, None], "use": "s0-k1"}], None),
        ([], "empty"),
    ],
)
def test_bad_tables_name_the_rule(table, message):
    if message is None:  # s0 parses; the engine's own check refuses it when the recipe is validated
        build_rules(table)
        return
    with pytest.raises(RuleTableError, match=message):
        build_rules(table)
    if not table:  # a recipe without a table has none: mode auto's cost model chooses, mode adaptive uses tlt's own
        assert speculative_plan(SpeculativeSection(rules=table)).mode == SpeculationMode.auto
        adaptive = speculative_plan(SpeculativeSection(mode=SpeculativeMode.adaptive, rules=table))
        assert len(adaptive.rules) == len(DEFAULT_RULES)
        return
    # every route reads the table through the one plan setup.py makes: an error naming the key and the rule, which
    # the recipe checks refuse the recipe with
    with pytest.raises(RuleTableError, match=f"^speculative.rules: .*{message}"):
        speculative_plan(SpeculativeSection(rules=table))
    with pytest.raises(RecipeError, match=f"^speculative.rules: .*{message}"):
        checked_speculative_plan(SpeculativeSection(rules=table))


def test_choice_follows_batch_size_then_measured_acceptance():
    schedule = AdaptiveSchedule(build_rules(TABLE), collapse_accept_length=1.3)
    assert schedule(32) is None
    assert schedule(5) == SpeculativeConfig(2)  # unmeasured: optimistic
    schedule.observe(emitted_tokens=5 * 3, verify_passes=5, seconds=0.01)  # accept length 3
    assert schedule(4) == SpeculativeConfig(2)
    for _ in range(5):  # acceptance drops to 1.5: the low-acceptance rule turns SD off
        schedule(4)
        schedule.observe(emitted_tokens=4 * 1.5, verify_passes=4, seconds=0.01)
    assert schedule(4) is None
    assert schedule(1) == SpeculativeConfig(3, 2, 6)  # another bucket keeps its own measurement


def test_collapse_turns_sd_off_warns_once_and_reprobes():
    table = [{"batch": [1, None], "use": "s4-k1"}]
    schedule = AdaptiveSchedule(build_rules(table), collapse_accept_length=1.3, reprobe_steps=10)
    warnings = []
    for _ in range(COLLAPSE_MIN_STEPS):
        assert schedule(2) == SpeculativeConfig(4)  # SD until the bucket is measured enough
        schedule.observe(emitted_tokens=2, verify_passes=2, seconds=0.01)  # accept length 1.0
        warnings.append(schedule.take_warnings())
    assert warnings[:-1] == [[]] * (COLLAPSE_MIN_STEPS - 1)  # one bad step is not yet a collapse
    assert len(warnings[-1]) == 1 and "collapsed to 1.00" in warnings[-1][0]
    choices = []
    for _ in range(10):
        choices.append(schedule(2))
        schedule.observe(emitted_tokens=2, verify_passes=2 if choices[-1] else 0, seconds=0.01)
    assert choices[:9] == [None] * 9 and choices[9] == SpeculativeConfig(4)  # one probe after 10 off steps
    assert schedule.take_warnings() == []  # still collapsed: no repeated warning
    # a good probe brings it back
    for _ in range(20):
        config = schedule(2)
        schedule.observe(emitted_tokens=10 if config else 2, verify_passes=2 if config else 0, seconds=0.01)
    assert schedule(2) == SpeculativeConfig(4)
    assert "recovered" in schedule.take_warnings()[0]


def test_a_flapping_bucket_is_one_console_line_each_way_per_run_and_every_change_is_in_the_trace():
    table = [{"batch": [1, None], "use": "s4-k1"}]
    schedule = AdaptiveSchedule(build_rules(table), collapse_accept_length=1.3, reprobe_steps=1)
    warnings, usages = [], []
    for _ in range(8):  # acceptance swings between 1.0 and 3.0 tokens per pass
        for emitted in (2,) * 8 + (6,) * 8:
            config = schedule(2)
            schedule.observe(emitted_tokens=emitted if config else 2, verify_passes=2 if config else 0, seconds=0.01)
        warnings += schedule.take_warnings()
        usages.append(schedule.take_usage()["s4-k1-t5"])
    assert [("collapsed" in warning, "recovered" in warning) for warning in warnings] == [(True, False), (False, True)]
    collapses, recoveries = sum(usage.collapses for usage in usages), sum(usage.recoveries for usage in usages)
    assert collapses == 8 and recoveries == 8


def test_bandit_moves_to_the_candidate_with_more_tokens_per_second_and_its_state_round_trips():
    table = [{"batch": [1, None], "use": "s2-k1", "candidates": ["s6-k1", "off"]}]
    schedule = AdaptiveSchedule(build_rules(table), epsilon=0.1, seed=0)
    speed = {"s2-k1-t3": 300.0, "s6-k1-t7": 500.0, "off": 200.0}
    for _ in range(300):
        config = schedule(1)
        label = "off" if config is None else config.label()
        schedule.observe(emitted_tokens=int(speed[label] / 100), verify_passes=1 if config else 0, seconds=0.01)
    usage = schedule.take_usage()
    assert max(usage, key=lambda label: usage[label].decode_steps) == "s6-k1-t7"
    restored = AdaptiveSchedule(build_rules(table), epsilon=0.1, seed=5)
    restored.load_state_dict(schedule.state_dict())
    assert [restored(1) for _ in range(20)] == [schedule(1) for _ in range(20)]


@pytest.mark.parametrize("drafter_kind", ["exact", "random"])
def test_switching_configurations_mid_rollout_is_lossless(drafter_kind):
    target = tiny_target()
    drafter = TargetAsDrafter(target) if drafter_kind == "exact" else EagleDrafter(target, seed=3)
    requests = requests_for(12, seed=4)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
    # take a token the model emits often as EOS, so requests finish at different times and the batch shrinks
    first = EmbeddedEngine(target, eos_token_id=0, pad_token_id=0).generate(requests, sampling, torch.Generator())
    eos = torch.tensor([token for completion in first for token in completion.response_ids]).mode().values.item()
    plain = EmbeddedEngine(target, eos_token_id=eos, pad_token_id=0).generate(
        requests, sampling, torch.Generator().manual_seed(0)
    )
    assert len({len(completion.response_ids) for completion in plain}) > 3
    schedule = AdaptiveSchedule(build_rules(TABLE))
    adaptive_engine = EmbeddedEngine(
        target, eos_token_id=eos, pad_token_id=0, speculative=AdaptiveSpeculativeDecoder(drafter, schedule)
    )
    adaptive = adaptive_engine.generate(requests, sampling, torch.Generator().manual_seed(0))
    assert [completion.response_ids for completion in adaptive] == [completion.response_ids for completion in plain]
    usage = schedule.take_usage()
    assert usage["off"].decode_steps > 0 and sum(usage[label].decode_steps for label in usage if label != "off") > 0
    # each configuration's steps by the batch size they ran at, adding up to its totals (tlt_cli/sd_effect.py)
    for label, value in usage.items():
        assert sum(value.batch_sizes.values()) == value.decode_steps, label
        assert sum(value.batch_seconds.values()) == pytest.approx(value.seconds), label
        assert sum(value.batch_tokens.values()) == value.tokens, label


def test_schedule_state_from_before_measured_steps_loads():
    table = [{"batch": [1, None], "use": "s4-k1"}]
    schedule = AdaptiveSchedule(build_rules(table))
    older = {"states": [(1.1, True, 3, {"s4-k1-t5": [120.0]})], "random": schedule.random.getstate()}
    schedule.load_state_dict(older)
    state = schedule.states[0]
    assert state.collapsed and state.steps_since_probe == 3 and state.measured_steps == COLLAPSE_MIN_STEPS
