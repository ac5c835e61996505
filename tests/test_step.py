"""One GRPO step, built once (tlt_cli/training/step.py): the requests of a rank's shard grouped as the rollout
reads them, and `tlt profile RECIPE` rolling out exactly the step 0 `tlt train` rolls out (same prompts, same
sampling seeds, so the same responses), since both build their shards and seeds there."""

from __future__ import annotations

import subprocess

from recipe_overrides import RECIPE, small_run
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import load_recipe
from tlt_cli.tasks.base import Problem
from tlt_cli.trace import read_trace
from tlt_cli.training.step import StepShard, grouped_requests, shard_problems

# decoding as deterministic as one seed makes it: plain decoding in float32, no measured linear forms
SAME_DECODING = ("rollout.dtype=float32", "rollout.linear_forms=off", "workers.count=2")


def test_grouped_requests_sample_each_prompt_group_size_times_as_one_group():
    requests = grouped_requests([(1, 2), (3,)], group_size=2)
    assert [(request.request_id, request.prompt_ids, request.group) for request in requests] == [
        (0, (1, 2), 0),
        (1, (1, 2), 0),
        (2, (3,), 1),
        (3, (3,), 1),
    ]
    # fewer rows than the prompts' samples: the first rows, in order (tlt bench rollout's fixed batch sizes)
    assert [request.group for request in grouped_requests([(1,), (2,)], group_size=2, rows=3)] == [0, 0, 1]


def test_each_rank_gets_its_own_slice_of_the_steps_prompts():
    recipe = load_recipe(RECIPE, ["train.prompts_per_step=4", "workers.count=2"])

    class Numbered:
        def problem(self, index: int) -> Problem:
            return Problem(index, f"problem {index}", str(index), "")

    prompts = [
        [problem.prompt for problem in shard_problems(recipe, Numbered(), step, rank)]
        for step in (0, 1)
        for rank in (0, 1)
    ]
    assert prompts == [
        ["problem 0", "problem 1"],
        ["problem 2", "problem 3"],
        ["problem 4", "problem 5"],
        ["problem 6", "problem 7"],
    ]
    assert StepShard([]).requests == []


def responses(trace: list[dict]) -> dict[tuple[int, int], tuple]:
    """Step 0's responses by (worker, request): what decides them (prompt, length, how it ended)."""
    return {
        (record["worker"], record["request_id"]): (record["prompt_tokens"], record["tokens"], record["finished_by_eos"])
        for record in trace
        if record["type"] == "request" and record["step"] == 0
    }


def test_tlt_profile_rolls_out_the_step_0_tlt_train_rolls_out(small_model, tmp_path):
    trained = subprocess.run(
        small_run(small_model, tmp_path, "run", 1, *SAME_DECODING), capture_output=True, text=True, timeout=900
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    overrides = small_run(small_model, tmp_path, "profiled", 1, *SAME_DECODING)[5:]
    profiled = CliRunner().invoke(app, ["profile", str(RECIPE), *overrides, "--steps", "1", "--json"])
    assert profiled.exit_code == 0, profiled.output
    run = responses(read_trace(tmp_path / "run" / "trace.jsonl"))
    recorded = responses(read_trace(tmp_path / "profiled-profile" / "rollout_trace.jsonl"))
    # 4 prompts x 2 samples over 2 workers, lengths that differ (the model ends its answers), all alike
    assert len(run) == 8 and len({tokens for _, tokens, _ in run.values()}) > 1
    assert recorded == run
