"""Speculation chosen from measured pass costs and the run's acceptance (`speculative.mode: auto`).

The pass costs (interpolated, checked, measured and cached on a tiny model), the acceptance estimates (by source
and depth, by label), the per-step choice (off where verifying costs too much, deep chains where it is cheap and
drafts are accepted), exploration and collapse warnings, and the engine with the schedule: greedy output
token-identical to plain decoding, sampled output with plain decoding's distribution.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from scipy.stats import chi2_contingency
from test_speculative import TargetAsDrafter, requests_for, tiny_target
from tiny_models import tiny_gpt2

from tlt_cli.drafter.model import EagleDrafter
from tlt_cli.engine.sampling import SamplingParams
from tlt_cli.rollout.generate_loop import EmbeddedEngine
from tlt_cli.speculative.acceptance_estimates import AcceptanceEstimates
from tlt_cli.speculative.collapse import COLLAPSED, RECOVERED, RECOVERY_MARGIN, CollapseWatch
from tlt_cli.speculative.cost_schedule import EXPLORE_SHARE, CostSchedule, candidate_configs
from tlt_cli.speculative.costs import PassCosts, verified_tokens
from tlt_cli.speculative.draft_counts import StepCounts
from tlt_cli.speculative.modes import AdaptiveSpeculativeDecoder
from tlt_cli.speculative.step_overheads import StepOverheads
from tlt_cli.speculative.types import DecodeStep, SpeculativeConfig
from tlt_cli.tuning.pass_costs import CACHE_FOLDER, DRAFTER_ENTRIES, measured_pass_costs

ROWS, TOKENS = (1, 2, 4, 8), (1, 2, 4, 8, 16)


def grid_costs(step_ms: float, per_token_ms: float, per_row_ms: float = 1.0, drafter_ms: float = 0.1) -> PassCosts:
    """Costs of a machine where a pass costs step + per_token x (tokens - 1) x rows + per_row x (rows - 1)."""
    target = tuple(
        tuple(step_ms + per_token_ms * (tokens - 1) * rows + per_row_ms * (rows - 1) for tokens in TOKENS)
        for rows in ROWS
    )
    return PassCosts(ROWS, TOKENS, target, (1, 32), (drafter_ms, drafter_ms * 4))


def test_costs_are_exact_on_the_grid_linear_between_and_never_fall_beyond_it():
    costs = grid_costs(10.0, 2.0)
    assert costs.target_seconds(4, 8) == pytest.approx((10 + 2 * 7 * 4 + 3) / 1e3)
    assert costs.target_seconds(3, 1) == pytest.approx((costs.target_seconds(2, 1) + costs.target_seconds(4, 1)) / 2)
    assert costs.target_seconds(8, 24) > costs.target_seconds(8, 16)  # extrapolated along the last segment
    assert costs.target_seconds(64, 1) >= costs.target_seconds(8, 1)
    plain, chain = costs.step_seconds(None, 2), costs.step_seconds(SpeculativeConfig(4), 2, accept_length=3.0)
    assert plain == costs.target_seconds(2, 1)
    # a chain of 4: the target over 5 tokens, 3 drafting passes and one catch-up of the drafter
    assert chain == pytest.approx(costs.target_seconds(2, 5) + 3 * costs.drafter_seconds(2) + costs.drafter_seconds(6))
    assert verified_tokens(SpeculativeConfig(0, ngram_tokens=4)) == 5
    assert verified_tokens(SpeculativeConfig(2, ngram_tokens=4)) == 7
    assert verified_tokens(SpeculativeConfig(2, ngram_tokens=4, picks_source=True)) == 5
    assert PassCosts.from_dict(costs.to_dict()) == costs


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rows": [2, 1, 4, 8]}, "rows"),
        ({"rows": []}, "rows"),
        ({"target_ms": [[1.0] * 5] * 3}, "grid"),
        ({"drafter_ms": [0.1, float("nan")]}, "finite positive"),
        ({"drafter_ms": [0.1, 0.0]}, "finite positive"),
    ],
)
def test_a_damaged_cost_record_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        PassCosts.from_dict(grid_costs(10.0, 2.0).to_dict() | change)


def test_acceptance_by_depth_predicts_shallower_and_deeper_chains():
    estimates = AcceptanceEstimates()
    ngram4 = SpeculativeConfig(0, ngram_tokens=4)
    for _ in range(200):  # the first two drafted tokens always accepted, the rest never
        estimates.observe(ngram4, (2, 2, 2, 2))
    assert estimates.expected_tokens(ngram4) == pytest.approx(3.0, abs=0.05)
    assert estimates.expected_tokens(SpeculativeConfig(0, ngram_tokens=2)) == pytest.approx(3.0, abs=0.05)
    assert estimates.expected_tokens(SpeculativeConfig(0, ngram_tokens=1)) == pytest.approx(2.0, abs=0.05)
    # the drafter is unmeasured: its prior, the same for every depth ratio
    assert estimates.expected_tokens(SpeculativeConfig(2)) == pytest.approx(1 + 0.5 + 0.25)
    # a hybrid is the better of its chains until measured, then its own average
    hybrid = SpeculativeConfig(2, ngram_tokens=4)
    assert estimates.expected_tokens(hybrid) == pytest.approx(3.0, abs=0.05)
    for _ in range(20):
        estimates.observe(hybrid, (4, 4))
    assert estimates.expected_tokens(hybrid) > 4.0
    restored = AcceptanceEstimates()
    restored.load_state_dict(estimates.state_dict())
    assert restored.expected_tokens(hybrid) == estimates.expected_tokens(hybrid)


def test_a_deeper_chain_continues_the_measured_ratio():
    estimates = AcceptanceEstimates()
    drafter2 = SpeculativeConfig(2)
    for _ in range(400):  # accepted through depth 1 in 80% of passes, through depth 2 in 40%
        estimates.observe(drafter2, (2, 2, 1, 1, 0))
    deeper = estimates.expected_tokens(SpeculativeConfig(4))
    assert deeper == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.1, abs=0.05)


def schedule_after(costs: PassCosts, accepted: int, steps: int = 300, batch_size: int = 1) -> CostSchedule:
    """A schedule that saw `steps` decode steps where every row accepted `accepted` drafted tokens (or as many as
    the configuration's deepest chain holds)."""
    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    for _ in range(steps):
        config = schedule(batch_size)
        emitted = 1 if config is None else 1 + min(accepted, max(config.steps, config.ngram_tokens))
        seconds = costs.step_seconds(config, batch_size, emitted)
        counts = None
        if config is not None:
            passes = {"drafter": batch_size * config.uses_drafter, "ngram": batch_size * config.uses_ngram}
            accepted_by_source = {source: (emitted - 1) * count for source, count in passes.items()}
            counts = StepCounts(passes, accepted_by_source, (emitted - 1,) * batch_size)
        schedule.observe_step(DecodeStep(batch_size, emitted * batch_size, seconds), counts)
    return schedule


def test_where_a_verify_costs_two_steps_and_drafts_fail_plain_decoding_wins():
    costs = grid_costs(10.0, 10.0)  # a 2-token verify costs 2 steps
    schedule = schedule_after(costs, accepted=0)
    usage = schedule.take_usage()
    assert usage["off"].decode_steps > 0.8 * 300
    assert schedule(1) is None


def test_where_a_verify_is_cheap_and_drafts_are_accepted_deep_chains_win_and_every_candidate_was_tried():
    costs = grid_costs(10.0, 0.05)  # verifying 16 tokens costs 1.08 steps: trees are candidates too
    assert any(not config.is_chain for config in candidate_configs(costs, has_drafter=True))
    schedule = schedule_after(costs, accepted=16, steps=1200)
    usage = schedule.take_usage()
    chosen = max(usage, key=lambda label: usage[label].decode_steps)
    assert chosen != "off" and usage[chosen].decode_steps > 0.7 * 1200
    assert verified_tokens(schedule(1)) >= 7
    # exploration kept every candidate measured
    assert {config.label() for config in schedule.candidates} <= set(usage)
    # the prediction it made for what ran is in the usage, beside what was measured
    assert usage[chosen].predicted_seconds > 0 and usage[chosen].batch_sizes == {"1": usage[chosen].decode_steps}
    # seconds and tokens by batch size too (tlt_cli/sd_effect.py compares SD with plain at the same size)
    assert usage[chosen].batch_seconds == {"1": pytest.approx(usage[chosen].seconds)}
    assert usage[chosen].batch_tokens == {"1": usage[chosen].tokens}


def test_larger_batches_make_verifying_cost_more_and_turn_sd_off():
    costs = grid_costs(10.0, 2.0, per_row_ms=0.5)  # verify cost grows with rows x tokens
    schedule = schedule_after(costs, accepted=1, steps=200, batch_size=1)
    assert schedule(1) is not None
    assert schedule.predicted_rate(None, 8) > max(schedule.predicted_rate(config, 8) for config in schedule.candidates)


def test_a_collapsed_source_is_warned_about_once_and_re_probed():
    costs = grid_costs(10.0, 0.2)
    schedule = schedule_after(costs, accepted=8, steps=200)
    assert schedule.take_warnings() == []
    schedule.take_usage()
    schedule_after_collapse = schedule
    for _ in range(400):  # the drafter and the index stop being accepted
        config = schedule_after_collapse(1)
        counts = None
        if config is not None:
            passes = {"drafter": int(config.uses_drafter), "ngram": int(config.uses_ngram)}
            counts = StepCounts(passes, {"drafter": 0, "ngram": 0}, (0,))
        seconds = costs.step_seconds(config, 1)
        schedule_after_collapse.observe_step(DecodeStep(1, 1, seconds), counts)
    warnings = schedule.take_warnings()
    collapsed = [warning for warning in warnings if " drafts collapsed to " in warning]
    # each source that drafted is warned about once (the one the cost model ran most, at least)
    assert 1 <= len(collapsed) == len(set(collapsed)) <= 2 and not any("recovered" in warning for warning in warnings)
    usage = schedule.take_usage()
    # SD is off from then on but for the re-probes, every reprobe_steps decode steps
    speculative_steps = sum(value.decode_steps for label, value in usage.items() if label != "off")
    assert usage["off"].decode_steps > 0 and speculative_steps < 400 // 2
    restored = CostSchedule(schedule.candidates, costs, seed=0)
    restored.load_state_dict(schedule.state_dict())
    assert [restored(1) for _ in range(30)] == [schedule(1) for _ in range(30)]


def test_overheads_learned_from_recorded_steps_predict_them_within_a_fifth_per_configuration_and_rows():
    # steps mode auto ran on the tiny model, each with its passes' predicted seconds and its measured seconds: the
    # passes alone predict a third to a half of a step; passes plus the learned overheads are within 20% per cell
    recorded = json.loads((Path(__file__).parent / "data" / "auto_steps_tiny_cpu.json").read_text())["steps"]
    overheads = StepOverheads()
    cells: dict[tuple[str, int], list[float]] = {}
    for label, family, rows, pass_seconds, measured_seconds in recorded:
        predicted = pass_seconds + overheads.seconds(label, family, rows)
        cell = cells.setdefault((label, rows), [0.0, 0.0, 0.0, 0])
        cell[0], cell[1], cell[2], cell[3] = (
            cell[0] + predicted,
            cell[1] + pass_seconds,
            cell[2] + measured_seconds,
            cell[3] + 1,
        )
        overheads.observe(label, family, rows, pass_seconds, measured_seconds)
    judged = {key: cell for key, cell in cells.items() if cell[3] >= 20}  # cells of 3-15 steps are load noise here
    assert {("off", 1), ("off", 8), ("ngram2", 8), ("off", 16)} == set(judged)
    for (label, rows), (predicted, passes, measured, _) in judged.items():
        assert passes < measured / 1.5, (label, rows)
        assert abs(predicted / measured - 1) < 0.2, (label, rows, predicted / measured)


def test_the_trace_predicts_a_step_with_what_it_costs_beyond_its_passes_at_every_batch_size():
    costs = grid_costs(10.0, 0.5)
    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    for step in range(600):
        batch_size = (8, 4, 2, 1)[step * 4 // 600]  # the batch shrinks as rows finish
        config = schedule(batch_size)
        emitted = 1 if config is None else 1 + min(2, max(config.steps, config.ngram_tokens))
        # the Python around the passes: 3 ms a step and 2 ms a row
        seconds = costs.step_seconds(config, batch_size, emitted) + 0.003 + 0.002 * batch_size
        counts = None
        if config is not None:
            passes = {"drafter": batch_size * config.uses_drafter, "ngram": batch_size * config.uses_ngram}
            counts = StepCounts(
                passes, {source: (emitted - 1) * count for source, count in passes.items()}, (emitted - 1,) * batch_size
            )
        schedule.observe_step(DecodeStep(batch_size, emitted * batch_size, seconds), counts)
    usage = schedule.take_usage()
    often = [label for label, value in usage.items() if value.decode_steps >= 50]
    assert often
    for label in often:
        assert usage[label].predicted_seconds == pytest.approx(usage[label].seconds, rel=0.2), label


def test_plain_steps_reuse_the_prediction_until_an_sd_step_updates_the_acceptance(monkeypatch):
    schedule = schedule_after(grid_costs(10.0, 10.0), accepted=0, steps=100, batch_size=4)
    computed = []
    original = CostSchedule._prediction
    monkeypatch.setattr(
        CostSchedule, "_prediction", lambda self, *arguments: computed.append(1) or original(self, *arguments)
    )
    schedule.steps = 0  # away from a refresh
    choices = []
    for _ in range(10):
        choices.append(schedule(4))
        schedule.observe_step(DecodeStep(4, 4, 0.01))
    assert choices == [None] * 10 and len(computed) <= 1 + len(schedule.candidates)
    ngram2 = SpeculativeConfig(0, ngram_tokens=2)
    schedule._last = (ngram2, 4, 8.0, 0.01, 0.01)  # an SD step ran (the choice exploring)
    schedule.observe_step(
        DecodeStep(4, 8, 0.01), StepCounts({"drafter": 0, "ngram": 4}, {"drafter": 0, "ngram": 4}, (1,) * 4)
    )
    computed.clear()
    schedule(4)
    assert len(computed) == 1 + len(schedule.candidates)


def test_the_drafters_catch_up_on_unread_positions_is_priced_before_it_drafts():
    costs = grid_costs(10.0, 0.2)
    schedule = schedule_after(costs, accepted=8, steps=300)
    schedule.drafter_lag_entries = 0
    assert schedule(1).uses_drafter
    schedule._last = None
    # a prompt of 2,000 positions not yet read: the drafter's catch-up costs more than its drafts gain
    schedule.drafter_lag_entries = 2000
    choice = schedule(1)
    assert choice is None or not choice.uses_drafter


def test_a_flapping_source_is_one_console_line_each_way_per_run_and_every_change_is_in_the_trace():
    ngram4 = SpeculativeConfig(0, ngram_tokens=4)
    costs = grid_costs(10.0, 0.2)
    # reprobe_steps 1: every step runs the one candidate, so the source's figure is fed at every step
    schedule = CostSchedule((ngram4,), costs, collapse_accept_length=1.15, reprobe_steps=1, seed=0)
    warnings, usages = [], []
    for _ in range(10):  # the index's acceptance swings between 1.0 and 2.0 tokens per pass, ten times
        for accepted in (0,) * 12 + (1,) * 12:
            assert schedule(1) == ngram4
            counts = StepCounts({"drafter": 0, "ngram": 1}, {"drafter": 0, "ngram": accepted}, (accepted,))
            schedule.observe_step(DecodeStep(1, 1 + accepted, 0.01), counts)
        warnings += schedule.take_warnings()
        usages.append(schedule.take_usage()[ngram4.label()])
    assert len([warning for warning in warnings if "collapsed to" in warning]) == 1
    assert len([warning for warning in warnings if "recovered to" in warning]) == 1 and len(warnings) == 2
    collapses, recoveries = sum(usage.collapses for usage in usages), sum(usage.recoveries for usage in usages)
    assert collapses == 10 and recoveries == 10  # the trace's sd_config records count every one
    # a resumed run remembers what the console has heard
    restored = CostSchedule((ngram4,), costs, collapse_accept_length=1.15, reprobe_steps=1, seed=0)
    restored.load_state_dict(schedule.state_dict())
    assert restored.watch.shown == schedule.watch.shown == {("ngram", "collapsed"), ("ngram", "recovered")}
    assert restored.watch.healthy == {"ngram"}


def test_a_collapsed_figure_recovers_only_a_margin_above_the_threshold():
    watch = CollapseWatch(threshold=1.15)
    assert watch.change("ngram", collapsed=False, accept_length=1.16) is None
    assert watch.change("ngram", collapsed=False, accept_length=1.14) == COLLAPSED
    assert watch.change("ngram", collapsed=True, accept_length=1.2) is None  # hovering at the threshold
    assert watch.change("ngram", collapsed=True, accept_length=1.15 + RECOVERY_MARGIN) == RECOVERED
    assert watch.change("ngram", collapsed=False, accept_length=1.3) is None  # healthy from here on
    assert watch.is_news("ngram", COLLAPSED) and not watch.is_news("ngram", COLLAPSED)
    assert watch.is_news("ngram", RECOVERED) and not watch.is_news("ngram", RECOVERED)


def test_a_source_that_never_paid_is_kept_off_without_a_console_line_until_it_pays_and_then_collapses():
    # a fresh drafter trained online starts near 1.0 tokens per pass: not news, and no recovery to announce
    watch = CollapseWatch(threshold=1.15)
    assert watch.change("drafter", collapsed=False, accept_length=1.0) == COLLAPSED
    assert not watch.is_news("drafter", COLLAPSED)
    assert watch.change("drafter", collapsed=True, accept_length=1.5) == RECOVERED
    assert not watch.is_news("drafter", RECOVERED)
    # once it has paid, a collapse is news, and so is its recovery
    assert watch.change("drafter", collapsed=False, accept_length=1.05) == COLLAPSED
    assert watch.is_news("drafter", COLLAPSED)
    assert watch.change("drafter", collapsed=True, accept_length=1.4) == RECOVERED
    assert watch.is_news("drafter", RECOVERED)


def auto_engine(target, drafter, eos: int, costs: PassCosts, seed: int = 0) -> tuple[EmbeddedEngine, CostSchedule]:
    schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=seed)
    engine = EmbeddedEngine(target, eos, 0, speculative=AdaptiveSpeculativeDecoder(drafter, schedule))
    return engine, schedule


def test_greedy_decoding_with_the_cost_model_is_token_identical_to_plain():
    target = tiny_target()
    drafter = TargetAsDrafter(target, logit_noise=0.8)
    requests = requests_for(12, seed=4)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0)
    first = EmbeddedEngine(target, eos_token_id=0, pad_token_id=0).generate(requests, sampling, torch.Generator())
    eos = torch.tensor([token for completion in first for token in completion.response_ids]).mode().values.item()
    plain = EmbeddedEngine(target, eos, 0).generate(requests, sampling, torch.Generator().manual_seed(0))
    assert len({len(completion.response_ids) for completion in plain}) > 3
    # verifying is cheap at few rows and dear at many: SD goes on as the batch shrinks
    engine, schedule = auto_engine(target, drafter, eos, grid_costs(10.0, 0.5, per_row_ms=2.0))
    auto = engine.generate(requests, sampling, torch.Generator().manual_seed(0))
    assert [completion.response_ids for completion in auto] == [completion.response_ids for completion in plain]
    usage = schedule.take_usage()
    assert sum(value.decode_steps for label, value in usage.items() if label != "off") > 0


