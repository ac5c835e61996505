"""`tlt bench`: each subcommand at a tiny size through the CLI on a tiny model pair the test builds (exit code, the
table, the JSON's fields, never a timing value), the runs' arithmetic on made-up step records, and bad input
refused in one sentence with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console
from tiny_models import save_tiny_pair
from typer.testing import CliRunner

from tlt_cli.bench import costs as bench_costs
from tlt_cli.bench import rollout as bench_rollout
from tlt_cli.bench import runs as bench_runs
from tlt_cli.bench.common import load_lines, speed_words
from tlt_cli.bench.rollout import MIN_TIMED_SECONDS, verdict
from tlt_cli.bench.runs import amdahl_bound, comparison_line, render, reward_gap, side_by_side, summarize
from tlt_cli.cli import app
from tlt_cli.trace import numbered_records

runner = CliRunner()
MACHINE_FIELDS = {
    "processor",
    "torch_cpu_capability",
    "cpu_flags",
    "cores",
    "threads",
    "torch",
    "load_average_start",
    "load_average_end",
}


@pytest.fixture(scope="module")
def tiny_pair_recipe(tmp_path_factory) -> Path:
    """A recipe over a tiny random model folder and a random drafter folder (no warm-up), greedy, short."""
    folder = tmp_path_factory.mktemp("pair")
    save_tiny_pair(folder)
    recipe = folder / "recipe.yaml"
    recipe.write_text(
        f"# tlt train {recipe}\nrun: {{name: probe, output_dir: {folder}}}\nmodel: {{path: {folder / 'model'}}}\n"
        "train: {prompts_per_step: 2, group_size: 2}\nworkers: {count: 1}\n"
        "rollout: {max_new_tokens: 12, temperature: 0.0}\n"
        f"speculative: {{mode: off}}\ndrafter: {{init: {folder / 'drafter'}}}\n"
    )
    return recipe


def test_bench_help_lists_its_subcommands():
    result = runner.invoke(app, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for name in ("rollout", "costs", "update", "runs"):
        assert name in result.output


def test_rollout_compares_auto_plain_and_fixed_shapes_per_batch_size(tiny_pair_recipe, tmp_path):
    out = tmp_path / "rollout.json"
    arguments = [
        "--batch-sizes",
        "1,2",
        "--dtypes",
        "float32",
        "--fixed",
        "s2-k1-t3,ngram2",
        "--repeats",
        "2",
        "--generate",
    ]
    arguments += ["--out", str(out)]
    result = runner.invoke(app, ["bench", "rollout", "--recipe", str(tiny_pair_recipe), *arguments])
    assert result.exit_code == 0, result.output
    # cells of 12-token responses are too short to time: no verdict, said so; the load is printed
    texts = ("whole rollouts", "plain", "auto", "s2-k1-t3", "ngram2", "float32 B=1", "float32 B=2", "too short to time")
    texts += ("load average",)
    for text in texts:
        assert text in result.output, text
    written = json.loads(out.read_text())
    assert MACHINE_FIELDS <= set(written["machine"]) and "avx512_bf16" in written["machine"]["cpu_flags"]
    assert written["repeats"] == 2 and written["seeds"] == [0, 1] and written["recipe"] == str(tiny_pair_recipe)
    assert written["settings"]["batch_sizes"] == "1,2" and written["settings"]["generate"] is True
    # the decode plan setup made for each cell, pass costs included (mode auto chooses with them)
    assert set(written["decode_plans"]) == {"float32 B=1", "float32 B=2"}
    assert all(plan["pass_costs"] is not None for plan in written["decode_plans"].values())
    for key, rows in (("float32 B=1", 1), ("float32 B=2", 2)):
        cell = written["summary"][key]
        assert set(cell) == {"plain", "auto", "s2-k1-t3", "ngram2", "generate"}
        assert cell["plain"]["vs_plain"] == 1.0
        for figures in cell.values():
            # greedy: every variant's responses are compared with plain's, row for row (lossless SD)
            assert figures["rows"] == 2 * rows and figures["identical_rows"] == figures["rows"]
            # transformers' generate decodes the same tokens as the engine (a float32 tie at most)
            assert figures["identity"] == "yes" or (figures is cell["generate"] and figures["identity"] == "tie")
            assert 1 <= figures["response_tokens"] <= rows * 12 and figures["decode_steps"] >= 1
            # the ratio to plain, repeat by repeat (the same prompts), spans the median's
            low, high = figures["vs_plain_range"]
            assert figures["repeats"] == 2 and low <= figures["vs_plain"] <= high
        runs = written["results"][key]["runs"]
        assert all(len(repeats) == 2 for repeats in runs.values())


def test_rollout_when_sampling_leaves_the_identity_check_out(tiny_pair_recipe, tmp_path):
    out = tmp_path / "rollout.json"
    arguments = ["--batch-sizes", "2", "--fixed", "s2-k1-t3", "--repeats", "1", "--out", str(out)]
    result = runner.invoke(
        app, ["bench", "rollout", "--recipe", str(tiny_pair_recipe), "rollout.temperature=1.0", *arguments]
    )
    assert result.exit_code == 0, result.output
    # the recipe's rollout.dtype auto, resolved by the decode plan: the cell names both
    (key,) = json.loads(out.read_text())["summary"]
    assert key in ("auto: float32 B=2", "auto: bfloat16 B=2")
    summary = json.loads(out.read_text())["summary"][key]
    assert all(figures["identical_rows"] is None and figures["identity"] is None for figures in summary.values())
    assert "same" not in result.output


def test_costs_times_every_rows_and_tokens_point_in_the_runs_decode_plan(tiny_pair_recipe, tmp_path):
    out = tmp_path / "costs.json"
    arguments = ["--rows", "1,2", "--tokens", "1,4", "--dtypes", "float32", "--repeats", "1", "--out", str(out)]
    result = runner.invoke(app, ["bench", "costs", "--recipe", str(tiny_pair_recipe), *arguments])
    assert result.exit_code == 0, result.output
    for text in ("target forward per pass", "float32, rows 1", "float32, rows 2", "4 tokens/row", "drafter forward"):
        assert text in result.output, text
    written = json.loads(out.read_text())
    assert MACHINE_FIELDS <= set(written["machine"]) and set(written["decode_plans"]) == {"float32"}
    grid = written["results"]["float32"]
    assert grid["rows"] == [1, 2] and grid["tokens"] == [1, 4] and len(grid["drafter_ms"]) > 0
    summary = written["summary"]["float32"]
    assert set(summary) == {"1x1", "1x4", "2x1", "2x4"}
    # a plain step against itself is 1.0 per token
    assert summary["1x1"]["per_token_vs_plain"] == pytest.approx(1.0)
    assert summary["2x1"]["per_token_vs_plain"] == pytest.approx(1.0)


def times(rollout: float, step_seconds: float) -> dict:
    """A variant's mean rollout and step seconds, as `side_by_side` reads them."""
    return {"rollout_seconds": rollout, "step_seconds": step_seconds}


