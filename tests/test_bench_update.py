"""`tlt bench update`: one smoke run through the CLI on a tiny model pair the test builds (exit code, the table, the
progress lines of a log, the JSON's fields, never a timing value), the variants' parsing and order, the summary on
made-up measurements, and bad input refused in one sentence with exit 2 before anything runs."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path

import pytest
from rich.console import Console
from tiny_models import save_tiny_pair
from typer.testing import CliRunner

from tlt_cli.bench import update as bench_update
from tlt_cli.bench.common import BenchError, Progress
from tlt_cli.bench.update import parse_variants, schedule, summarize
from tlt_cli.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_pair_recipe(tmp_path_factory) -> Path:
    """A recipe over a tiny random model folder and a random drafter folder (no warm-up), short responses."""
    folder = tmp_path_factory.mktemp("pair")
    save_tiny_pair(folder)
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        f"# tlt train {recipe}\nrun: {{name: probe, output_dir: {folder}}}\nmodel: {{path: {folder / 'model'}}}\n"
        "train: {prompts_per_step: 2, group_size: 2}\nworkers: {count: 1}\n"
        "rollout: {max_new_tokens: 8, temperature: 1.0, dtype: float32, linear_forms: off}\n"
        "actor: {precision: fp32, micro_batch_size: 2}\n"
        f"speculative: {{mode: off}}\ndrafter: {{init: {folder / 'drafter'}}}\nplugins: {{enabled: []}}\n"
    )
    return recipe


def test_update_measures_each_variant_in_its_own_process_with_its_profile_and_steps(tiny_pair_recipe, tmp_path):
    out = tmp_path / "update.json"
    arguments = ["--variant", "short:rollout.max_new_tokens=4", "--repeats", "1", "--profile", "--steps", "1"]
    result = runner.invoke(app, ["bench", "update", "--recipe", str(tiny_pair_recipe), *arguments, "--out", str(out)])
    assert result.exit_code == 0, result.output
    # a log (CliRunner is no terminal) gets each measurement as it starts and ends; the CPU and the load are named
    for text in ("CPU: ", "bfloat16 flags", "load average", "[1/1] short, repeat 1: started", "[1/1] short, repeat"):
        assert text in result.output, text
    for text in ("worst-case batch", "by operator category", "roofline by phase", "step after step"):
        assert text in result.output, text
    written = json.loads(out.read_text())
    assert {"processor", "cpu_flags", "load_average_start", "load_average_end"} <= set(written["machine"])
    (run,) = written["results"]["runs"]
    # 2 prompts x group 2, every response max_new_tokens (4) long
    assert run["variant"] == "short" and run["sequences"] == 4 and run["response_tokens"] == 16
    assert run["precision"] == "fp32" and run["update_peak_gb"] > 0 and run["estimate_gb"] > 0
    assert 0 < run["roofline"]["fraction_of_product_rate"] and run["roofline"]["operations"] > 0
    assert set(run["profile"]["phases_seconds"]) >= {"forward", "backward", "optimizer"}
    (step,) = run["steps"]
    assert 1 <= step["longest_response"] <= 4 and step["update_peak_gb"] > 0
    figures = written["summary"]["variants"]["short"]
    assert figures["response_tokens"] == 16 and figures["seconds_per_1000_tokens"] > 0
    # the steps' rollout ran in a run folder of its own, removed with them
    assert not list(Path(tempfile.gettempdir()).glob("tlt-bench-update-*"))


def test_variants_split_at_the_commas_before_a_key_and_follow_the_shared_overrides():
    variants = parse_variants(
        ("off:actor.shared_prompt=false,actor.micro_batch_tokens=0", "on:plugins.enabled=[a,b],actor.ppo_epochs=2"),
        ["rollout.max_new_tokens=64"],
    )
    assert variants == {
        "off": ["rollout.max_new_tokens=64", "actor.shared_prompt=false", "actor.micro_batch_tokens=0"],
        "on": ["rollout.max_new_tokens=64", "plugins.enabled=[a,b]", "actor.ppo_epochs=2"],
    }
    assert parse_variants((), ["a.b=1"]) == {"recipe": ["a.b=1"]}


@pytest.mark.parametrize("text", ["no-colon", ":actor.precision=bf16", "on:actor.precision", "on:=1"])
def test_a_bad_variant_is_a_bench_error_naming_the_option(text):
    with pytest.raises(BenchError, match="--variant is"):
        parse_variants((text,), [])


def test_a_variant_named_twice_is_refused():
    with pytest.raises(BenchError, match="--variant is 'on:a.b=2'"):
        parse_variants(("on:a.b=1", "on:a.b=2"), [])


def test_the_order_alternates_every_repeat():
    assert schedule(["off", "on"], 3) == [(0, "off"), (0, "on"), (1, "on"), (1, "off"), (2, "off"), (2, "on")]


def made_up_run(variant: str, seconds: float, peak: float, steps: list[dict] | None = None) -> dict:
    run = {
        "variant": variant,
        "precision": "fp32",
        "update_seconds": seconds,
        "update_cpu_seconds": seconds * 2,
        "response_tokens": 500,
        "roofline": {"fraction_of_product_rate": 0.25},
        "update_peak_gb": peak,
        "estimate_gb": 3.0,
        "loss": 0.1,
    }
    return run | ({"steps": steps} if steps is not None else {})


def test_the_summary_takes_each_variants_fastest_repeat_and_highest_peak():
    steps = [{"rollout_peak_gb": 2.5, "update_peak_gb": 1.0}, {"rollout_peak_gb": 1.0, "update_peak_gb": 2.0}]
    runs = [made_up_run("off", 4.0, 1.0), made_up_run("off", 5.0, 1.5), made_up_run("on", 2.0, 1.2, steps)]
    summary = summarize(runs, ["off", "on"])
    off, on = summary["variants"]["off"], summary["variants"]["on"]
    assert off["update_seconds"] == 4.0 and off["update_peak_gb"] == 1.5 and off["step_peak_gb"] is None
    assert off["seconds_per_1000_tokens"] == pytest.approx(8.0) and off["update_cpu_seconds"] == 8.0
    assert on["step_peak_gb"] == 2.5 and summary["speed_against_first"] == {"on": pytest.approx(2.0)}


def test_progress_prints_each_measurement_and_what_is_left_only_in_a_log():
    log = io.StringIO()
    progress = Progress(Console(file=log, force_terminal=False, width=200), 2)
    for name in ("a", "b"):
        with progress.measuring(name):
            pass
    lines = log.getvalue().splitlines()
    assert lines[0] == "[1/2] a: started; 2 to go, an estimate once the first ends"
    assert lines[1].startswith("[1/2] a: ended in ") and lines[1].endswith("s left")
    assert lines[3].startswith("[2/2] b: ended in ") and "to go" not in lines[3]
    terminal = io.StringIO()
    with Progress(Console(file=terminal, force_terminal=True), 1).measuring("a"):
        pass
    assert terminal.getvalue() == ""


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--variant", "bogus"], "--variant is 'bogus'"),
        (["--repeats", "0"], "--repeats is 0"),
        (["--steps", "-1"], "--steps is -1"),
        (["--variant", "on:actor.nope=1"], "actor.nope"),
        (["--repeats", "1000000000"], "--repeats is 1000000000; give 1..100 repeats of each variant."),
        (["--out", "{tmp}"], "is a folder; give the JSON file to write"),
        (["--out", "{tmp}/a_file/out.json"], "a_file, which is a file; give a file in a folder."),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(tiny_pair_recipe, tmp_path, monkeypatch, arguments, message):
    def no_measuring(*_):
        raise AssertionError("a measurement ran before the options were checked")

    monkeypatch.setattr(bench_update, "measure_in_fresh_process", no_measuring)
    (tmp_path / "a_file").write_text("")
    given = [argument.replace("{tmp}", str(tmp_path)) for argument in arguments]
    # a later --out wins: the one of the case, where it gives one
    command = ["bench", "update", "--recipe", str(tiny_pair_recipe), "--out", str(tmp_path / "out.json"), *given]
    result = runner.invoke(app, command)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert not (tmp_path / "out.json").exists()