def test_the_decoder_tells_the_cost_model_what_the_drafters_catch_up_would_read(monkeypatch):
    target = tiny_target()
    requests = requests_for(4, seed=4)
    lags = []
    original = CostSchedule.__call__
    monkeypatch.setattr(
        CostSchedule, "__call__", lambda self, rows: lags.append(self.drafter_lag_entries) or original(self, rows)
    )
    engine, _ = auto_engine(target, TargetAsDrafter(target), 10_000, grid_costs(10.0, 0.5))
    engine.generate(requests, SamplingParams(max_new_tokens=6, temperature=0.0), torch.Generator().manual_seed(0))
    # before the first step the drafter has read nothing: every row's prompt, padded to the longest
    assert lags[0] == len(requests) * max(len(request.prompt_ids) for request in requests)


def test_sampled_decoding_with_the_cost_model_has_the_targets_distribution(monkeypatch):
    # the choice must not hang on this machine's timing (the overheads learned from measured step times): the
    # property under test is that whatever the schedule switches between, the samples keep the target's law
    monkeypatch.setattr(StepOverheads, "seconds", lambda self, label, family, rows: 0.0)
    target = tiny_target(initializer_range=0.3)
    drafter = TargetAsDrafter(target, logit_noise=1.0)
    prompt = requests_for(1, seed=7)[0].prompt_ids
    rows = 600
    requests = [type(requests_for(1, seed=7)[0])(index, prompt) for index in range(rows)]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
    plain = EmbeddedEngine(target, 10_000, 0).generate(requests, sampling, torch.Generator().manual_seed(1))
    engine, schedule = auto_engine(
        target, drafter, 10_000, grid_costs(10.0, 0.0001, per_row_ms=0.0, drafter_ms=0.001), seed=2
    )
    auto = engine.generate(requests, sampling, torch.Generator().manual_seed(2))
    assert sum(value.decode_steps for label, value in schedule.take_usage().items() if label != "off") > 0
    for position in (0, 3):  # the first token (the prefill's) and one drafted and verified
        counts = torch.zeros(2, 64)
        for index, completions in enumerate((plain, auto)):
            for completion in completions:
                counts[index, completion.response_ids[position]] += 1
        kept = counts.sum(dim=0) >= 10
        table = torch.cat([counts[:, kept], counts[:, ~kept].sum(dim=1, keepdim=True)], dim=1)
        assert chi2_contingency(table.numpy()).pvalue > 0.01