def step(rollout: float, step_seconds: float, reward: float, kl: float | None = None, tokens: int = 100) -> dict:
    """A step record with the figures `tlt bench runs` reads; everything but the rollout is the update."""
    record = {
        "type": "step",
        "step_seconds": step_seconds,
        "rollout_seconds": rollout,
        "update_seconds": step_seconds - rollout,
        "response_tokens": tokens,
        "response_length_p50": 20.0,
        "mean_reward": reward,
    }
    return record if kl is None else {**record, "actor_rollout_kl_k3": kl}


def test_amdahl_bound_is_one_over_the_unchanged_part_plus_the_sped_up_part():
    assert amdahl_bound(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    assert amdahl_bound(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl_bound(0.0, 3.0) == pytest.approx(1.0)


def test_side_by_side_gives_ratios_share_bound_and_the_step_ratios_fraction_of_it():
    figures = side_by_side(
        {"rollout_seconds": 20.0, "step_seconds": 40.0}, {"rollout_seconds": 10.0, "step_seconds": 32.0}
    )
    assert figures["rollout_ratio"] == pytest.approx(2.0) and figures["step_ratio"] == pytest.approx(1.25)
    assert figures["baseline_rollout_share"] == pytest.approx(0.5)
    assert figures["amdahl_bound"] == pytest.approx(4 / 3)
    assert figures["step_ratio_of_bound"] == pytest.approx(1.25 * 3 / 4)


def test_reward_gap_compares_per_seed_means_against_seed_noise():
    gap = reward_gap({"off": [0.1, 0.3], "tlt": [0.2, 0.4]}, "off", "tlt")
    assert gap["gap"] == pytest.approx(0.1)
    assert gap["seed_std"] == pytest.approx(0.12909944)


def test_one_seed_has_no_noise_estimate_and_says_so():
    gap = reward_gap({"off": [0.5], "tlt": [0.55]}, "off", "tlt")
    assert gap["seed_std"] is None
    figures = {**side_by_side(times(10.0, 20.0), times(8.0, 18.0)), **gap}
    line = comparison_line("tlt", "off", figures)
    assert "one seed: no noise estimate" in line and "nan" not in line
    assert "rollout 1.25x faster" in line and "Amdahl bound is" in line and "of it" in line


def test_slowdowns_are_worded_as_slowdowns():
    assert speed_words(1.25) == "1.25x faster" and speed_words(0.8) == "1.25x slower"
    slower_rollout = {**side_by_side(times(10.0, 20.0), times(12.5, 22.5)), "gap": 0.0, "seed_std": 0.01}
    line = comparison_line("tlt", "off", slower_rollout)
    assert "rollout 1.25x slower, step 1.12x slower" in line and "no speed-up to bound" in line
    assert "the step got" not in line
    slower_step = {**side_by_side(times(10.0, 20.0), times(8.0, 21.0)), "gap": 0.0, "seed_std": 0.01}
    assert "but the step got slower instead" in comparison_line("tlt", "off", slower_step)


def test_token_counts_print_as_whole_numbers(capsys):
    steps = {"off": {0: [step(10.0, 20.0, 0.5, tokens=2541), step(10.0, 20.0, 0.5, tokens=2542)]}}
    render(Console(width=200), summarize(steps, skip=0))
    output = capsys.readouterr().out
    assert "2542 " in output and "2541.5" not in output and "2542.000" not in output


def test_load_average_above_the_cores_is_a_warning():
    assert load_lines(1.5, 2) == ["load average 1.50 (1 minute) on 2 usable cores"]
    busy = load_lines(8.5, 2)
    assert len(busy) == 2 and busy[1].startswith("warning: the load average 8.50 exceeds the 2 cores")


def rollout_cell(plain_seconds, auto_ratio):
    return {
        "plain": {"vs_plain": 1.0, "seconds": plain_seconds},
        "auto": {"vs_plain": auto_ratio, "seconds": plain_seconds / auto_ratio},
    }


def test_rollout_gives_no_verdict_from_cells_too_short_to_time():
    short = MIN_TIMED_SECONDS / 10
    (line,) = verdict({"float32 B=8": rollout_cell(short, 1.07)})
    assert "no verdict" in line and "too short to time" in line and "pays" not in line
    (paying,) = verdict({"float32 B=8": rollout_cell(5.0, 1.2)})
    assert "SD pays here" in paying and "auto 1.20x faster than plain" in paying
    (losing,) = verdict({"float32 B=8": rollout_cell(5.0, 0.8)})
    assert "SD does not pay here" in losing and "auto 1.25x slower than plain" in losing


def test_runs_summary_leaves_skipped_steps_out_of_times_but_not_rewards_and_reads_the_rollout_kl():
    steps = {
        "off": {0: [step(100.0, 200.0, 0.0), step(20.0, 40.0, 0.5)]},
        "tlt": {0: [step(100.0, 200.0, 1.0, kl=2e-3), step(10.0, 30.0, 0.5, kl=4e-3)]},
    }
    summary = summarize(steps, skip=1)
    tlt = summary["per_run"]["tlt"][0]
    assert tlt["step_seconds"] == 30.0 and tlt["rollout_seconds"] == 10.0
    assert tlt["mean_reward"] == 0.75 and tlt["actor_rollout_kl_k3"] == pytest.approx(3e-3)
    assert summary["per_run"]["off"][0]["actor_rollout_kl_k3"] is None
    assert summary["baseline"] == "off"
    assert summary["against_baseline"]["tlt"]["rollout_ratio"] == pytest.approx(2.0)


@pytest.mark.slow
def test_runs_trains_each_variant_and_seed_and_reads_their_traces(tiny_pair_recipe, tmp_path):
    out = tmp_path / "runs.json"
    arguments = ["--variants", "off,auto", "--seeds", "0", "--steps", "2", "--skip", "1"]
    folders = ["--output-dir", str(tmp_path / "runs"), "--out", str(out)]
    result = runner.invoke(app, ["bench", "runs", "--recipe", str(tiny_pair_recipe), *arguments, *folders])
    assert result.exit_code == 0, result.output
    # the table's title and the comparison line (its cells wrap in a narrow terminal: the JSON has them)
    for text in ("end-to-end runs", "auto vs off: rollout", "Amdahl bound", "one seed: no noise estimate"):
        assert text in result.output, text
    written = json.loads(out.read_text())
    assert MACHINE_FIELDS <= set(written["machine"]) and written["seeds"] == [0]
    assert written["results"]["variants"]["auto"] == ["speculative.mode=auto"]
    assert [len(written["results"]["steps"][name]["0"]) for name in ("off", "auto")] == [2, 2]
    per_run = written["summary"]["per_run"]
    assert set(per_run["auto"]["0"]) >= {"step_seconds", "response_length_p50", "mean_reward", "actor_rollout_kl_k3"}
    # read back without training: the same steps
    again = runner.invoke(
        app,
        [
            "bench",
            "runs",
            "--recipe",
            str(tiny_pair_recipe),
            *arguments,
            *folders[:2],
            "--from-runs",
            "--out",
            str(tmp_path / "again.json"),
        ],
    )
    assert again.exit_code == 0, again.output
    assert json.loads((tmp_path / "again.json").read_text())["results"]["steps"] == written["results"]["steps"]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["rollout", "--recipe", "no-such-recipe.yaml"], "no-such-recipe"),
        (["rollout", "--recipe", "{recipe}", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["rollout", "--recipe", "{recipe}", "--dtypes", "float8"], "--dtypes"),
        (["rollout", "--recipe", "{recipe}", "--fixed", "s2-q1"], "--fixed"),
        (["rollout", "--recipe", "{recipe}", "--repeats", "0"], "--repeats"),
        (["rollout", "--recipe", "{recipe}", "--fixed", "s100-k1"], "speculative steps is 100"),
        (["rollout", "--recipe", "{recipe}", "--fixed", "s2-k1-t7"], "--fixed names 's2-k1-t7'"),
        (["rollout", "--recipe", "{recipe}", "--fixed", "s2-k100-t8"], "speculative topk is 100"),
        (["rollout", "--recipe", "{recipe}", "--first-prompt", "-3"], "--first-prompt"),
        (["rollout", "--recipe", "{recipe}", "--batch-sizes", "200000"], "--batch-sizes"),
        (["costs", "--recipe", "{recipe}", "--rows", "0"], "--rows"),
        (["costs", "--recipe", "{recipe}", "--tokens", "100000"], "--tokens"),
        (["costs", "--recipe", "{recipe}", "rollout.max_new_tokens=-3"], "rollout.max_new_tokens"),
        (["runs", "--recipe", "{recipe}", "--variants", "off,fast"], "--variants"),
        (["runs", "--recipe", "{recipe}", "--variant-override", "tlt:nothing"], "--variant-override"),
        (["runs", "--recipe", "{recipe}", "--seeds", "0,a"], "--seeds"),
        (["runs", "--recipe", "{recipe}", "--seeds=--5"], "--seeds"),
        (["runs", "--recipe", "{recipe}", "--seeds", "0,\u00b2"], "--seeds"),
        (["runs", "--recipe", "{recipe}", "--seeds", "4294967296"], "--seeds"),
        (["runs", "--recipe", "{recipe}", "--variant-override", "tlt:rollout.temperature=-1"], "rollout.temperature"),
        (["runs", "--recipe", "{recipe}", "--from-runs", "--output-dir", "{empty}"], "no trace.jsonl"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(tiny_pair_recipe, tmp_path, monkeypatch, arguments, message):
    def no_loading(*_):
        raise AssertionError("a model was loaded before the options were checked")

    for command in (bench_rollout, bench_costs):  # every option is checked before anything loads
        monkeypatch.setattr(command, "model_pair", no_loading)
    monkeypatch.setattr(bench_runs, "train", no_loading)
    filled = [argument.format(recipe=tiny_pair_recipe, empty=tmp_path) for argument in arguments]
    result = runner.invoke(app, ["bench", *filled, "--out", str(tmp_path / "out.json")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert not (tmp_path / "out.json").exists()


def fake_run(folder: Path, steps: int, planned: int | None = None, **figures) -> Path:
    """A run folder whose trace holds a run record of `planned` steps and `steps` step records (made up figures)."""
    folder.mkdir(parents=True, exist_ok=True)
    records = [{"type": "run", "name": folder.name, "steps": planned or steps}]
    step = {"step_seconds": 2.0, "rollout_seconds": 1.0, "update_seconds": 1.0, "mean_reward": 0.5, **figures}
    records += [{"type": "step", "step": number, **step} for number in range(steps)]
    (folder / "trace.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return folder


def runs_from(tiny_pair_recipe: Path, output: Path, out: Path, *arguments: str):
    return runner.invoke(
        app,
        ["bench", "runs", "--recipe", str(tiny_pair_recipe), "--variants", "off", "--steps", "2"]
        + ["--output-dir", str(output), "--out", str(out), *arguments],
    )


def test_runs_from_runs_reads_a_complete_run_and_writes_out_atomically_not_through_a_link(tiny_pair_recipe, tmp_path):
    fake_run(tmp_path / "runs" / "off-seed0", steps=2)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("a user's file\n")
    out = tmp_path / "out.json"
    out.symlink_to(elsewhere)  # planted at --out's name
    result = runs_from(tiny_pair_recipe, tmp_path / "runs", out, "--from-runs")
    assert result.exit_code == 0, result.output
    assert not out.is_symlink() and json.loads(out.read_text())["results"]["steps"]["off"]["0"][0]["step"] == 0
    assert elsewhere.read_text() == "a user's file\n"


def test_runs_sets_each_runs_own_verdict_beside_the_ab_and_says_when_they_disagree(tiny_pair_recipe, tmp_path):
    """A run whose own measure says SD paid (1.5x at the same batch size) but whose rollout was slower than the
    baseline's: the bench prints both and that they disagree."""
    fake_run(tmp_path / "runs" / "off-seed0", steps=2)
    tlt = fake_run(tmp_path / "runs" / "tlt-seed0", steps=2, rollout_seconds=1.25, step_seconds=2.25)
    timing = {"step": 0, "worker": 0, "type": "sd_config"}
    plain = {"config": "off", "batch_sizes": {"4": 400}, "batch_seconds": {"4": 4.0}, "batch_tokens": {"4": 1600}}
    speculated = {
        "config": "s4-k1-t5",
        "batch_sizes": {"1": 100},
        "batch_seconds": {"1": 2.0},
        "batch_tokens": {"1": 300},
    }
    records = [
        {**timing, **plain},
        {**timing, **speculated},
        {"type": "request", "accepted_tokens": 200, "verify_passes": 100},
    ]
    with open(tlt / "trace.jsonl", "a") as trace:
        trace.write("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out.json"
    result = runner.invoke(
        app,
        ["bench", "runs", "--recipe", str(tiny_pair_recipe), "--variants", "off,tlt", "--steps", "2"]
        + ["--output-dir", str(tmp_path / "runs"), "--out", str(out), "--from-runs"],
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "tlt-seed0 by its own measure: SD paid in this run: its steps decoded 1.50x" in output
    assert "does NOT agree with the rollout against off (0.80x)" in output
    verdict = json.loads(out.read_text())["summary"]["own_verdicts"]["tlt-seed0"]
    assert verdict["agrees"] is False and verdict["rollout_ratio"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("trace", "message"),
    [
        ("", "has no run record"),
        ('{"type": "run", "steps": 2}\n', "is incomplete: its trace has 0 of its 2 steps"),
        ('{"type": "run", "steps": 2}\n{"type": "step", "step": 0}\n', "is incomplete: its trace has 1 of its 2"),
        ('{"type": "run", "steps": 2}\n{"type": "st', "is cut short"),
        ('{"type": "run", "steps": 2}\n{"step": 0}\n', "line 2 has no 'type'"),
        ('{"type": "run", "steps": 2}\n\xff\n', "is not UTF-8"),
        ('{"type": "run", "steps": 1}\n{"type": "step", "step": 0, "rollout_seconds": 0}\n', "'rollout_seconds' is 0"),
        ('{"type": "run", "steps": 1}\n{"type": "step", "step": [0]}\n', "is incomplete"),
        ('{"type": "run", "steps": 1}\n{"type": "step", "step": 0, "mean_reward": "x"}\n', "'mean_reward' is 'x'"),
    ],
)
def test_runs_from_damaged_or_interrupted_runs_names_them_in_one_sentence(tiny_pair_recipe, tmp_path, trace, message):
    folder = tmp_path / "runs" / "off-seed0"
    folder.mkdir(parents=True)
    (folder / "trace.jsonl").write_bytes(trace.encode("latin-1"))
    result = runs_from(tiny_pair_recipe, tmp_path / "runs", tmp_path / "out.json", "--from-runs")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert not (tmp_path / "out.json").exists()


def test_runs_never_replaces_a_folder_it_did_not_make(tiny_pair_recipe, tmp_path, monkeypatch):
    notes = tmp_path / "runs" / "off-seed0" / "notes.txt"
    notes.parent.mkdir(parents=True)
    notes.write_text("a user's notes\n")

    def no_training(*_):
        raise AssertionError("a run trained before the output folder was checked")

    monkeypatch.setattr(bench_runs, "train", no_training)
    result = runs_from(tiny_pair_recipe, tmp_path / "runs", tmp_path / "out.json")
    assert result.exit_code == 2 and "holds off-seed0, which tlt bench runs did not make" in result.output
    assert notes.read_text() == "a user's notes\n"
    (notes.parent / bench_runs.BENCH_MARKER).write_text("")  # one this command made is replaced
    trained = []

    def made_up_training(recipe_path, name, overrides, steps, output):
        trained.append(name)
        fake_run(output / name, steps)

    monkeypatch.setattr(bench_runs, "train", made_up_training)
    result = runs_from(tiny_pair_recipe, tmp_path / "runs", tmp_path / "out.json")
    assert result.exit_code == 0 and trained == ["off-seed0"], result.output


def test_runs_reads_each_runs_trace_once(tiny_pair_recipe, tmp_path, monkeypatch):
    """The tables, a speculating run's own verdict and --fidelity's warnings all read one reading of the trace."""
    output = tmp_path / "runs"
    for name in ("off-seed0", "tlt-seed0"):
        fake_run(output / name, steps=2)
    reads = []

    def counted_reading(path, error):
        reads.append(Path(path).parent.name)
        return numbered_records(path, error)

    monkeypatch.setattr(bench_runs, "numbered_records", counted_reading)
    command = ["bench", "runs", "--recipe", str(tiny_pair_recipe), "--variants", "off,tlt", "--steps", "2"]
    command += ["--output-dir", str(output), "--out", str(tmp_path / "out.json"), "--from-runs", "--fidelity"]
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.output
    assert sorted(reads) == ["off-seed0", "tlt-seed0"]


def test_runs_per_step_pools_seeds_into_a_rate_and_sets_it_beside_the_baselines_with_the_drafters_figures():
    def with_drafter(record, accept, idle, update):
        return {
            **record,
            "drafter_accept_length": accept,
            "drafter_train_seconds": idle,
            "drafter_update_seconds": update,
        }

    steps = {
        "off": {
            0: [step(10.0, 20.0, 0.5, tokens=100), step(10.0, 20.0, 0.5)],
            1: [step(30.0, 40.0, 0.5, tokens=300)] * 2,
        },
        "tlt": {
            0: [with_drafter(step(5.0, 15.0, 0.5, kl=1e-3), 1.5, 1.0, 0.5), step(5.0, 15.0, 0.5)],
            1: [with_drafter(step(15.0, 25.0, 0.7, tokens=300, kl=3e-3), 2.5, 2.0, 1.0), step(10.0, 20.0, 0.5)],
        },
    }
    table = summarize(steps, skip=0)["per_step"]
    first = table["tlt"][0]
    assert first["tokens_per_second"] == pytest.approx(400 / 20) and first["vs_baseline"] == pytest.approx(2.0)
    assert first["drafter_accept_length"] == 2.0 and first["drafter_seconds"] == 2.25
    assert first["response_tokens"] == 200 and first["mean_reward"] == pytest.approx(0.6)
    assert first["actor_rollout_kl_k3"] == pytest.approx(2e-3)
    assert table["off"][1]["vs_baseline"] == 1.0 and table["off"][0]["drafter_seconds"] is None
    render(Console(width=200), summarize(steps, skip=0))


def test_runs_fidelity_shows_every_step_and_the_guards_warnings_of_its_own_variants(tiny_pair_recipe, tmp_path):
    """--fidelity over runs left by an earlier call: own variants (--variant) start with SD off, every step is a
    row, and the fidelity guard's warnings in a trace are printed and written."""
    output = tmp_path / "runs"
    fake_run(output / "fp32-seed0", 2, response_tokens=40, response_length_p50=10, actor_rollout_kl_k3=1e-4)
    warned = fake_run(output / "bf16-seed0", 2, response_tokens=38, response_length_p50=9, actor_rollout_kl_k3=2e-2)
    with (warned / "trace.jsonl").open("a") as trace:
        trace.write(json.dumps({"type": "event", "kind": "fidelity", "message": "the rollout drifts"}) + "\n")
    out = tmp_path / "out.json"
    arguments = ["--variants", "", "--fidelity", "--from-runs", "--steps", "2"]
    arguments += ["--variant", "fp32:rollout.dtype=float32", "--variant", "bf16:rollout.dtype=bfloat16"]
    command = ["bench", "runs", "--recipe", str(tiny_pair_recipe), "--output-dir", str(output), "--out", str(out)]
    result = runner.invoke(app, [*command, *arguments])
    assert result.exit_code == 0, result.output
    assert "fidelity: does the rollout sample" in result.output and "bf16-seed0: the rollout drifts" in result.output
    written = json.loads(out.read_text())
    assert written["results"]["variants"]["bf16"] == [
        "speculative.mode=off",
        "plugins.enabled=[]",
        "rollout.dtype=bfloat16",
    ]
    assert written["results"]["fidelity_warnings"] == {"fp32-seed0": [], "bf16-seed0": ["the rollout drifts"]}


def test_runs_comparisons_carry_their_spread_over_paired_steps_and_say_one_sample_is_one():
    steps = {
        "off": {0: [step(10.0, 20.0, 0.5), step(10.0, 20.0, 0.5), step(10.0, 20.0, 0.5)]},
        "tlt": {0: [step(99.0, 99.0, 0.5), step(5.0, 15.0, 0.5), step(8.0, 18.0, 0.5, tokens=80)]},
    }
    figures = summarize(steps, skip=1)["against_baseline"]["tlt"]
    # steps 1 and 2 of seed 0 paired: rollout 100/5 vs 100/10 -> 2.0x, 80/8 vs 100/10 -> 1.0x
    assert figures["paired_steps"] == 2
    assert figures["rollout_ratio_range"] == pytest.approx([1.0, 2.0])
    assert figures["step_ratio_range"] == pytest.approx([(20 / 100) / (18 / 80), (20 / 100) / (15 / 100)])
    line = comparison_line("tlt", "off", figures)
    assert "step by step: rollout 1.00x-2.00x" in line and "over 2 steps x seeds" in line
    one = summarize({name: {0: by_seed[0][:2]} for name, by_seed in steps.items()}, skip=1)["against_baseline"]["tlt"]
    assert "one step: one sample, no spread" in comparison_line("tlt", "off", one)


def test_rollout_verdicts_carry_the_repeats_spread_or_say_one_repeat_is_one_sample():
    spread = rollout_cell(5.0, 1.2)
    spread["auto"] |= {"vs_plain_range": [1.1, 1.3], "repeats": 3}
    (line,) = verdict({"float32 B=8": spread})
    assert "(auto 1.10x-1.30x plain over 3 repeats)" in line
    single = rollout_cell(5.0, 1.2)
    single["auto"] |= {"vs_plain_range": [1.2, 1.2], "repeats": 1}
    (line,) = verdict({"float32 B=8": single})
    assert "one repeat: one sample, no spread" in line
