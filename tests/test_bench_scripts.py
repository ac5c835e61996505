"""The arithmetic of the side-by-side benchmarks (scripts/bench_end_to_end.py, scripts/bench_trl.py and
their shared scripts/training_runs.py): ratios, the Amdahl bound, reward curves, on made-up step records;
scripts/profile_plain_step.py run end to end on the tiny recipe (scripts/profile_update.py's categories and
phases: tests/test_update_roofline.py)."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys

import pytest
from rich.console import Console

from tests.conftest import REPOSITORY

sys.path.insert(0, str(REPOSITORY / "scripts"))
import bench_end_to_end  # noqa: E402
import bench_trl  # noqa: E402
from training_runs import amdahl_bound, render_rewards, render_side_by_side, reward_gap, side_by_side  # noqa: E402


def step(rollout: float, step_seconds: float, reward: float) -> dict:
    """A step record with the keys the benchmarks read; everything but the rollout is the update."""
    return {
        "step_seconds": step_seconds,
        "rollout_seconds": rollout,
        "reward_seconds": 0.0,
        "update_seconds": step_seconds - rollout,
        "idle_worker_seconds": 1.0,
        "release_delay_seconds": 0.0,
        "drafter_train_seconds": 0.5,
        "accept_length": 2.0,
        "mean_reward": reward,
        "response_tokens": 100,
    }


def test_amdahl_bound_is_one_over_the_unchanged_part_plus_the_sped_up_part():
    assert amdahl_bound(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    assert amdahl_bound(1.0, 3.0) == pytest.approx(3.0)
    assert amdahl_bound(0.0, 3.0) == pytest.approx(1.0)
    assert amdahl_bound(0.8, 1.0) == pytest.approx(1.0)


def test_side_by_side_gives_ratios_share_bound_and_the_step_ratios_fraction_of_it():
    figures = side_by_side(
        {"rollout_seconds": 20.0, "step_seconds": 40.0}, {"rollout_seconds": 10.0, "step_seconds": 32.0}
    )
    assert figures["rollout_ratio"] == pytest.approx(2.0)
    assert figures["step_ratio"] == pytest.approx(1.25)
    assert figures["baseline_rollout_share"] == pytest.approx(0.5)
    assert figures["amdahl_bound"] == pytest.approx(4 / 3)
    assert figures["step_ratio_of_bound"] == pytest.approx(1.25 * 3 / 4)


def test_reward_gap_compares_per_seed_means_against_seed_noise():
    curves = {"off": {0: [0.0, 0.2], 1: [0.2, 0.4]}, "tlt": {0: [0.1, 0.3], 1: [0.3, 0.5]}}
    gap = reward_gap(curves, "off", "tlt")
    assert gap["per_seed_mean_reward"] == {"off": pytest.approx([0.1, 0.3]), "tlt": pytest.approx([0.2, 0.4])}
    assert gap["gap"] == pytest.approx(0.1)
    assert gap["seed_std"] == pytest.approx(math.sqrt(((0.15) ** 2 + 0.05**2 + 0.05**2 + 0.15**2) / 3))
    assert math.isnan(reward_gap({"a": {0: [1.0]}, "b": {0: [0.0]}}, "a", "b")["seed_std"])


def test_end_to_end_summary_leaves_out_skipped_steps_from_times_but_not_from_rewards():
    results = {
        "off": {0: [step(100.0, 100.0, 0.0), step(20.0, 40.0, 0.1), step(20.0, 40.0, 0.3)]},
        "tlt": {0: [step(100.0, 100.0, 0.5), step(10.0, 30.0, 0.2), step(10.0, 30.0, 0.2)]},
    }
    summary = bench_end_to_end.summarize(results, skip=1)
    assert summary["side_by_side"]["rollout_ratio"] == pytest.approx(2.0)
    assert summary["side_by_side"]["step_ratio"] == pytest.approx(40 / 30)
    assert summary["side_by_side"]["step_ratio_of_bound"] == pytest.approx(1.0)
    assert summary["rewards"] == {"off": {0: [0.0, 0.1, 0.3]}, "tlt": {0: [0.5, 0.2, 0.2]}}
    assert summary["reward_gap"]["gap"] == pytest.approx(0.3 - 0.4 / 3)
    assert summary["per_seed"][0]["speedup"] == pytest.approx(40 / 30)
    output = io.StringIO()
    bench_end_to_end.render(summary, REPOSITORY / "recipes" / "real-cpu.yaml")
    render_side_by_side(Console(file=output, width=200), summary["side_by_side"], "off", "tlt")
    assert "Amdahl bound is 1.33x and the step got 100% of it" in output.getvalue()


def test_end_to_end_from_runs_reads_the_step_records_of_the_runs_left_in_the_output_folder(tmp_path):
    records = {"off": [step(20.0, 40.0, 0.1)], "tlt": [step(10.0, 30.0, 0.2)]}
    for name, steps in records.items():
        run = tmp_path / f"{name}-seed3"
        run.mkdir()
        lines = [{"type": "header"}, *({"type": "step", **record} for record in steps), {"type": "worker"}]
        (run / "trace.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    results = bench_end_to_end.read_seeds([3], tmp_path)
    assert results == {name: {3: [{"type": "step", **steps[0]}]} for name, steps in records.items()}
    with pytest.raises(SystemExit, match="off-seed4"):
        bench_end_to_end.read_seeds([4], tmp_path)


def test_bench_trl_compares_tlt_with_trls_generation():
    results = {
        "trl": {"steps": [step(50.0, 80.0, 0.1), step(30.0, 60.0, 0.2)]},
        "tlt": {"steps": [step(50.0, 80.0, 0.0), step(10.0, 45.0, 0.4)]},
    }
    for result in results.values():
        result["summary"] = bench_trl.summary(result["steps"], skip=1)
    comparison = bench_trl.compare(results)
    assert comparison["side_by_side"]["rollout_ratio"] == pytest.approx(3.0)
    assert comparison["side_by_side"]["amdahl_bound"] == pytest.approx(1 / (0.5 + 0.5 / 3))
    assert comparison["side_by_side"]["step_ratio_of_bound"] == pytest.approx((60 / 45) * (0.5 + 0.5 / 3))
    assert comparison["rewards"] == {"trl": {0: [0.1, 0.2]}, "tlt": {0: [0.0, 0.4]}}
    output = io.StringIO()
    render_rewards(Console(file=output, width=200), comparison["rewards"], comparison["reward_gap"])
    assert "gap +0.050" in output.getvalue() and "seed-to-seed std nan" in output.getvalue()


def test_profile_plain_step_splits_a_decode_step_and_compares_decoders_on_the_tiny_recipe(tmp_path):
    out = tmp_path / "profile.json"
    command = [
        sys.executable,
        str(REPOSITORY / "scripts" / "profile_plain_step.py"),
        str(REPOSITORY / "recipes" / "tiny-cpu.yaml"),
    ]
    arguments = ["--prompts", "1", "--max-new-tokens", "6", "--rounds", "2", "--out", str(out)]
    result = subprocess.run([*command, *arguments], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    breakdown = report["breakdown"]
    assert breakdown["decode_steps"] == 5  # the prefill draws the first of 6 tokens
    assert breakdown["matrix_products"] and all(
        product["megabytes"] > 0 for product in breakdown["matrix_products"].values()
    )
    assert breakdown["rest_ms"] == pytest.approx(
        breakdown["step_ms_under_profiler"] - breakdown["matrix_ms"] - breakdown["attention_ms"]
    )
    assert set(report["methods"]) == {"engine+forms", "engine", "generate", "generate+forms"}
    assert all(method["same_tokens_as_generate"] for method in report["methods"].values())


def test_bench_transformers_path_compares_generate_and_the_engine_on_models_outside_the_owned_family(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, str(REPOSITORY / "scripts" / "bench_transformers_path.py")]
    shape = ["--hidden-size", "32", "--layers", "2", "--heads", "4", "--vocab-size", "128"]
    arguments = ["--families", "gpt2,phi,mistral-sliding", "--max-new-tokens", "6", "--rounds", "2", "--prompts", "1"]
    arguments += ["--profile", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    result = subprocess.run([*command, *shape, *arguments], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["families"]) == {"gpt2", "phi", "mistral-sliding"} and report["processor"]
    for family in report["families"].values():
        assert family["decode_path"].startswith("decode path: transformers")
        assert set(family["ratio_vs_generate"]) == {"generate", "engine", "engine+forms"}
        assert all(value > 0 for value in family["tokens_per_cpu_second"].values())
        assert all(family["same_tokens_as_generate_batch_1"].values())
        assert all(family["same_tokens_as_generate_batched"].values()) and family["batch_size"] == 4
        assert set(family["decode_breakdown"]) == {"generate", "engine", "engine+forms"}
        assert all(split["matrix products"] > 0 for split in family["decode_breakdown"].values())
    assert list((tmp_path / "cache" / "linear_forms").glob("*.json"))
    assert "ratio vs generate" in result.stdout