def test_pass_costs_are_measured_once_on_the_owned_forward_and_cached(tmp_path):
    target = tiny_target()
    costs = measured_pass_costs(target, EagleDrafter(target, seed=0), torch.float32, None, tmp_path, most_rows=5)
    assert costs.rows == (1, 2, 4) and costs.tokens == (1, 2, 4, 8, 16) and costs.drafter_entries == DRAFTER_ENTRIES
    assert all(math.isfinite(value) and value > 0 for row in costs.target_ms for value in (*row, *costs.drafter_ms))
    records = list((tmp_path / CACHE_FOLDER).glob("*.json"))
    assert len(records) == 1
    before = records[0].read_text()
    again = measured_pass_costs(target, EagleDrafter(target, seed=0), torch.float32, None, tmp_path, most_rows=5)
    assert again == costs and records[0].read_text() == before  # read back, not measured again
    # in bfloat16 it is measured apart; a model the owned forward does not decode gets none
    # a damaged record counts as absent: measured again and replaced (the other caches' rule, tuning/cache.py)
    records[0].write_text(before.replace('"target_ms"', '"damaged"'))
    assert measured_pass_costs(target, EagleDrafter(target, seed=0), torch.float32, None, tmp_path, most_rows=5)
    assert '"target_ms"' in records[0].read_text()
    bfloat16 = measured_pass_costs(target, None, torch.bfloat16, None, tmp_path, most_rows=1)
    assert bfloat16.dtype == "bfloat16" and bfloat16.rows == (1,)
    assert measured_pass_costs(tiny_gpt2(64), None, torch.float32, None, tmp_path, most_rows=1) is None


