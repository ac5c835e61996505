"""`tlt profile`: every input kind, every input error, the numbers on hand-made timelines, the PNGs and --json."""

import json

import numpy
import pytest
import torch
from matplotlib.image import imread
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.models.tiny import build_tiny_model, save_model_folder, tiny_model_config, tiny_tokenizer
from tlt_cli.processes.messages import WorkerStepReport
from tlt_cli.processes.step_records import step_records
from tlt_cli.profile.analysis import analyse, worker_segments
from tlt_cli.profile.plots import LENGTHS_FILE, STATE_COLOURS, TIMELINE_FILE
from tlt_cli.profile.profiler import profile_source
from tlt_cli.profile.records import ProfileInputError, load_records
from tlt_cli.profile.report import terminal_gantt, terminal_histogram

torch.set_num_threads(1)
runner = CliRunner()


def request(step, worker, start, end, tokens, **extra):
    return {
        "type": "request",
        "step": step,
        "worker": worker,
        "request_id": 0,
        "start": start,
        "end": end,
        "tokens": tokens,
        **extra,
    }


def hand_made_trace():
    """Two workers, one 10 s rollout in a 20 s step.

    worker 0: 5 requests from 0 s ending at 2, 4, 6, 8, 10 s: > 4 in flight for 2 s, then 8 s of tail;
    worker 1: 2 requests over [0, 5]: 5 s of tail, then idle 5 s. SD ran on worker 0 (300 passes,
    600 drafts accepted: accept length 3.0); plain decode steps take 10 ms, SD steps 20 ms.
    """
    # per request: 60 passes, 120 drafts accepted = 54 + 42 + 24 at depths 1-3
    depth = {"accepted_by_depth": [54, 42, 24], "proposed_by_depth": [60, 60, 60]}
    return [
        {"type": "run", "name": "hand", "world_size": 2, "steps": 1, "resumed_from_step": None},
        *[
            request(0, 0, 0.0, end, 10 * end, verify_passes=60, accepted_tokens=120, **depth)
            for end in (2, 4, 6, 8, 10)
        ],
        request(0, 1, 0.0, 5.0, 40),
        request(0, 1, 0.0, 5.0, 40),
        {
            "type": "worker",
            "step": 0,
            "worker": 0,
            "busy_start": 0.0,
            "busy_end": 10.0,
            "idle_start": 10.0,
            "idle_end": 10.0,
            "idle_seconds": 0.0,
        },
        {
            "type": "worker",
            "step": 0,
            "worker": 1,
            "busy_start": 0.0,
            "busy_end": 5.0,
            "idle_start": 5.0,
            "idle_end": 10.0,
            "idle_seconds": 5.0,
            "drafter_steps": 12,
            "drafter_train_seconds": 3.0,
        },
        # plain: 10 ms a step at 4 rows; SD: 20 ms a step at 1 row, 3 tokens a step (1.5x plain at 4 rows' time)
        {
            "type": "sd_config",
            "step": 0,
            "worker": 0,
            "config": "off",
            "seconds": 4.0,
            "decode_steps": 400,
            "batch_sizes": {"4": 400},
            "batch_seconds": {"4": 4.0},
            "batch_tokens": {"4": 1600},
        },
        {
            "type": "sd_config",
            "step": 0,
            "worker": 0,
            "config": "s4-k1-t5",
            "seconds": 2.0,
            "decode_steps": 100,
            "batch_sizes": {"1": 100},
            "batch_seconds": {"1": 2.0},
            "batch_tokens": {"1": 300},
        },
        {"type": "warning", "message": "acceptance fell to 1.0 after a sync"},
        {"type": "some_future_record", "step": 0},
        {
            "type": "step",
            "step": 0,
            "rollout_start": 0.0,
            "rollout_end": 10.0,
            "rollout_seconds": 10.0,
            "step_seconds": 20.0,
            "memory_peak_gb": 1.75,
        },
    ]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_hand_made_trace_gives_the_numbers_computed_by_hand(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    profile = analyse(load_records(tmp_path), tail_batch=4)
    step = profile.steps[0]
    assert profile.workers == 2 and profile.kind == "trace"
    assert step.idle_worker_seconds == pytest.approx(5.0) and profile.idle_fraction == pytest.approx(0.25)
    assert step.under_half_busy_share == 0.0 and step.some_idle_share == pytest.approx(0.5)
    assert step.tail_seconds == pytest.approx(8.0) and step.memory_peak_gb == 1.75
    assert profile.lengths.max == 100 and profile.lengths.count == 7
    assert profile.accept_length == pytest.approx(3.0)
    assert [depth.rate for depth in profile.accept_by_depth] == pytest.approx([0.9, 0.7, 0.4])
    assert sum(depth.accept_length_share for depth in profile.accept_by_depth) == pytest.approx(
        profile.accept_length - 1
    )
    assert {entry.config: entry.seconds for entry in profile.sd_time} == {"off": 4.0, "s4-k1-t5": 2.0}
    assert profile.sd_on_seconds == 2.0 and profile.sd_off_seconds == 4.0
    assert (
        profile.drafter_train_seconds == 3.0
        and profile.drafter_steps == 12
        and profile.drafter_idle_share == pytest.approx(0.6)
    )
    assert profile.warnings == ["acceptance fell to 1.0 after a sync"]
    # measured s = accept length 3.0 x 10 ms / 20 ms = 1.5; worker 0 ends at 10 - 8 x (1 - 1/1.5), worker 1 earlier
    projection = profile.projection
    assert projection.sd_speedup == pytest.approx(1.5) and projection.sd_speedup_source.startswith("measured")
    assert step.projected_rollout_seconds == pytest.approx(10 - 8 / 3)
    assert projection.reclaimable_seconds == pytest.approx(8 / 3)
    assert projection.projected_speedup == pytest.approx(20 / (20 - 8 / 3))
    assert "Amdahl" in projection.model and "1.50x" in projection.model and "overstates" in projection.model


def test_given_sd_speedup_overrides_the_measured_one(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    projection = analyse(load_records(tmp_path), sd_speedup=2.0).projection
    # worker 0 ends at 10 - 8 / 2 = 6, worker 1 at 5 - 5 / 2: the rollout takes 6 s instead of 10
    assert projection.reclaimable_seconds == pytest.approx(4.0) and projection.projected_speedup == pytest.approx(1.25)
    assert "given with --sd-speedup" in projection.model


def test_csv_of_a_foreign_trainer_derives_worker_windows_and_counts_under_half_busy(tmp_path):
    path = tmp_path / "requests.csv"
    rows = [
        (0, 0, 0.0, 10.0, 900),
        (0, 1, 0.0, 4.0, 300),
        (0, 2, 0.5, 4.0, 300),
        (0, 3, 0.0, 2.0, 100),
        (0, 3, 0.0, 2.0, 120),
    ]
    path.write_text("step,worker,start,end,tokens\n" + "".join(",".join(map(str, row)) + "\n" for row in rows))
    records = load_records(path)
    profile = analyse(records)
    assert profile.kind == "csv" and profile.workers == 4 and profile.step_seconds is None
    # busy workers: 4 until 2 s (w2 from 0.5 s), 3 until 4 s, then only w0: fewer than 2 busy from 4 s to 10 s
    assert profile.steps[0].under_half_busy_share == pytest.approx(0.6)
    assert profile.idle_worker_seconds == pytest.approx(40 - (10 + 4 + 3.5 + 2))
    assert profile.projection.speedup_of == "rollout" and "assumed" in profile.projection.sd_speedup_source
    assert profile.accept_length is None


def test_plain_jsonl_records_are_read_like_the_csv(tmp_path):
    path = write_jsonl(
        tmp_path / "requests.jsonl",
        [
            {"step": 1, "worker": 0, "start": 5.0, "end": 6.0, "tokens": 12},
            {
                "step": 1,
                "worker": 1,
                "start": 5.0,
                "end": 9.0,
                "tokens": 80,
                "verify_passes": 10,
                "accepted_tokens": 15,
            },
        ],
    )
    profile = analyse(load_records(path))
    assert profile.kind == "jsonl" and profile.rollout_seconds == pytest.approx(4.0)
    assert profile.idle_worker_seconds == pytest.approx(3.0) and profile.accept_length == pytest.approx(2.5)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"type": "run", "world_size": 1}\nnot json\n{"type": "step"}\n', "line 2 is not valid JSON"),
        ('{"type": "run", "world_size": 1}\n{"type": "step", "step": 0, "rollout_st', "line 2 (the last) is cut short"),
        ('{"type": "run"}\n[1, 2]\n', "line 2 is not a JSON object"),
        ('{"type": "run"}\n{"type": "request", "step": 0, "worker": 0, "start": 0}\n', "line 2 lacks 'end'"),
        (
            '{"type": "run"}\n'
            '{"type": "worker", "step": 0, "worker": "a", "busy_start": 0, "busy_end": 1, "idle_end": 1}\n',
            "line 2: 'worker' is 'a', expected an integer",
        ),
        (
            '{"type": "run"}\n{"type": "request", "step": 0, "worker": 0, "start": 0, "end": 1, "tokens": 3}\n',
            "no complete step",
        ),
    ],
)
def test_bad_traces_are_one_clear_error_naming_the_line(tmp_path, content, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(content)
    with pytest.raises(ProfileInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_records(path)


REQUEST_LINE = '{{"type": "request", "step": {step}, "worker": 0, "start": 0, "end": 1, "tokens": 3}}\n'


@pytest.mark.parametrize(
    "line, message",
    [
        (REQUEST_LINE.format(step=10**30), "line 2 is not a record (the number 1000000000000000000... does not fit"),
        (
            REQUEST_LINE.format(step="9" * 5000),
            "line 2 is not a record (the number 9999999999999999999... does not fit",
        ),
        (REQUEST_LINE.format(step="[" * 100_000 + "]" * 100_000), "line 2 is not a record (it nests deeper than"),
        (REQUEST_LINE.format(step="1e999"), "line 2: 'step' is inf, expected an integer"),
    ],
    ids=["30 digits", "5000 digits", "nested 100,000 deep", "1e999"],
)
def test_tlt_profile_on_a_trace_line_with_a_huge_number_or_deep_nesting_is_one_line_exit_2(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"type": "run", "world_size": 1}\n' + line)
    result = runner.invoke(app, ["profile", str(path), "--no-plots"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output


@pytest.mark.parametrize(
    "content, message",
    [
        ("step,worker,start,tokens\n0,0,0.0,5\n", "lacks the column\\(s\\) end"),
        (
            "step,worker,start,end,tokens\n0,0,0.0,1.0,5\n0,0,0.0,x,5\n",
            "line 3: 'end' is 'x', expected a finite number",
        ),
        ("step,worker,start,end,tokens\n0,0,2.0,1.0,5\n", "end \\(1.0\\) is before start"),
        ("step,worker,start,end,tokens\n", "holds no request records"),
    ],
)
def test_bad_csv_files_name_the_column_or_line(tmp_path, content, message):
    path = tmp_path / "requests.csv"
    path.write_text(content)
    with pytest.raises(ProfileInputError, match=message):
        load_records(path)


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ProfileInputError, match="does not exist"):
        load_records(tmp_path / "nowhere.jsonl")
    with pytest.raises(ProfileInputError, match="has no trace.jsonl"):
        load_records(tmp_path)
    write_jsonl(tmp_path / "plain.jsonl", [{"step": 0, "worker": 0, "start": 0.0, "tokens": 3}])
    with pytest.raises(ProfileInputError, match="line 1 lacks end"):
        load_records(tmp_path / "plain.jsonl")


def test_a_step_without_its_step_record_is_left_out_with_a_warning(tmp_path):
    records = hand_made_trace() + [request(1, 0, 20.0, 21.0, 5)]
    write_jsonl(tmp_path / "trace.jsonl", records)
    loaded = load_records(tmp_path)
    assert [step.step for step in loaded.steps] == [0] and all(request.step == 0 for request in loaded.requests)
    assert any("step 1 has no step record" in warning for warning in loaded.warnings)


def test_terminal_gantt_and_histogram_show_the_tail_and_the_idle_worker(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    records = load_records(tmp_path)
    profile = analyse(records)
    header, worker_0, worker_1 = (
        line.plain for line in terminal_gantt(worker_segments(records, 4), profile.steps, 2, width=40)
    )
    assert header.split()[:2] == ["step", "0"]
    # worker 0: busy the first fifth, then tail; worker 1: tail for half, then idle
    assert worker_0.strip() == "w0 " + "█" * 8 + "▓" * 32
    assert worker_1.strip() == "w1 " + "▓" * 20 + "·" * 20
    # lengths 20, 40, 40, 40, 60, 80, 100 in four bins of 20 tokens
    bars = terminal_histogram([request.tokens for request in records.requests], bins=4)
    assert [int(bar.split()[-1]) for bar in bars] == [1, 3, 1, 2]
    assert bars[1].count("#") == 40 and bars[0].count("#") == round(40 / 3)


def colour_fraction(image, hex_colour):
    """Share of pixels within a small distance of `hex_colour`."""
    rgb = numpy.array([int(hex_colour[index : index + 2], 16) for index in (1, 3, 5)]) / 255
    return float((numpy.abs(image[:, :, :3] - rgb).max(axis=2) < 0.02).mean())


def test_pngs_are_written_and_show_busy_tail_and_idle(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    result = profile_source(str(tmp_path), output_dir=tmp_path / "pictures")
    assert [path.name for path in result.pictures] == [TIMELINE_FILE, LENGTHS_FILE]
    timeline, lengths = (imread(path) for path in result.pictures)
    assert timeline.shape[1] > 800 and lengths.shape[0] > 300
    for state, colour in STATE_COLOURS.items():
        assert colour_fraction(timeline, colour) > 0.01, state
    for image in (timeline, lengths):
        distinct = len(numpy.unique(image[:, :, :3].reshape(-1, 3), axis=0))
        assert distinct > 20 and image[:, :, :3].std() > 0.1


def test_cli_prints_tables_and_the_projection_model(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    result = runner.invoke(app, ["profile", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.output
    for text in (
        "p99/p50",
        "rollout per step",
        "s4-k1-t5",
        "acceptance per draft depth",
        "drafter training: 3.00 s",
        "reclaimable 2.67 s",
        "model: tail decode",
        "warning: acceptance fell",
        "peak",
    ):
        assert text in result.output, text
    # the step's row ends with the highest worker's resident peak
    assert next(line for line in result.output.splitlines() if "20.00" in line).rstrip(" │|").endswith("1.75")
    assert not (tmp_path / TIMELINE_FILE).exists()


def test_cli_json_parses_and_errors_exit_2_with_one_line(tmp_path):
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    result = runner.invoke(app, ["profile", str(tmp_path / "trace.jsonl"), "--json"])
    assert result.exit_code == 0, result.output
    parsed = json.loads(result.stdout)
    assert parsed["idle_worker_seconds"] == pytest.approx(5.0) and parsed["projection"]["model"].startswith(
        "tail decode"
    )
    assert [path.rsplit("/", 1)[-1] for path in parsed["pictures"]] == [TIMELINE_FILE, LENGTHS_FILE]
    assert parsed["steps"][0]["memory_peak_gb"] == 1.75
    (tmp_path / "trace.jsonl").write_text('{"type": "run"}\n{"type": "st')
    failed = runner.invoke(app, ["profile", str(tmp_path)])
    assert failed.exit_code == 2 and "line 2 (the last) is cut short" in failed.output
    assert len(failed.output.strip().splitlines()) == 1
    assert runner.invoke(app, ["profile", str(tmp_path), "--tail-batch", "0"]).exit_code == 2


def test_a_recipe_records_a_fresh_rollout_of_simulated_workers(tmp_path):
    tokenizer = tiny_tokenizer()
    config = tiny_model_config(
        tokenizer, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64
    )
    save_model_folder(build_tiny_model(0, config), tokenizer, tmp_path / "model")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"run: {{name: probe, output_dir: {tmp_path}}}\nmodel: {{path: {tmp_path / 'model'}}}\n"
        "train: {prompts_per_step: 2, group_size: 2}\nworkers: {count: 2}\nrollout: {max_new_tokens: 6}\n"
    )
    result = runner.invoke(app, ["profile", str(recipe), "rollout.max_new_tokens=5", "--steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    parsed = json.loads(result.stdout)
    assert (
        parsed["kind"] == "recipe" and parsed["workers"] == 2 and [step["step"] for step in parsed["steps"]] == [0, 1]
    )
    # 2 prompts x 2 samples per step; a random model rarely stops early, never past max_new_tokens
    assert parsed["lengths"]["count"] == 4 * 2 and 1 <= parsed["lengths"]["max"] <= 5
    recorded = tmp_path / "probe-profile"
    assert (recorded / "rollout_trace.jsonl").is_file() and (recorded / TIMELINE_FILE).is_file()
    recorded_records = load_records(recorded / "rollout_trace.jsonl")
    assert recorded_records.world_size == 2
    # the recording process's resident peak per step: at least the tiny model and torch
    assert all(step.memory_peak_gb > 0.05 for step in recorded_records.steps)
    bad = runner.invoke(app, ["profile", str(recipe), "train.nope=1"])
    assert bad.exit_code == 2 and "train.nope" in bad.output


def mismatch_update(kl: float, low: float, high: float, truncated: float) -> dict[str, float]:
    """One worker's actor update metrics with a measured rollout/learner mismatch (Actor.update's as_dict)."""
    return {
        "loss": 0.1,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "ratio_mean": 1.0,
        "grad_norm": 1.0,
        "rollout_kl_k3": kl,
        "rollout_weight_mean": 1.0,
        "rollout_weight_min": low,
        "rollout_weight_max": high,
        "rollout_weight_truncated": truncated,
    }


def test_the_step_record_carries_the_mismatch_over_workers_and_the_profile_shows_it(tmp_path):
    reports = [
        WorkerStepReport(0, worker, 0.0, 10.0, 10.0, 0.5, 2.0, [request(0, worker, 0.0, 10.0, 40, reward=1.0)], update)
        for worker, update in enumerate([mismatch_update(2e-4, 0.9, 1.2, 0.0), mismatch_update(4e-4, 0.8, 2.5, 0.01)])
    ]
    for record in reports:
        record.requests[0].update(verify_passes=0, accepted_tokens=0)
    records = step_records(reports)
    step = records[-1]
    # the KL and shares are means over workers, the extremes the extremes of any worker
    assert step["actor_rollout_kl_k3"] == pytest.approx(3e-4) and step["actor_rollout_weight_truncated"] == 0.005
    assert step["actor_rollout_weight_min"] == 0.8 and step["actor_rollout_weight_max"] == 2.5
    trace = [{"type": "run", "name": "m", "world_size": 2, "steps": 1, "resumed_from_step": None}, *records]
    write_jsonl(tmp_path / "trace.jsonl", trace)
    mismatch = analyse(load_records(tmp_path)).steps[0].mismatch
    assert (mismatch.kl_k3, mismatch.weight_min, mismatch.weight_max) == (pytest.approx(3e-4), 0.8, 2.5)
    result = runner.invoke(app, ["profile", str(tmp_path), "--no-plots"])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "3.00e-04" in line)
    assert all(cell in row for cell in ("1.0000", "0.8000", "2.5000", "0.50"))
    parsed = json.loads(runner.invoke(app, ["profile", str(tmp_path), "--json"]).stdout)
    assert parsed["steps"][0]["mismatch"]["weight_max"] == 2.5
    write_jsonl(tmp_path / "trace.jsonl", hand_made_trace())
    unmeasured = runner.invoke(app, ["profile", str(tmp_path), "--no-plots"])
    assert "rollout/learner mismatch: not measured in the input" in unmeasured.output


def precision_record(**extra):
    figures = {"step_ms": {"float32": 48.0, "bfloat16": 54.1}, "verify_ms": {"float32": 145.0, "bfloat16": 86.4}}
    return {"dtype": "bfloat16", "reason": "measured", **figures, **extra}


def test_the_rollout_precision_of_older_and_newer_traces_reads_and_is_described(tmp_path):
    newer = precision_record(batch_step_ms={"float32": 158.1, "bfloat16": 89.0}, rows=16, speculates=True)
    records = hand_made_trace()
    records[0] = {**records[0], "rollout_precision": {"0": precision_record(), "1": newer}}
    profile = analyse(load_records(write_jsonl(tmp_path / "trace.jsonl", records)), tail_batch=4)
    older_line, newer_line = sorted(profile.precision, key=len)
    # a trace written before the batch step was measured: its figures, no prediction
    assert older_line.startswith("rollout dtype: bfloat16 (measured: float32 step 48.0 ms")
    assert "predicted" not in older_line
    # 1 / (0.5 * 89.0 / 158.1 + 0.5 * 86.4 / 145.0) = 1.73
    assert "16-row step 158.1 ms" in newer_line and "a 16-row rollout, speculating, predicted 1.73x" in newer_line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"rows": 0}, "'rows' must be a positive count"),
        ({"speculates": "yes"}, "'speculates' true or false"),
        ({"batch_step_ms": [1]}, "must be objects of milliseconds"),
    ],
)
def test_a_malformed_rollout_precision_is_one_clear_error(tmp_path, extra, message):
    records = hand_made_trace()
    records[0] = {**records[0], "rollout_precision": {"0": precision_record(**extra)}}
    with pytest.raises(ProfileInputError, match=message):
        load_records(write_jsonl(tmp_path / "trace.jsonl", records))
