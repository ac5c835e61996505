"""SD's measured effect in one sentence: the same function for the run summary and `tlt profile`, which agree on
one run; a run where SD lost says so and names speculative.mode=off."""

import io

from rich.console import Console
from typer.testing import CliRunner

from tests.test_display import BASE
from tests.test_profile import hand_made_trace, write_jsonl
from tlt_cli.cli import app
from tlt_cli.display import render_summary
from tlt_cli.profile.analysis import analyse
from tlt_cli.profile.records import load_records
from tlt_cli.sd_effect import measured_sd_effect, sd_effect_sentence, trace_sd_effect


def test_sd_that_paid_is_a_speedup_over_the_runs_own_plain_steps():
    # accept length (120 + 60) / 60 = 3 tokens per 20 ms SD step against one per 10 ms plain step: 1.5x
    effect = measured_sd_effect([("off", 4.0, 400), ("s4-k1-t5", 2.0, 100), ("s2-k1-t3", 1.0, 0)], 120, 60)
    assert effect.accept_length == 3.0 and effect.speedup == 1.5
    sentence = sd_effect_sentence(effect)
    assert sentence.startswith("SD paid in this run: it decoded 1.50x as fast as plain decoding")
    assert "speculative.mode=off" not in sentence


def test_sd_that_lost_says_so_and_names_the_setting():
    # accept length 1.2 per 30 ms SD step against one per 10 ms plain step: 0.4x, a 2.5x slowdown
    sentence = sd_effect_sentence(measured_sd_effect([("off", 1.0, 100), ("s4-k1-t5", 3.0, 100)], 20, 100))
    assert sentence.startswith("SD did not pay in this run: it decoded 2.50x slower than plain decoding")
    assert sentence.endswith("speculative.mode=off decodes plain.")


def test_without_both_kinds_of_steps_there_is_nothing_to_compare():
    assert measured_sd_effect([("s4-k1-t5", 2.0, 100)], 120, 60) is None
    assert measured_sd_effect([("off", 2.0, 100)], 0, 0) is None
    assert "not measured" in sd_effect_sentence(None)


def test_the_run_summary_and_tlt_profile_say_the_same_of_one_run(tmp_path):
    records = hand_made_trace()
    write_jsonl(tmp_path / "trace.jsonl", records)
    profiled = analyse(load_records(tmp_path)).sd_effect
    summarised = sd_effect_sentence(trace_sd_effect(records))
    assert profiled == summarised and summarised.startswith("SD paid in this run: it decoded 1.50x")
    output = io.StringIO()
    render_summary(Console(file=output, width=100), [BASE], tmp_path, sd_effect=summarised)
    assert " ".join(output.getvalue().split()).endswith(" ".join(summarised.split()))
    profile = CliRunner().invoke(app, ["profile", str(tmp_path)])
    assert profile.exit_code == 0, profile.output
    assert " ".join(summarised.split()) in " ".join(profile.output.split())