def run_steps(schedule: CostSchedule, costs: PassCosts, steps: int, drafter_accepts: int) -> list[int]:
    """`steps` decode steps at one row where the drafter's chains are accepted up to `drafter_accepts` tokens deep
    and n-gram drafts never; returns the tokens each step emitted."""
    emitted = []
    for _ in range(steps):
        config = schedule(1)
        accepted = min(drafter_accepts, config.steps) if config is not None and config.uses_drafter else 0
        counts = None
        if config is not None:
            passes = {"drafter": int(config.uses_drafter), "ngram": int(config.uses_ngram)}
            counts = StepCounts(passes, {"drafter": accepted, "ngram": 0}, (accepted,))
        schedule.observe_step(DecodeStep(1, 1 + accepted, costs.step_seconds(config, 1, 1 + accepted)), counts)
        emitted.append(1 + accepted)
    return emitted


def test_a_drafter_that_trained_is_exploited_deeper_in_the_next_rollouts_first_steps_once_the_schedule_is_told():
    costs = grid_costs(10.0, 0.5)
    emitted = {}
    for told in (True, False):
        schedule = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
        run_steps(schedule, costs, 600, drafter_accepts=1)  # the drafter so far: one token, never two
        if told:
            schedule.drafter_changed()
        emitted[told] = sum(run_steps(schedule, costs, 80, drafter_accepts=6))  # trained: six tokens deep
    # told, the schedule leaves the old drafter's hundreds of passes behind and drafts deeper at once
    assert emitted[True] > 1.3 * emitted[False]


