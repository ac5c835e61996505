"""SD's measured effect in one sentence, like for like: SD's steps against the run's own plain steps at the same
batch sizes, with its spread over steps; the same function for the run summary and `tlt profile`, which agree on
one run; a run where SD lost says so and names speculative.mode=off."""

import io

import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.test_display import BASE
from tests.test_profile import hand_made_trace, write_jsonl
from tlt_cli.cli import app
from tlt_cli.display import render_summary
from tlt_cli.profile.analysis import analyse
from tlt_cli.profile.records import load_records
from tlt_cli.sd_effect import RowsTiming, measured_sd_effect, sd_effect_sentence, trace_sd_effect


def plain(rows: int, steps: int, seconds: float, step: int = 0) -> RowsTiming:
    return RowsTiming("off", step, rows, steps, seconds, rows * steps)


def speculated(rows: int, steps: int, seconds: float, tokens: int, step: int = 0) -> RowsTiming:
    return RowsTiming("s4-k1-t5", step, rows, steps, seconds, tokens)


def test_sd_is_compared_with_plain_at_the_same_batch_size_not_with_plains_pooled_rate():
    # plain: 10 ms a step at 1 row, 40 ms at 32 rows (most of its steps); SD at 1 row: 2 tokens a 25 ms step.
    # Pooled, plain's step is ~38 ms and SD looks 3x as fast; at 1 row it is 2 x 10 / 25 = 0.8x
    timings = [plain(1, 10, 0.1), plain(32, 400, 16.0), speculated(1, 100, 2.5, 200)]
    effect = measured_sd_effect(timings, accepted_tokens=100, verify_passes=100)
    assert effect.speedup == pytest.approx(0.8)
    sentence = sd_effect_sentence(effect)
    assert sentence.startswith("SD did not pay in this run: its steps decoded 1.25x slower than plain decoding")
    assert sentence.endswith("speculative.mode=off decodes plain.")


def test_plain_between_its_batch_sizes_is_interpolated_and_below_them_taken_at_the_smallest():
    timings = [plain(2, 10, 0.1), plain(6, 10, 0.3), speculated(4, 10, 0.1, 80), speculated(1, 10, 0.1, 20)]
    effect = measured_sd_effect(timings, accepted_tokens=60, verify_passes=40)
    # 4 rows: plain 20 ms a step, 80 tokens = 20 steps = 0.4 s; 1 row: plain at 2 rows' 10 ms, 20 steps = 0.2 s
    assert effect.plain_seconds == pytest.approx(0.6) and effect.sd_seconds == pytest.approx(0.2)
    assert effect.speedup == pytest.approx(3.0)
    # SD saved 0.4 s of 0.6 s decoding: all of it plain would have taken 1.0 s
    assert effect.decode_speedup == pytest.approx(1.0 / 0.6)


def test_the_spread_is_each_steps_effect():
    timings = [
        plain(1, 100, 1.0),
        speculated(1, 10, 0.1, 20, step=0),
        speculated(1, 10, 0.1, 10, step=1),
        plain(1, 1, 0.01, step=1),
    ]
    effect = measured_sd_effect(timings, accepted_tokens=20, verify_passes=20)
    assert effect.step_speedups == pytest.approx((2.0, 1.0))
    assert "1.00x to 2.00x over 2 steps" in sd_effect_sentence(effect)
    one_step = measured_sd_effect(timings[:2], accepted_tokens=10, verify_passes=10)
    assert "one step: no spread" in sd_effect_sentence(one_step)


def test_without_both_kinds_of_steps_there_is_nothing_to_compare():
    assert measured_sd_effect([speculated(1, 100, 2.0, 300)], 120, 60) is None
    assert measured_sd_effect([plain(1, 100, 2.0)], 0, 0) is None
    assert "not measured" in sd_effect_sentence(None)


def test_the_run_summary_and_tlt_profile_say_the_same_of_one_run(tmp_path):
    records = hand_made_trace()
    write_jsonl(tmp_path / "trace.jsonl", records)
    profiled = analyse(load_records(tmp_path)).sd_effect
    summarised = sd_effect_sentence(trace_sd_effect(records))
    assert profiled == summarised and summarised.startswith("SD paid in this run: its steps decoded 1.50x")
    output = io.StringIO()
    render_summary(Console(file=output, width=100), [BASE], tmp_path, sd_effect=summarised)
    assert " ".join(output.getvalue().split()).endswith(" ".join(summarised.split()))
    profile = CliRunner().invoke(app, ["profile", str(tmp_path)])
    assert profile.exit_code == 0, profile.output
    assert " ".join(summarised.split()) in " ".join(profile.output.split())


def test_a_trace_without_timing_by_batch_size_says_it_is_not_measured():
    records = hand_made_trace()
    for record in records:
        if record["type"] == "sd_config":
            del record["batch_seconds"]
    assert "not measured" in sd_effect_sentence(trace_sd_effect(records))


def test_tlt_rollouts_end_line_tallies_every_rollout_and_gives_the_same_verdict():
    from tlt_cli.integrations.trl_summary import RolloutTally

    tally = RolloutTally()
    plain_usage = {"batch_sizes": {"4": 400}, "batch_seconds": {"4": 4.0}, "batch_tokens": {"4": 1600}}
    sd_usage = {"batch_sizes": {"1": 100}, "batch_seconds": {"1": 2.0}, "batch_tokens": {"1": 300}}
    tally.add(0, 0, 1, {"off": plain_usage}, (0, 0))
    tally.add(1, 0, 1, {"off": plain_usage, "s4-k1-t5": sd_usage}, (200, 100))
    line = tally.line()
    assert line.startswith("done: 2 rollouts, 10.0 s decoding, SD in 20% of it; SD paid in this run: its steps")
    assert "1.50x" in line
    assert RolloutTally().line() == "done: 0 rollouts, 0.0 s decoding; SD did not run."
