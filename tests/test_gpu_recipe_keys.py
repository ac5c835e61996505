"""The GPU keys of a recipe on CPU: actor.devices / precision, rollout.backend sglang, workers.hostfile.

Validation never looks at the machine (the shipped GPU recipe validates here); what the machine
lacks is found by `check_machine` when a run starts, as one line naming the key (exit 2). Also
the multi-node DeepSpeed launch command, the actor's DeepSpeed config, and how the rule table
and the servers are split for SGLang. Hostfile runs on CPU: tests/test_hostfile_launch.py.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from typer.testing import CliRunner

from tlt_cli.cli import app
from tlt_cli.config import RecipeError
from tlt_cli.preflight import check_machine
from tlt_cli.processes.distributed import visible_gpus
from tlt_cli.processes.hostfile import deepspeed_launch_command
from tlt_cli.recipe_checks import load_checked_recipe
from tlt_cli.recipes import RECIPES_DIRECTORY
from tlt_cli.sglang.adaptive import BatchRule, batch_rules
from tlt_cli.sglang.rollout import servers_of_worker
from tlt_cli.speculative.types import SpeculativeConfig
from tlt_cli.training.actor import deepspeed_config
from tlt_cli.training.setup import speculative_plan

runner = CliRunner()
TINY = RECIPES_DIRECTORY / "tiny-cpu.yaml"
GPU = RECIPES_DIRECTORY / "gpu-sglang.yaml"
SGLANG_ON_CPU = ["rollout.backend=sglang", "rollout.sglang.colocated=false", "rollout.sglang.gpus=[0,1]"]


def test_the_default_recipe_keeps_the_actor_on_cpu_in_auto_precision_with_the_embedded_engine():
    recipe = load_checked_recipe(TINY)
    assert recipe.actor.devices == "cpu" and recipe.actor.precision == "auto"
    assert recipe.rollout.backend == "embedded" and recipe.workers.hostfile is None
    assert "bf16" not in deepspeed_config(recipe.actor, 1)


def test_the_gpu_recipe_asks_for_gpus_bf16_and_sglang():
    recipe = load_checked_recipe(GPU)
    assert recipe.actor.devices == [0, 1] and recipe.actor.precision == "bf16"
    assert (
        recipe.rollout.backend == "sglang" and recipe.rollout.sglang.gpus == (0, 1) and recipe.rollout.sglang.colocated
    )
    assert deepspeed_config(recipe.actor, 2)["bf16"] == {"enabled": True}


def test_sglang_section_is_typed_from_overrides():
    recipe = load_checked_recipe(
        TINY,
        [
            *SGLANG_ON_CPU,
            "rollout.sglang.gpus=[0,1,2,3]",
            "rollout.sglang.tp_size=2",
            'rollout.sglang.extra_args=["--attention-backend","triton"]',
        ],
    )
    assert recipe.rollout.sglang.gpus == (0, 1, 2, 3) and recipe.rollout.sglang.server_count == 2
    assert recipe.rollout.sglang.extra_args == ("--attention-backend", "triton")


BAD = {
    "devices not a list": (["actor.devices=gpu"], "actor.devices must be cpu or a list of GPU indices"),
    "negative device": (["actor.devices=[0,-1]"], "actor.devices must be cpu or a list of GPU indices"),
    "device twice": (["actor.devices=[1,1]"], "actor.devices lists a GPU twice"),
    "one gpu per rank": (["actor.devices=[0,1,2]"], "actor.devices lists 3 GPUs for workers.count 2"),
    "unknown precision": (["actor.precision=fp16"], "actor.precision must be one of auto, fp32, bf16"),
    "unknown backend": (["rollout.backend=vllm"], "rollout.backend must be one of embedded, sglang"),
    "unknown sglang key": (["rollout.sglang.gpuz=[0]"], "rollout.sglang.gpuz"),
    "sglang value": ([*SGLANG_ON_CPU, "rollout.sglang.mem_fraction=1.5"], "rollout.sglang.mem_fraction"),
    "servers per worker": (
        ["rollout.backend=sglang", "rollout.sglang.colocated=false", "rollout.sglang.gpus=[0,1,2]"],
        "each worker owns whole servers",
    ),
    "colocated on cpu": (["rollout.backend=sglang", "rollout.sglang.gpus=[0,1]"], "rollout.sglang.colocated: true"),
    "zero 3": (
        ["actor.zero_stage=3"],
        "actor.zero_stage must be in 0..2 (the rollout needs the full policy on every rank), got 3.",
    ),
    "rule table gap": (
        [*SGLANG_ON_CPU, "speculative.mode=adaptive", "speculative.rules=[{batch: [2, null], use: s2-k1}]"],
        "speculative.rules",
    ),
    "missing hostfile": (
        ["actor.devices=[0,1]", "workers.hostfile=/nonexistent/hostfile"],
        "workers.hostfile: /nonexistent/hostfile does not exist",
    ),
}


@pytest.mark.parametrize("name", list(BAD))
def test_impossible_gpu_settings_are_one_line_naming_the_key(name):
    overrides, expected = BAD[name]
    with pytest.raises(RecipeError) as caught:
        load_checked_recipe(TINY, overrides)
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_hostfile_ranks_must_match_nodes_times_devices(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=2\nnode-b slots=2\n")
    with pytest.raises(RecipeError, match=r"workers.count must be 4 \(2 nodes"):
        load_checked_recipe(TINY, ["actor.devices=[0,1]", f"workers.hostfile={hostfile}"])
    hostfile.write_text("node-a slots=two\n")
    with pytest.raises(RecipeError, match="line 1 must read '<host> slots=<n>'"):
        load_checked_recipe(TINY, ["actor.devices=[0,1]", f"workers.hostfile={hostfile}"])


def test_multi_node_launch_command_from_a_recipe(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=8  # second node\n")
    recipe = load_checked_recipe(
        GPU,
        [f"workers.hostfile={hostfile}", "workers.count=4", "train.prompts_per_step=32", "rollout.sglang.gpus=[0,1]"],
    )
    assert deepspeed_launch_command(recipe, tmp_path / "runs" / "gpu-sglang", 29500) == [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--master_port",
        "29500",
        "--include",
        "node-a:0,1@node-b:0,1",
        "--no_local_rank",
        "--module",
        "tlt_cli.processes.launched_rank",
        str(tmp_path / "runs" / "gpu-sglang"),
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_recipe_on_a_machine_without_cuda_is_one_line_exit_2(tmp_path):
    with pytest.raises(RecipeError, match="actor.devices lists GPUs \\[0, 1\\], but CUDA is not available"):
        check_machine(load_checked_recipe(GPU))
    result = runner.invoke(app, ["train", str(GPU), f"run.output_dir={tmp_path}"])
    assert result.exit_code == 2 and "CUDA is not available" in result.output and "Traceback" not in result.output


def test_sglang_backend_without_sglang_installed_is_one_line(tmp_path):
    recipe = load_checked_recipe(TINY, [*SGLANG_ON_CPU, f"rollout.sglang.python={tmp_path / 'no-python'}"])
    with pytest.raises(RecipeError, match="rollout.backend is sglang, but Python interpreter .* does not exist"):
        check_machine(recipe)


def test_speculative_section_as_sglang_batch_rules():
    off = load_checked_recipe(TINY, ["speculative.mode=off"])
    assert batch_rules(speculative_plan(off.speculative)) == [BatchRule(1, None, None)]
    fixed = load_checked_recipe(
        TINY, ["speculative.mode=fixed", "speculative.steps=3", "speculative.topk=2", "speculative.draft_tokens=6"]
    )
    assert batch_rules(speculative_plan(fixed.speculative)) == [BatchRule(1, None, SpeculativeConfig(3, 2, 6))]
    # accept ranges collapse to the rule an unmeasured bucket starts with; equal neighbours merge
    rules = (
        "[{batch: [1, 4], accept: [0, 1.5], use: 'off'}, {batch: [1, 4], accept: [1.5, null], use: s4-k1-t5},"
        " {batch: [5, 8], use: s4-k1-t5, candidates: [s2-k1-t3]}, {batch: [9, null], use: 'off'}]"
    )
    adaptive = load_checked_recipe(TINY, ["speculative.mode=adaptive", f"speculative.rules={rules}"])
    assert batch_rules(speculative_plan(adaptive.speculative)) == [
        BatchRule(1, 8, SpeculativeConfig(4, 1, 5)),
        BatchRule(9, None, None),
    ]


def test_each_worker_owns_consecutive_servers_and_their_ports():
    recipe = load_checked_recipe(
        GPU, ["rollout.sglang.gpus=[0,1,2,3,4,5,6,7]", "rollout.sglang.tp_size=2", "rollout.sglang.port_base=31000"]
    )
    first, second = (servers_of_worker(recipe.rollout.sglang, worker, 2) for worker in (0, 1))
    assert (first.gpus, first.port_base, first.server_count) == ((0, 1, 2, 3), 31000, 2)
    assert (second.gpus, second.port_base, second.server_count) == ((4, 5, 6, 7), 31004, 2)


def test_workers_start_with_only_the_actor_gpus_visible(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with visible_gpus([2, 3]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    with visible_gpus([]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