def test_forgetting_a_source_keeps_its_share_of_the_passes_of_it_and_of_labels_drafting_from_it():
    estimates = AcceptanceEstimates()
    for _ in range(100):
        estimates.observe(SpeculativeConfig(2), (0,))
        estimates.observe(SpeculativeConfig(2, ngram_tokens=4), (1,))
        estimates.observe(SpeculativeConfig(0, ngram_tokens=4), (1,))
    drafter_offered = estimates.by_source["drafter"].offered[0]
    ngram_offered = estimates.by_source["ngram"].offered[0]
    hybrid = SpeculativeConfig(2, ngram_tokens=4).label()
    hybrid_passes = estimates.by_label[hybrid].passes
    estimates.forget("drafter", 0.1)
    assert estimates.by_source["drafter"].offered[0] == pytest.approx(0.1 * drafter_offered)
    assert estimates.by_source["ngram"].offered[0] == ngram_offered
    assert estimates.by_label[hybrid].passes == pytest.approx(0.1 * hybrid_passes)
    restored = AcceptanceEstimates()
    restored.load_state_dict(estimates.state_dict())
    assert restored.label_sources == estimates.label_sources


def test_a_fresh_drafter_is_kept_off_but_for_re_probes_until_it_has_trained():
    costs = grid_costs(10.0, 0.5)
    fresh = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    fresh.drafter_untrained()
    prior_only = CostSchedule(candidate_configs(costs, has_drafter=True), costs, seed=0)
    drafted = {}
    for name, schedule in (("fresh", fresh), ("prior", prior_only)):
        configs = [schedule(1) for _ in range(128)]  # nothing observed: the choice rests on the prior alone
        drafted[name] = sum(config is not None and config.uses_drafter for config in configs)
    # only re-probes and exploration's share try it
    assert drafted["fresh"] <= 128 // fresh.reprobe_steps + 128 * EXPLORE_SHARE < 32 < drafted["prior"]
    assert fresh.take_warnings() == []
    fresh.drafter_changed()
    assert any(config is not None and config.uses_drafter for config in (fresh(1) for _ in range(8)))
