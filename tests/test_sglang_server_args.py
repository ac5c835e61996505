"""The launch command of every rule-table configuration, checked against SGLang 0.5.23's own parser.

SGLang cannot be installed beside tlt's torch, so the SGLang checks run SGLang's
`ServerArgs.add_cli_args` / `parse_args` / `from_cli_args`, its adaptive slot router and its
CUDA-graph batch-size list in a separate interpreter: $TLT_SGLANG_PYTHON, by default
/work/sglang-venv/bin/python (how to build it: docs/gpu.md). Without it those tests skip.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tlt_cli.config import RecipeError, ServedDtype, load_recipe
from tlt_cli.recipes import resolve_recipe_path
from tlt_cli.sglang.adaptive import BatchRule, plan_for_sglang, write_adaptive_config
from tlt_cli.sglang.config import SGLangConfig, sglang_config_problem
from tlt_cli.sglang.server_args import (
    LaunchConfigError,
    api_key_config,
    server_command,
    server_environment,
    server_placements,
    speculative_flags,
)
from tlt_cli.sglang.version import sglang_features
from tlt_cli.speculative.types import SpeculativeConfig

SGLANG_PYTHON = os.environ.get("TLT_SGLANG_PYTHON", "/work/sglang-venv/bin/python")
FEATURES = sglang_features("0.5.23")
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
CONFIG = SGLangConfig(gpus=(0, 1, 2, 3), tp_size=2, port_base=31000, extra_args=("--attention-backend", "triton"))
PARSED_FIELDS = (
    "model_path",
    "host",
    "port",
    "nccl_port",
    "api_key",
    "tp_size",
    "base_gpu_id",
    "mem_fraction_static",
    "max_running_requests",
    "dtype",
    "random_seed",
    "skip_tokenizer_init",
    "attention_backend",
    "speculative_algorithm",
    "speculative_draft_model_path",
    "speculative_num_steps",
    "speculative_eagle_topk",
    "speculative_num_draft_tokens",
    "speculative_adaptive",
    "speculative_adaptive_config",
)
# runs inside the SGLang interpreter: parse each argv with SGLang's parser; route batch sizes with its slot router
SGLANG_CHECK = textwrap.dedent(
    """
    import argparse, contextlib, io, json, sys
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
    from sglang.srt.arg_groups.cuda_graph_hook import generate_decode_cuda_graph_batch_sizes
    request = json.load(sys.stdin)
    answers = []
    for argv in request["commands"]:
        parser = argparse.ArgumentParser(prog="sglang.launch_server")
        ServerArgs.add_cli_args(parser)
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                if "--config" in argv:  # as SGLang's prepare_server_args merges the file tlt passes the key in
                    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

                    argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
                namespace = parser.parse_args(argv)
        except SystemExit:
            answers.append({"error": errors.getvalue().strip().splitlines()[-1]})
            continue
        server_args = ServerArgs.from_cli_args(namespace)
        answer = {name: getattr(server_args, name) for name in request["fields"]}
        if server_args.speculative_adaptive:
            router = AdaptiveSpeculativeParams(
                server_args.speculative_num_steps, server_args.speculative_adaptive_config
            )
            router.set_cuda_graph_bs(generate_decode_cuda_graph_batch_sizes(server_args, request["max_batch"]))
            answer["steps_by_batch"] = [
                router.get_steps_for_batch(size) for size in range(1, request["max_batch"] + 1)
            ]
        answer["captured"] = generate_decode_cuda_graph_batch_sizes(server_args, request["max_batch"])
        answers.append(answer)
    print(json.dumps(answers))
    """
)


def run_sglang_check(commands: list[list[str]], max_batch: int = 64) -> list[dict]:
    request = {"commands": commands, "fields": PARSED_FIELDS, "max_batch": max_batch}
    result = subprocess.run(
        [SGLANG_PYTHON, "-c", SGLANG_CHECK], input=json.dumps(request), capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def command_for(plan, tmp_path: Path, server_index: int = 0) -> list[str]:
    adaptive_path = (
        write_adaptive_config(plan, tmp_path / f"slots-{plan.launch.label() if plan.launch else 'off'}.json")
        if plan.mode == "adaptive"
        else None
    )
    flags = speculative_flags(plan, "/models/drafter", adaptive_path)
    placement = server_placements(CONFIG)[server_index]
    key_file = tmp_path / "api_key.yaml"
    key_file.write_text(api_key_config("secret-key"))
    return server_command(CONFIG, placement, "/models/target", key_file, flags, seed=7)


def every_plan() -> list:
    """A static plan for each SD configuration of both tables, the adaptive chain plan, and SD off."""
    plans = [
        plan_for_sglang(REFERENCE_TREE_TABLE, FEATURES, static_batch_size=rule.min_batch)
        for rule in REFERENCE_TREE_TABLE[:-1]
    ]
    plans += [
        plan_for_sglang(CHAIN_TABLE, sglang_features("0.5.12"), static_batch_size=rule.min_batch)
        for rule in CHAIN_TABLE[:-1]
    ]
    plans.append(plan_for_sglang(CHAIN_TABLE, FEATURES))
    plans.append(plan_for_sglang([BatchRule(1, None, None)], FEATURES))
    return plans


def test_placements_split_gpus_into_tensor_parallel_groups_with_own_ports():
    placements = server_placements(CONFIG)
    assert [(p.gpus, p.port, p.nccl_port) for p in placements] == [((0, 1), 31000, 31001), ((2, 3), 31002, 31003)]
    assert server_environment(placements[1], {"PATH": "/bin"}) == {
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "2,3",
        # return_logprob reports log-probs before temperature, as tlt's learner computes them
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "true",
    }


def test_command_carries_the_chosen_configuration(tmp_path):
    plan = plan_for_sglang(REFERENCE_TREE_TABLE, FEATURES)
    command = command_for(plan, tmp_path, server_index=1)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(command)
    assert "--port 31002 --nccl-port 31003" in joined and "--host 127.0.0.1" in joined
    assert "--speculative-algorithm EAGLE --speculative-draft-model-path /models/drafter" in joined
    assert "--speculative-num-steps 8 --speculative-eagle-topk 4 --speculative-num-draft-tokens 48" in joined
    assert command[-2:] == ["--attention-backend", "triton"]
    off = command_for(plan_for_sglang([BatchRule(1, None, None)], FEATURES), tmp_path)
    assert not any(argument.startswith("--speculative") for argument in off)
    # the API key is never on the command line (`ps` shows it to every local user): a --config YAML carries it
    assert "secret-key" not in joined and f"--config {tmp_path / 'api_key.yaml'}" in joined
    assert yaml.safe_load(api_key_config("1234e5")) == {"api-key": "1234e5"}  # a key of digits stays a string


def test_sd_on_without_a_drafter_is_refused():
    with pytest.raises(LaunchConfigError, match="no drafter was given"):
        speculative_flags(plan_for_sglang(CHAIN_TABLE, FEATURES), None, "slots.json")


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"gpus": (0, 1, 2)}, "not a multiple of rollout.sglang.tp_size"),
        ({"gpus": (0, 0)}, "lists a GPU twice"),
        ({"port_base": 65535}, "rollout.sglang.port_base"),
        ({"mem_fraction": 1.5}, "rollout.sglang.mem_fraction"),
        ({"extra_args": ("--port=1",)}, "extra_args sets --port"),
        ({"extra_args": ("--config", "mine.yaml")}, "extra_args sets --config"),
        ({"extra_args": ("--speculative-num-steps", "3")}, "extra_args sets --speculative-num-steps"),
    ],
)
def test_config_errors_name_the_key(changes, key):
    fields = {**CONFIG.__dict__, **changes}
    assert sglang_config_problem(CONFIG) is None
    assert re.search(key, sglang_config_problem(SGLangConfig(**fields)))


def test_the_served_dtype_is_a_choice_refused_where_the_recipe_loads(tmp_path):
    with pytest.raises(
        RecipeError,
        match=r"^override 'rollout.sglang.dtype=fp8': rollout.sglang.dtype must be one of auto, bfloat16, float16, "
        r"float32, got 'fp8'.$",
    ):
        load_recipe(resolve_recipe_path("tiny-cpu"), ["rollout.sglang.dtype=fp8"])
    served = load_recipe(resolve_recipe_path("tiny-cpu"), ["rollout.sglang.dtype=float32"]).rollout.sglang
    assert served.dtype is ServedDtype.float32
    command = server_command(served, server_placements(served)[0], "/models/target", tmp_path / "key.yaml", [], seed=7)
    dtype = command[command.index("--dtype") + 1]
    assert dtype == "float32" and type(dtype) is str


UNCAPTURED_TABLE = [BatchRule(1, 9, SpeculativeConfig(3)), BatchRule(10, None, None)]
MAX_BATCH = 300


@pytest.fixture(scope="module")
def sglang_answers(tmp_path_factory):
    """One run of the SGLang interpreter over every command: each plan, the uncaptured table, a misspelt flag."""
    if not Path(SGLANG_PYTHON).is_file():
        pytest.skip(
            f"no SGLang 0.5.23 interpreter at {SGLANG_PYTHON} "
            "(set TLT_SGLANG_PYTHON; docs/gpu.md shows how to build it)"
        )
    tmp_path = tmp_path_factory.mktemp("sglang_commands")
    plans = every_plan() + [plan_for_sglang(UNCAPTURED_TABLE, FEATURES, auto_off_on_collapse=False)]
    misspelt = command_for(plan_for_sglang(CHAIN_TABLE, FEATURES), tmp_path)[3:]
    misspelt[misspelt.index("--speculative-num-steps")] = "--speculative-num-step-count"
    answers = run_sglang_check([command_for(plan, tmp_path)[3:] for plan in plans] + [misspelt], max_batch=MAX_BATCH)
    return plans, answers


def test_every_rule_table_command_is_accepted_by_sglang_parser(sglang_answers):
    plans, answers = sglang_answers
    for plan, answer in zip(plans, answers):
        assert "error" not in answer, f"{plan.mode} {plan.launch}: {answer}"
        assert answer["model_path"] == "/models/target" and answer["port"] == 31000 and answer["nccl_port"] == 31001
        assert answer["api_key"] == "secret-key" and answer["tp_size"] == 2 and answer["skip_tokenizer_init"] is True
        assert answer["max_running_requests"] == 256 and answer["attention_backend"] == "triton"
        if plan.mode == "off":
            assert answer["speculative_algorithm"] is None
            continue
        assert answer["speculative_algorithm"] == "EAGLE"
        assert answer["speculative_draft_model_path"] == "/models/drafter"
        shape = (
            answer["speculative_num_steps"],
            answer["speculative_eagle_topk"],
            answer["speculative_num_draft_tokens"],
        )
        assert shape == (plan.launch.steps, plan.launch.topk, plan.launch.verified_tokens)
        assert answer["speculative_adaptive"] is (plan.mode == "adaptive")


def test_sglang_parser_rejects_a_misspelt_flag(sglang_answers):
    _plans, answers = sglang_answers
    assert "unrecognized arguments: --speculative-num-step-count" in answers[-1]["error"]


def test_sglang_routes_every_batch_size_to_the_table_depth(sglang_answers):
    """SGLang's own slot router, with its CUDA-graph padding, gives each batch size the table's depth."""
    plans, answers = sglang_answers
    adaptive = [answer for plan, answer in zip(plans, answers) if plan.mode == "adaptive"]
    chain_answer = adaptive[0]
    for batch_size, steps in enumerate(chain_answer["steps_by_batch"], start=1):
        rule = next(rule for rule in CHAIN_TABLE if rule.covers(batch_size))
        assert steps == (0 if rule.speculative is None else rule.speculative.steps), f"batch {batch_size}"


def test_uncaptured_range_end_moves_batches_early_as_the_plan_warns(sglang_answers):
    plans, answers = sglang_answers
    uncaptured_plan, uncaptured_answer = plans[-1], answers[-2]
    assert any("range ends [9]" in line for line in uncaptured_plan.differences)
    # batch 9 is padded to the captured size 10 and lands in the SD-off slot; batch 8 is captured and keeps SD
    assert uncaptured_answer["steps_by_batch"][8 - 1] == 3 and uncaptured_answer["steps_by_batch"][9 - 1] == 0


def test_our_captured_batch_sizes_match_sglang(sglang_answers):
    from tlt_cli.sglang.adaptive import captured_decode_batch_sizes

    _plans, answers = sglang_answers
    assert captured_decode_batch_sizes(MAX_BATCH) == answers[0]["captured"]
