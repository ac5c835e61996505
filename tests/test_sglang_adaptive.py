"""The rule table mapped onto stock SGLang: off / adaptive slots / one static configuration."""

from __future__ import annotations

import json

import pytest

from tlt_cli.sglang.adaptive import BatchRule, captured_decode_batch_sizes, plan_for_sglang, write_adaptive_config
from tlt_cli.sglang.version import SGLangVersionError, parse_version, sglang_features
from tlt_cli.speculative.types import SpeculativeConfig

NEW = sglang_features("0.5.23")
# the reference TLT table (docs/design.md): off above 32, tree SD below with 8 steps, top-k 4
REFERENCE_TREE_TABLE = [
    BatchRule(1, 1, SpeculativeConfig(8, 4, 48)),
    BatchRule(2, 4, SpeculativeConfig(8, 4, 32)),
    BatchRule(5, 20, SpeculativeConfig(8, 4, 16)),
    BatchRule(21, 32, SpeculativeConfig(8, 4, 8)),
    BatchRule(33, None, None),
]
CHAIN_TABLE = [
    BatchRule(1, 1, SpeculativeConfig(7)),
    BatchRule(2, 4, SpeculativeConfig(5)),
    BatchRule(5, 20, SpeculativeConfig(3)),
    BatchRule(21, 32, SpeculativeConfig(1)),
    BatchRule(33, None, None),
]


def intended_steps(rules: list[BatchRule], batch_size: int) -> int:
    rule = next(rule for rule in rules if rule.covers(batch_size))
    return 0 if rule.speculative is None else rule.speculative.steps


def test_chain_table_becomes_adaptive_slots_with_auto_off():
    plan = plan_for_sglang(CHAIN_TABLE, NEW, auto_off_on_collapse=True)
    assert plan.mode == "adaptive"
    assert plan.launch == SpeculativeConfig(7, 1, 8)
    assert plan.adaptive_config() == {
        "1": {"candidate_steps": [0, 7]},
        "2": {"candidate_steps": [0, 5]},
        "5": {"candidate_steps": [0, 3]},
        "21": {"candidate_steps": [0, 1]},
        "33": {"candidate_steps": [0]},
    }
    assert any("re-probes later" in line for line in plan.differences)


def test_without_auto_off_each_slot_has_only_its_depth():
    plan = plan_for_sglang(CHAIN_TABLE, NEW, auto_off_on_collapse=False)
    assert [steps for _, steps in plan.slots] == [(7,), (5,), (3,), (1,), (0,)]


def test_tree_table_falls_back_to_the_tail_configuration_and_says_so(tmp_path):
    plan = plan_for_sglang(REFERENCE_TREE_TABLE, NEW)
    assert plan.mode == "static"
    assert plan.launch == SpeculativeConfig(8, 4, 48)
    assert plan.slots == ()
    assert "tree (topk > 1)" in plan.differences[0]
    assert "batch 33 -> off" in plan.differences[1]
    with pytest.raises(ValueError, match="only an adaptive plan"):
        write_adaptive_config(plan, tmp_path / "slots.json")


def test_static_batch_size_picks_another_rule():
    plan = plan_for_sglang(REFERENCE_TREE_TABLE, NEW, static_batch_size=25)
    assert plan.launch == SpeculativeConfig(8, 4, 8)


def test_old_sglang_without_slots_runs_one_chain():
    plan = plan_for_sglang(CHAIN_TABLE, sglang_features("0.5.12"))
    assert plan.mode == "static"
    assert plan.launch == SpeculativeConfig(7, 1, 8)
    assert "0.5.16" in plan.differences[0]


def test_all_off_table_is_off():
    plan = plan_for_sglang([BatchRule(1, None, None)], NEW)
    assert plan.mode == "off" and plan.launch is None


def test_uncaptured_range_ends_are_reported():
    rules = [BatchRule(1, 9, SpeculativeConfig(3)), BatchRule(10, None, None)]
    plan = plan_for_sglang(rules, NEW)
    assert any("range ends [9]" in line for line in plan.differences)
    assert not any("range ends" in line for line in plan_for_sglang(CHAIN_TABLE, NEW).differences)


def test_adaptive_file_is_written_as_json(tmp_path):
    path = write_adaptive_config(plan_for_sglang(CHAIN_TABLE, NEW), tmp_path / "sglang" / "slots.json")
    assert json.loads(path.read_text())["33"] == {"candidate_steps": [0]}


def test_captured_sizes_follow_sglang_spec_list():
    sizes = captured_decode_batch_sizes(80)
    assert sizes[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12]
    assert sizes[-4:] == [60, 64, 72, 80]
    assert captured_decode_batch_sizes(50)[-1] == 50


def test_versions_and_features():
    assert parse_version("0.5.15.post1") == (0, 5, 15)
    assert sglang_features("0.5.23").drafter_sync and sglang_features("0.5.21").weight_selector
    old = sglang_features("0.5.20")
    assert not old.drafter_sync and old.target_only_tensor_update and old.adaptive_slots
    assert "drafter fixed at launch" in old.describe()
    with pytest.raises(SGLangVersionError, match="older than 0.5.10"):
        sglang_features("0.4.10")
    with pytest.raises(SGLangVersionError, match="not an SGLang release"):
        parse_version("main")


@pytest.mark.parametrize("batch_size", [1, 2, 4, 5, 20, 21, 32, 33, 500])
def test_slots_are_keyed_by_each_rule_start(batch_size):
    plan = plan_for_sglang(CHAIN_TABLE, NEW, auto_off_on_collapse=False)
    # SGLang routes a batch to the slot with the largest key <= batch size
    key = max(min_batch for min_batch, _ in plan.slots if min_batch <= batch_size)
    steps = dict(plan.slots)[key]
    assert steps == (intended_steps(CHAIN_TABLE, batch_size),)
